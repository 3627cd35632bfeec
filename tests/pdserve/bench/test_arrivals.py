"""Arrival schedules: Poisson mean rate, gamma burstiness, seeded reproducibility."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from pdserve.bench.arrivals import arrival_offsets, offered_rate


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(offsets)]


def test_poisson_mean_rate_and_cv() -> None:
    offs = arrival_offsets(20000, rate=10.0, burstiness=1.0, seed=1)
    gaps = _gaps(offs)
    assert offs[0] == 0.0
    assert all(g >= 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert offered_rate(offs) == pytest.approx(10.0, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_mean_changes_variance(burstiness: float) -> None:
    gaps = _gaps(arrival_offsets(20000, rate=5.0, burstiness=burstiness, seed=2))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_seeded_and_reproducible() -> None:
    a = arrival_offsets(100, 3.0, 1.0, seed=7)
    assert a == arrival_offsets(100, 3.0, 1.0, seed=7)
    assert a != arrival_offsets(100, 3.0, 1.0, seed=8)


def test_infinite_rate_and_edge_cases() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert offered_rate([0.0] * 5) is None
    assert arrival_offsets(0, 1.0) == []
    assert arrival_offsets(1, 1.0) == [0.0]
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, burstiness=0.0)
