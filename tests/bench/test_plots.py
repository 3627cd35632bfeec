"""The goodput plots the multi-GPU benchmarks draw (bench/common.py's ``plot_goodput``):
drawn from a run's JSON as the scripts write it, a panel per workload and a line per system."""

from __future__ import annotations

import importlib
import struct
from pathlib import Path
from typing import Any


def point(rate: float, goodput: float) -> dict[str, Any]:
    return {"rate": rate, "goodput_rps": goodput}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "a PNG"
    return struct.unpack(">II", data[16:24])


def test_two_gpu_pd_draws_pd_and_the_unified_replicas_from_its_json(tmp_path: Path) -> None:
    two = importlib.import_module("two_gpu_pd")
    run = {
        "workloads": {
            "prefill_heavy": {"input_len": 2048, "output_len": 128, "points": [point(3, 2.9), point(8, 6.1)]},
            "balanced": {"input_len": 512, "output_len": 512, "points": [point(3, 3.0)]},
        }
    }
    result = {
        "gpus": ["NVIDIA H200", "NVIDIA H200"],
        "slo": {"ttft_ms": 1000.0, "itl_ms": 30.0},
        "pd": {"label": "PD (1 prefill + 1 decode)", **run},
        "unified": {"label": "unified (2 workers)", **run},
    }
    out = tmp_path / "img" / "two_gpu_pd.png"
    two.plot(result, out)
    width, height = png_size(out)
    assert width > 2 * height, "two panels side by side"
    one = tmp_path / "one.png"
    two.plot(
        {**result, "unified": None, "pd": {"label": "PD", "workloads": {"balanced": run["workloads"]["balanced"]}}}, one
    )
    assert png_size(one)[0] < width, "one workload, one panel"


def test_xpyd_draws_through_the_same_plot(tmp_path: Path) -> None:
    xpyd = importlib.import_module("xpyd")
    result = {
        "num_gpus": 4,
        "gpus": [],
        "slo": {"ttft_ms": 1000.0, "itl_ms": 30.0},
        "workloads": {"prefill_heavy": {"input_len": 2048, "output_len": 128}},
        "systems": {"1P3D": {"workloads": {"prefill_heavy": {"points": [point(4, 3.5)]}}}},
    }
    out = tmp_path / "xpyd.png"
    xpyd.plot(result, out)
    assert png_size(out)[1] > 0


def test_the_longest_gap_reading_is_drawn_dashed_beside_each_system_that_has_it(tmp_path: Path) -> None:
    two = importlib.import_module("two_gpu_pd")
    strict = [{**point(3, 1.6), "goodput_rps_max_itl": 0.0}, {**point(8, 2.4), "goodput_rps_max_itl": 0.0}]
    pd = {"workloads": {"prefill_heavy": {"input_len": 2048, "output_len": 128, "points": strict}}}
    old = {"workloads": {"prefill_heavy": {"input_len": 2048, "output_len": 128, "points": [point(3, 1.1)]}}}
    result = {
        "gpus": ["NVIDIA H200"],
        "worker_devices": ["cuda:0", "cuda:0"],
        "slo": {"ttft_ms": 1000.0, "itl_ms": 30.0},
        "pd": {"label": "PD", **pd},
        "unified": {"label": "unified", **old},  # a run from before the stricter reading: one line
    }
    assert two.plot(result, tmp_path / "p.png") == ["PD", "PD, longest gap", "unified"]
