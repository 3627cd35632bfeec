"""The last few minutes of latencies and throughput, for the live dashboard (plain Python).

Prometheus histograms answer "since the start" and need a Prometheus to become rates and
percentiles; the ``/dashboard`` page wants both over the last minutes from the API alone.

Samples are not kept one by one: at a few thousand tokens a second a five-minute window
holds hundreds of thousands of ITL samples, and sorting them for every read of
``/dashboard/data`` stalled the API's event loop for tens of milliseconds a second (seen in
``bench/observability_overhead.py``: 33 us of API CPU per output token with a dashboard
open). Each second of the window keeps, per kind, the weight of each logarithmic value
bucket (``RESOLUTION`` apart: percentiles are read within 0.5% of the true sample) and the
sum of its values; a running total over the window is updated as seconds enter and leave
it, so a read costs the number of distinct buckets, not samples.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
RESOLUTION = 1.01  # ratio between neighbouring value buckets
FLOOR = 1e-9  # values at or below it (and zero) share one bucket, read as 0
_LOG = math.log(RESOLUTION)
_ZERO = -(10**9)  # the bucket of zero


def bucket_of(value: float) -> int:
    return _ZERO if value <= FLOOR else math.floor(math.log(value) / _LOG)


def value_of(bucket: int) -> float:
    """The geometric middle of a bucket: within ``sqrt(RESOLUTION)`` of anything in it."""
    return 0.0 if bucket == _ZERO else RESOLUTION ** (bucket + 0.5)


def percentile(values: list[tuple[float, int]], q: float) -> float:
    """The ``q``-th percentile of weighted ``(value, weight)`` samples (nearest rank)."""
    assert values, "no samples"
    ordered = sorted(values)
    total = sum(w for _, w in ordered)
    rank = max(math.ceil(q / 100 * total), 1)
    seen = 0
    for value, weight in ordered:
        seen += weight
        if seen >= rank:
            return value
    return ordered[-1][0]


@dataclass
class _Second:
    at: int  # whole seconds of the caller's clock
    buckets: Counter[int] = field(default_factory=Counter)
    weight: int = 0
    total: float = 0.0  # sum of value * weight


@dataclass
class _Series:
    seconds: deque[_Second] = field(default_factory=deque)
    buckets: Counter[int] = field(default_factory=Counter)  # over every second kept
    weight: int = 0


@dataclass
class Window:
    """TTFT, ITL (one sample per chunk: the gap since the chunk before over its tokens,
    weighted by them) and end-to-end latency, and output tokens per arrival, over the last
    ``seconds``. Times are the caller's clock (``time.monotonic()``), kept to the second."""

    seconds: float = 300.0
    kinds: dict[str, _Series] = field(default_factory=dict)

    def add(self, kind: str, now: float, value: float, weight: int = 1) -> None:
        series = self.kinds.get(kind)
        if series is None:
            series = self.kinds[kind] = _Series()
        at = math.floor(now)
        if not series.seconds or series.seconds[-1].at != at:
            series.seconds.append(_Second(at))
        second = series.seconds[-1]
        bucket = bucket_of(value)
        second.buckets[bucket] += weight
        second.weight += weight
        second.total += value * weight
        series.buckets[bucket] += weight
        series.weight += weight
        self._trim(series, now)

    def _trim(self, series: _Series, now: float) -> None:
        horizon = now - self.seconds
        while series.seconds and series.seconds[0].at + 1 <= horizon:
            gone = series.seconds.popleft()
            series.buckets.subtract(gone.buckets)
            series.weight -= gone.weight
            for bucket in gone.buckets:
                if series.buckets[bucket] <= 0:
                    del series.buckets[bucket]

    def percentiles(self, kind: str, now: float, scale: float = 1.0) -> dict[str, float | int | None]:
        """p50/p90/p99 (times ``scale``) and the sample weight, over the window."""
        series = self.kinds.get(kind)
        if series is not None:
            self._trim(series, now)
        weight = series.weight if series is not None else 0
        out: dict[str, float | int | None] = {"n": weight}
        if series is None or weight <= 0:
            return out | {f"p{q}": None for q in PERCENTILES}
        ordered = sorted(series.buckets.items())
        for q in PERCENTILES:
            rank = max(math.ceil(q / 100 * weight), 1)
            seen, at = 0, ordered[-1][0]
            for bucket, w in ordered:
                seen += w
                if seen >= rank:
                    at = bucket
                    break
            out[f"p{q}"] = round(value_of(at) * scale, 3)
        return out

    def rate(self, kind: str, now: float, seconds: float) -> float:
        """Sum of the values of ``kind`` over the last ``seconds`` (whole seconds), per second."""
        series = self.kinds.get(kind)
        if series is None:
            return 0.0
        since = now - seconds
        return sum(s.total for s in series.seconds if s.at >= since) / seconds

    def series(self, kind: str, now: float, step: float) -> list[float]:
        """Per-second rate of ``kind`` in each ``step``-second bucket of the window, oldest first."""
        buckets = [0.0] * max(int(self.seconds // step), 1)
        start = now - len(buckets) * step
        for second in self.kinds.get(kind, _Series()).seconds:
            i = int((second.at - start) // step)
            if 0 <= i < len(buckets):
                buckets[i] += second.total
        return [round(b / step, 3) for b in buckets]
