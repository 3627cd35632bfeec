"""workers.holds: a hold ends on release, cancel or expiry, never while a lease runs, and a
lease names the generation it reads."""

from __future__ import annotations

from pdserve.workers.holds import Holds


def test_release_frees_only_the_named_generation() -> None:
    holds = Holds()
    gen = holds.hold("r", 0, 0.0, 30.0, now=0.0)
    assert not holds.release("r", gen + 1) and "r" in holds
    assert holds.release("r", gen) and "r" not in holds
    assert not holds.release("r", gen)  # a second release is a no-op


def test_each_hold_gets_a_new_generation() -> None:
    holds = Holds()
    first = holds.hold("r", 0, 0.0, 30.0, now=0.0)
    assert holds.release("r", 0)
    second = holds.hold("r", 1, 0.0, 30.0, now=0.0)
    assert second != first
    assert holds.lease("r", first, 5.0, now=1.0) is not None  # a stale handle is refused
    assert holds.lease("r", second, 5.0, now=1.0) is None


def test_lease_of_what_is_not_held_is_refused_with_a_reason() -> None:
    holds = Holds()
    assert "no KV is held" in (holds.lease("gone", 1, 5.0, now=0.0) or "")


def test_cancel_during_a_lease_frees_when_the_lease_ends() -> None:
    holds = Holds()
    gen = holds.hold("r", 0, 0.0, 30.0, now=0.0)
    assert holds.lease("r", gen, 5.0, now=1.0) is None
    assert not holds.end("r", now=2.0)  # a read is in flight: doomed, not freed
    assert holds.lease("r", gen, 5.0, now=2.5) is not None  # no new reader of doomed pages
    assert holds.due(now=5.9) == []
    assert holds.due(now=6.1) == [("r", False)]
    assert "r" not in holds


def test_release_during_a_lease_frees_at_once() -> None:
    holds = Holds()
    gen = holds.hold("r", 0, 0.0, 30.0, now=0.0)
    assert holds.lease("r", gen, 5.0, now=1.0) is None
    assert holds.release("r", gen)


def test_expiry_waits_for_a_running_lease() -> None:
    holds = Holds()
    gen = holds.hold("r", 0, 0.0, 3.0, now=0.0)
    assert holds.lease("r", gen, 5.0, now=2.0) is None
    assert holds.due(now=4.0) == []  # expired, but leased until 7
    assert holds.due(now=7.5) == [("r", True)]


def test_cancel_without_a_lease_frees_at_once() -> None:
    holds = Holds()
    holds.hold("r", 0, 0.0, 30.0, now=0.0)
    assert holds.end("r", now=1.0) and len(holds) == 0
    assert not holds.end("r", now=1.0)


def test_is_leased_says_whether_any_read_may_run() -> None:
    holds = Holds()
    gen = holds.hold("r", 0, 0.0, 30.0, now=0.0)
    holds.hold("s", 0, 0.0, 30.0, now=0.0)
    assert not holds.is_leased(now=1.0)
    holds.lease("r", gen, 5.0, now=1.0)
    assert holds.is_leased(now=5.9) and not holds.is_leased(now=6.1)
