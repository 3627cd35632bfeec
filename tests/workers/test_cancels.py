"""workers.cancels: a cancel covers what it names and nothing later."""

from __future__ import annotations

from pdserve.schemas import Cancel
from pdserve.workers.cancels import Cancels


def test_a_whole_request_cancel_spares_a_later_request_reusing_the_id() -> None:
    c = Cancels()
    c.note(Cancel(rid="r", issued_at=100.0), now=0.0)
    assert c.applies("r", published_at=99.0)
    assert c.applies("r", attempt=2, published_at=99.5)  # every attempt published before it
    assert not c.applies("r", published_at=101.0)  # a new submission of the same id is served
    assert not c.applies("other", published_at=1.0)


def test_a_cancel_without_a_time_covers_every_submission() -> None:
    c = Cancels()
    c.note(Cancel(rid="r"), now=0.0)
    assert c.applies("r", published_at=1e12) and c.applies("r")


def test_superseding_cancels_older_attempts_only() -> None:
    c = Cancels()
    c.note(Cancel(rid="r", attempt=2, issued_at=100.0), now=0.0)
    assert c.applies("r", attempt=0, published_at=50.0) and c.applies("r", attempt=1, published_at=90.0)
    assert not c.applies("r", attempt=2, published_at=100.0)
    assert not c.applies("r", attempt=3, published_at=120.0)
    c.note(Cancel(rid="r", attempt=1), now=1.0)  # an older supersede does not undo a newer one
    assert c.applies("r", attempt=1, published_at=90.0)


def test_marks_are_forgotten_after_a_while() -> None:
    c = Cancels()
    c.note(Cancel(rid="old"), now=0.0)
    c.note(Cancel(rid="new"), now=500.0)
    c.forget(now=700.0, seconds=600.0)
    assert not c.applies("old") and c.applies("new")
