"""bench/two_gpu_pd.py's choices before anything starts: which devices and backend, and the
best goodput over a sweep under either SLO reading."""

from __future__ import annotations

import argparse
import importlib

import pytest
import torch


def args(**kw: object) -> argparse.Namespace:
    base = {"device": "cpu", "worker_devices": None, "backend": None}
    return argparse.Namespace(**{**base, **kw})


def test_devices_and_backend_default_by_device_and_bad_choices_are_clear_errors() -> None:
    two = importlib.import_module("two_gpu_pd")
    assert two.pick_devices(args()) == (["cpu", "cpu"], "gloo", [])
    assert two.pick_devices(args(backend="mooncake")) == (["cpu", "cpu"], "mooncake", [])
    with pytest.raises(SystemExit, match="names two devices"):
        two.pick_devices(args(worker_devices="cpu"))
    if torch.cuda.device_count() == 0:
        with pytest.raises(SystemExit, match="needs CUDA devices"):
            two.pick_devices(args(device="cuda"))
    elif torch.cuda.device_count() == 1:  # NCCL refuses two ranks on one GPU: said before it hangs
        with pytest.raises(SystemExit, match="--backend mooncake"):
            two.pick_devices(args(device="cuda", worker_devices="cuda:0,cuda:0"))


def test_best_goodput_reads_the_chosen_slo_and_skips_points_without_it() -> None:
    two = importlib.import_module("two_gpu_pd")
    points = [
        {"goodput_rps": 1.6, "goodput_rps_max_itl": 0.0},
        {"goodput_rps": 2.4, "goodput_rps_max_itl": 0.3},
        {"goodput_rps": 0.5},  # a run from before the stricter reading
    ]
    run = {"workloads": {"prefill_heavy": {"points": points}}}
    assert two.best_goodput(run, "prefill_heavy") == 2.4
    assert two.best_goodput(run, "prefill_heavy", "goodput_rps_max_itl") == 0.3
    assert two.best_goodput(run, "balanced") is None
