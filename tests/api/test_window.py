"""The dashboard's window of recent latencies and throughput."""

from __future__ import annotations

import random

import pytest

from pdserve.api.window import Window, percentile


def test_weighted_percentiles_count_each_sample_by_its_weight() -> None:
    values = [(0.010, 1), (0.020, 8), (0.500, 1)]
    assert percentile(values, 50) == 0.020
    assert percentile(values, 90) == 0.020
    assert percentile(values, 99) == 0.500
    assert percentile([(3.0, 1)], 1) == 3.0


def approx(got: dict, want: dict) -> bool:
    """Percentiles read from buckets: within 1% of the samples."""
    return got.keys() == want.keys() and all(
        g == w if w is None or k == "n" else g == pytest.approx(w, rel=0.01)
        for (k, g), w in zip(got.items(), want.values(), strict=True)
    )


def test_old_samples_leave_the_window() -> None:
    w = Window(seconds=60.0)
    w.add("ttft", 0.0, 9.0)
    w.add("ttft", 50.0, 1.0)
    assert approx(w.percentiles("ttft", 55.0), {"n": 2, "p50": 1.0, "p90": 9.0, "p99": 9.0})
    w.add("ttft", 100.0, 2.0)  # the sample at 0 s is now older than the window
    assert approx(w.percentiles("ttft", 100.0, scale=1000.0), {"n": 2, "p50": 1000.0, "p90": 2000.0, "p99": 2000.0})
    assert w.percentiles("itl", 100.0) == {"n": 0, "p50": None, "p90": None, "p99": None}
    assert w.percentiles("ttft", 1000.0) == {"n": 0, "p50": None, "p90": None, "p99": None}


def test_window_percentiles_match_exact_ones_within_the_resolution() -> None:
    rng = random.Random(3)
    w = Window(seconds=30.0)
    kept = []
    for i in range(20_000):
        t, v, n = i * 0.003, rng.lognormvariate(-4, 1.5), rng.randint(1, 4)
        if rng.random() < 0.02:
            v = 0.0  # a token that came in the same chunk as the one before
        w.add("itl", t, v, n)
        if t >= 60.0 - 30.0:  # the whole seconds inside the window
            kept.append((v, n))
    got = w.percentiles("itl", 60.0)
    assert got["n"] == sum(n for _, n in kept)
    for q in (50, 90, 99):
        assert got[f"p{q}"] == pytest.approx(round(percentile(kept, q), 3), rel=0.011, abs=1e-3)


def test_rates_and_series_sum_values_per_second() -> None:
    w = Window(seconds=20.0)
    for t in range(20):
        w.add("tokens", float(t), 10.0)  # 10 tokens every second
    assert w.rate("tokens", 19.5, 10.0) == pytest.approx(10.0)
    series = w.series("tokens", 20.0, 5.0)
    assert series == [10.0, 10.0, 10.0, 10.0]


def test_memory_is_bounded_by_seconds_and_buckets_not_samples() -> None:
    w = Window(seconds=10.0)
    for i in range(100_000):
        w.add("itl", i * 0.001, 0.01 + (i % 7) * 0.001, 3)
    series = w.kinds["itl"]
    assert len(series.seconds) <= 11 and len(series.buckets) <= 7
    assert w.percentiles("itl", 100.0)["n"] == 3 * sum(1 for i in range(100_000) if i * 0.001 >= 90.0)
