"""CPU workers of one host taking turns at the cores (workers/core_share.py, ``up``'s
``--core-sharing``): one step at a time over a real lock file, between threads and between
processes, a dead holder's turn handed back, and what ``up`` gives each worker."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdserve.children import worker_argv
from pdserve.configs import UsageError
from pdserve.plan import plan_core_turns
from pdserve.workers.core_share import CoreTurns

HOLD = 0.3  # seconds a step holds the turn in these tests


def waiting_step(turns: CoreTurns) -> tuple[threading.Thread, threading.Event]:
    """``turns.before_launch`` in a thread of its own; the event is set once it has the turn."""
    got = threading.Event()

    def step() -> None:
        turns.before_launch(None)
        got.set()

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    return thread, got


def test_a_step_waits_for_the_other_workers_step_and_counts_the_wait(tmp_path: Path) -> None:
    waits: list[float] = []
    a, b = CoreTurns(tmp_path / "turns"), CoreTurns(tmp_path / "turns")
    b.observe = waits.append
    a.before_launch(None)
    thread, got = waiting_step(b)
    assert not got.wait(HOLD), "b stepped while a held the cores"
    a.after_launch(None)
    assert got.wait(10), "b never got its turn"
    thread.join()
    assert b.held and b.turns == 1 and len(waits) == 1 and waits[0] >= HOLD and b.waited == waits[0]
    # a's next step waits for b's in turn; after_collect gives the turn back too
    thread, got = waiting_step(a)
    assert not got.wait(0.1)
    b.after_collect(None, None)
    assert got.wait(10)
    thread.join()
    a.after_launch(None)
    a.after_collect(None, None)  # after after_launch: nothing held, nothing to give back
    assert a.turns == 2 and not a.held and a.summary()["turns"] == 2
    a.close()
    b.close()


HOLDER = """
import sys, time
from pathlib import Path
from pdserve.workers.core_share import CoreTurns
turns = CoreTurns(Path(sys.argv[1]))
turns.before_launch(None)
print("holding", flush=True)
time.sleep(600)
"""


def test_a_worker_that_dies_mid_step_hands_its_turn_back(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "turns")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        live = CoreTurns(tmp_path / "turns")
        thread, got = waiting_step(live)
        assert not got.wait(HOLD), "stepped while another process held the cores"
        holder.kill()  # mid-step: the kernel drops its lock with the process
        assert got.wait(10), "the dead worker's turn was never handed back"
        thread.join()
        live.after_launch(None)
        live.close()
    finally:
        holder.kill()
        holder.wait()


def up_args(tmp_path: Path, **over: object) -> argparse.Namespace:
    base = {
        "core_sharing": None,
        "device": "cpu",
        "worker_devices": None,
        "mode": "pd",
        "colocate": False,
        "pin_cores": False,
        "autoscale": False,
        "data_dir": str(tmp_path),
    }
    return argparse.Namespace(**{**base, **over})


def test_up_has_cpu_pd_workers_take_turns_unless_split_or_pinned(tmp_path: Path) -> None:
    lock = tmp_path / "core-turns"
    assert plan_core_turns(up_args(tmp_path)) == lock  # the default for CPU workers of fixed pools
    assert plan_core_turns(up_args(tmp_path, core_sharing="turns")) == lock
    assert plan_core_turns(up_args(tmp_path, core_sharing="split")) is None
    refusals = ({"device": "cuda"}, {"mode": "unified"}, {"colocate": True}, {"pin_cores": True}, {"autoscale": True})
    for over in refusals:
        assert plan_core_turns(up_args(tmp_path, **over)) is None  # by default: a split, or nothing to share
        with pytest.raises(UsageError, match="--core-sharing turns"):
            plan_core_turns(up_args(tmp_path, core_sharing="turns", **over))


def test_each_worker_is_started_with_the_lock(tmp_path: Path) -> None:
    from pdserve.cli import build_parser

    args = build_parser().parse_args(["up", "--data-dir", str(tmp_path)])
    argv = worker_argv(args, "decode", tmp_path, "nats://127.0.0.1:4222", 2, core_turns=tmp_path / "core-turns")
    assert argv[argv.index("--core-turns") + 1] == str(tmp_path / "core-turns")
    assert argv[argv.index("--num-threads") + 1] == "2"
    assert "--core-turns" not in worker_argv(args, "decode", tmp_path, "nats://127.0.0.1:4222", 1)


def test_a_lock_file_that_cannot_be_opened_is_a_usage_error(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pdserve.launch import take_turns

    engine = SimpleNamespace(runner=SimpleNamespace(device=SimpleNamespace(type="cpu")), observer=None)
    with pytest.raises(UsageError, match=r"--core-turns .*cannot open the lock file"):
        take_turns(str(tmp_path / "no-such-dir" / "core-turns"), engine)
    assert engine.observer is None
    gpu = SimpleNamespace(runner=SimpleNamespace(device=SimpleNamespace(type="cuda")), observer=None)
    with pytest.raises(UsageError, match="for CPU workers"):
        take_turns(str(tmp_path / "core-turns"), gpu)
