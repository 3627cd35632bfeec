"""The helpers of bench/serving_sweep.py: crossover analysis, SLO choice, goodput, cleanup."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

from pdserve.bench.metrics import SLO, RequestRecord


def test_crossover_interpolates_sign_changes(sweep: ModuleType) -> None:
    text = sweep.crossover([1, 2, 4, 8], [1.0, 2.5, 3.0, 6.0], [1.5, 2.0, 4.0, 4.0], "PD", "unified")
    # below at 1 (-0.5), above at 2 (+0.5): interpolated at 1.5; below at 4 (-1), above at 8 (+2): 4 + 4/3
    assert "PD goodput overtakes unified between 1 and 2 req/s (about 1.50 req/s)" in text
    assert "PD goodput falls below unified between 2 and 4 req/s (about 2.67 req/s)" in text
    assert "PD goodput overtakes unified between 4 and 8 req/s (about 5.33 req/s)" in text


def test_crossover_ties_and_no_crossover(sweep: ModuleType) -> None:
    leave = sweep.crossover([1, 2, 4], [1.0, 2.0, 2.5], [1.01, 2.0, 4.0], "PD", "unified")
    assert leave == "PD goodput falls below unified between 2 and 4 req/s (tied, within 5%, up to 2)."
    assert "within 5% of each other" in sweep.crossover([1, 2], [1.0, 2.0], [1.02, 1.99], "PD", "unified")
    assert "PD goodput is above unified" in sweep.crossover([1, 2], [2.0, 3.0], [1.0, 2.0], "PD", "unified")
    assert "PD goodput is below unified" in sweep.crossover([1, 2], [1.0, 1.0], [2.0, 2.0], "PD", "unified")
    assert "overtakes" in sweep.crossover([1, 2], [1.0, 2.0], [1.02, 1.99], "PD", "unified", tie=0.0)


def test_auto_slo_rounds_up_best_p50(sweep: ModuleType) -> None:
    runs = {
        "pd": [{"metrics": {"ttft_ms": {"p50": 40.0}, "tpot_ms": {"p50": 7.0}}}],
        "unified": [{"metrics": {"ttft_ms": {"p50": 55.0}, "tpot_ms": {"p50": 6.0}}}],
    }
    slo = sweep.auto_slo(runs, 3.0, None, None)
    assert (slo.ttft_ms, slo.itl_ms, slo.itl_metric) == (200.0, 20.0, "tpot")  # 120 -> 200, 18 -> 20
    assert sweep.auto_slo(runs, 3.0, 1000.0, 5.0) == SLO(1000.0, 5.0, "tpot")
    assert [sweep._nice(x) for x in (0.9, 1.0, 1.1, 3, 7, 49, 51)] == [1.0, 1.0, 2.0, 5.0, 10.0, 50.0, 100.0]


def test_goodput_from_saved_rows(sweep: ModuleType) -> None:
    rows = [
        RequestRecord(i, ok=True, ttft=t, latency=t + 0.3, output_tokens=4).row() for i, t in enumerate((0.05, 0.5))
    ]
    rows.append(RequestRecord(2, ok=False, error="x").row())
    point = {"metrics": {"duration_s": 2.0}, "requests": rows}
    assert sweep.goodput(point, SLO(ttft_ms=100, itl_ms=200)) == (0.5, pytest.approx(1 / 3))


def test_group_alive_sees_own_group() -> None:
    from system import _group_alive

    assert _group_alive(os.getpgrp())
    assert not _group_alive(2**22 + 12345)
