"""CPU workers sharing the cores by load (workers/core_share.py, ``up --share-cores``): the
rule in plain Python over a real shared file, and what ``up`` hands each worker."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.configs import UsageError
from pdserve.plan import plan_core_share
from pdserve.workers.core_share import STALE, CoreShare, parse_core_share


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_worker_takes_every_thread_alone_and_its_share_beside_busy_ones(tmp_path: Path) -> None:
    clock, calls = Clock(), {"a": [], "b": [], "c": []}
    path = tmp_path / "share"
    a, b, c = (CoreShare(path, i, 3, 4, calls[k].append, clock) for i, k in enumerate("abc"))
    a.before_launch(None)
    assert calls["a"] == [4]  # alone: all four
    b.before_launch(None)
    assert calls["b"] == [2]  # a is mid-step: half
    c.before_launch(None)
    assert calls["c"] == [1]  # two others busy: a third of 4, at least 1
    a.after_launch(None)
    b.after_launch(None)
    c.after_launch(None)
    b.before_launch(None)
    assert calls["b"] == [2, 4]  # the others finished: all again
    b.before_launch(None)
    assert calls["b"] == [2, 4]  # unchanged: not set again
    assert b.steps == {2: 1, 4: 2}


def test_a_worker_that_died_mid_step_stops_counting_after_stale_seconds(tmp_path: Path) -> None:
    clock, seen = Clock(), []
    dead = CoreShare(tmp_path / "share", 0, 2, 2, lambda n: None, clock)
    dead.before_launch(None)  # and never after_launch
    live = CoreShare(tmp_path / "share", 1, 2, 2, seen.append, clock)
    live.before_launch(None)
    live.after_launch(None)
    clock.now += STALE + 1
    live.before_launch(None)
    assert seen == [1, 2]


def test_the_share_file_argument_is_checked() -> None:
    assert parse_core_share("/d/core-share:1:2") == (Path("/d/core-share"), 1, 2)
    for bad in ("/d/core-share", "/d/x:2:2", "/d/x:a:2"):
        with pytest.raises(ValueError, match="--core-share"):
            parse_core_share(bad)


def up_args(tmp_path: Path, **over: object) -> argparse.Namespace:
    base = {
        "share_cores": True,
        "device": "cpu",
        "worker_devices": None,
        "mode": "pd",
        "colocate": False,
        "pin_cores": False,
        "autoscale": False,
        "data_dir": str(tmp_path),
    }
    return argparse.Namespace(**{**base, **over})


def test_up_gives_each_cpu_worker_its_slot_and_refuses_what_cannot_share(tmp_path: Path) -> None:
    (tmp_path / "core-share").write_bytes(b"\xff" * 16)  # an earlier run's marks
    assert plan_core_share(up_args(tmp_path), ["prefill", "decode"]) == [
        f"{tmp_path / 'core-share'}:0:2",
        f"{tmp_path / 'core-share'}:1:2",
    ]
    assert not (tmp_path / "core-share").exists()  # made fresh by the workers
    assert plan_core_share(up_args(tmp_path, share_cores=False), ["prefill", "decode"]) is None
    for over in ({"device": "cuda"}, {"mode": "unified"}, {"colocate": True}, {"pin_cores": True}, {"autoscale": True}):
        with pytest.raises(UsageError, match="--share-cores"):
            plan_core_share(up_args(tmp_path, **over), ["prefill", "decode"])
