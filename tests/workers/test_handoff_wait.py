"""When a co-located decode step waits for the request its prefill is about to hand over."""

from __future__ import annotations

from pdserve.workers.runtime import HANDOFF_MARGIN, HANDOFF_SLACK, handoff_deadline


def test_waits_for_a_handoff_expected_before_the_step_ends() -> None:
    # step started at t=10.000 and takes 8 ms; first tokens expected at 10.002
    deadline = handoff_deadline(10.002, 10.0, 0.008, now=10.0005)
    assert deadline == min(10.002 + HANDOFF_SLACK, 10.008 - HANDOFF_MARGIN)
    assert deadline <= 10.008 - HANDOFF_MARGIN  # the next step is still launched in time


def test_no_wait_when_the_handoff_would_miss_the_step_anyway() -> None:
    assert handoff_deadline(10.0075, 10.0, 0.008, now=10.001) is None


def test_no_wait_without_a_handoff_or_a_step_time() -> None:
    assert handoff_deadline(None, 10.0, 0.008, now=10.001) is None
    assert handoff_deadline(10.002, 10.0, 0.0, now=10.001) is None


def test_no_wait_when_the_deadline_has_passed() -> None:
    # expected long ago (the prediction was short): schedule at once
    assert handoff_deadline(9.9, 10.0, 0.008, now=10.001) is None
    assert handoff_deadline(10.0045, 10.0, 0.008, now=10.0049) is None
