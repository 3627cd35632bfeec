"""The dashboard's window of recent latencies and throughput."""

from __future__ import annotations

import pytest

from pdserve.api.window import Window, percentile


def test_weighted_percentiles_count_each_sample_by_its_weight() -> None:
    values = [(0.010, 1), (0.020, 8), (0.500, 1)]
    assert percentile(values, 50) == 0.020
    assert percentile(values, 90) == 0.020
    assert percentile(values, 99) == 0.500
    assert percentile([(3.0, 1)], 1) == 3.0


def test_old_samples_leave_the_window() -> None:
    w = Window(seconds=60.0)
    w.add("ttft", 0.0, 9.0)
    w.add("ttft", 50.0, 1.0)
    assert w.percentiles("ttft", 55.0) == {"n": 2, "p50": 1.0, "p90": 9.0, "p99": 9.0}
    w.add("ttft", 100.0, 2.0)  # the sample at 0 s is now older than the window
    assert w.percentiles("ttft", 100.0, scale=1000.0) == {"n": 2, "p50": 1000.0, "p90": 2000.0, "p99": 2000.0}
    assert w.percentiles("itl", 100.0) == {"n": 0, "p50": None, "p90": None, "p99": None}


def test_rates_and_series_sum_values_per_second() -> None:
    w = Window(seconds=20.0)
    for t in range(20):
        w.add("tokens", float(t), 10.0)  # 10 tokens every second
    assert w.rate("tokens", 19.5, 10.0) == pytest.approx(10.0)
    series = w.series("tokens", 20.0, 5.0)
    assert series == [10.0, 10.0, 10.0, 10.0]


def test_a_flood_keeps_at_most_max_samples() -> None:
    w = Window(seconds=1e9, max_samples=100)
    for i in range(1000):
        w.add("itl", float(i), 0.01, 3)
    assert len(w.samples["itl"]) == 100
    assert w.percentiles("itl", 1000.0)["n"] == 300
