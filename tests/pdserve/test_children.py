"""pdserve.children: the restart and retire pass over real (tiny) processes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pdserve.autoscale import Pool
from pdserve.children import Child, tend

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
EXIT = [sys.executable, "-c", "raise SystemExit(3)"]


def wait_exit(child: Child) -> None:
    assert child.process is not None
    child.process.wait(timeout=30)


def test_a_dead_child_is_restarted_after_its_back_off() -> None:
    child = Child("prefill", 0, EXIT)
    child.start()
    wait_exit(child)
    children = [child]
    now = time.monotonic()
    tend(children, now)
    assert child.process is None and child.restarts == 1 and child.restart_at == now + 1.0
    tend(children, now + 0.5)
    assert child.process is None, "not before the back-off"
    tend(children, now + 1.0)
    assert child.process is not None and children == [child]
    wait_exit(child)


def test_a_retired_child_drains_is_dropped_and_never_restarted() -> None:
    children: list[Child] = []
    pool = Pool("decode", SLEEP, children)
    pool.scale_to(3, {})
    assert len(pool.serving()) == 3
    pids = [c.pid for c in children]
    # The busiest stays; among the idle the newest goes first.
    pool.scale_to(1, {pids[0]: 0, pids[1]: 4, pids[2]: 0})
    assert [c.pid for c in pool.serving()] == [pids[1]]
    assert {c.pid for c in pool.retiring()} == {pids[0], pids[2]}
    for child in pool.retiring():
        wait_exit(child)  # SIGTERM ended them
    tend(children)
    assert children == pool.serving() and len(children) == 1
    children[0].stop()
    wait_exit(children[0])


def test_a_retired_child_that_will_not_stop_is_killed(tmp_path: Path) -> None:
    from pdserve.children import RETIRE_KILL_SECONDS

    ready = tmp_path / "ready"
    ignore_sigterm = "import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    child = Child(
        "prefill", 0, [sys.executable, "-c", ignore_sigterm + f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"]
    )
    child.start()
    deadline = time.monotonic() + 30
    while not ready.exists():  # its handler is in place
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.retire()
    children = [child]
    assert child.retired_at is not None
    tend(children, child.retired_at + 1.0)
    assert children == [child] and child.process is not None and child.process.poll() is None
    tend(children, child.retired_at + RETIRE_KILL_SECONDS + 1.0)
    wait_exit(child)
    tend(children)
    assert children == []


def test_workers_leave_a_core_in_eight_to_the_api_and_the_broker() -> None:
    from pdserve.children import threads_per_worker

    assert threads_per_worker(1, cores=2) == 2, "on fewer than eight cores nothing is held back"
    assert threads_per_worker(2, cores=2) == 1
    assert threads_per_worker(1, cores=16) == 14
    assert threads_per_worker(2, cores=16) == 7
    assert threads_per_worker(3, cores=8) == 2
    assert threads_per_worker(4, cores=2) == 1, "never fewer than one thread"
