"""The last few minutes of latencies and throughput, for the live dashboard (plain Python).

Prometheus histograms answer "since the start" and need a Prometheus to become rates and
percentiles; the ``/dashboard`` page wants both over the last minutes from the API alone.
Samples older than ``seconds`` are dropped as new ones arrive; each kind keeps at most
``max_samples`` (the oldest go first under a flood).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


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
class Window:
    """Samples ``(time, value, weight)`` of TTFT, ITL (one sample per chunk: the gap since
    the chunk before over its tokens, weighted by them) and end-to-end latency, and output
    tokens per arrival. Times are the caller's clock (``time.monotonic()``)."""

    seconds: float = 300.0
    max_samples: int = 200_000
    samples: dict[str, deque[tuple[float, float, int]]] = field(default_factory=dict)

    def add(self, kind: str, now: float, value: float, weight: int = 1) -> None:
        series = self.samples.get(kind)
        if series is None:
            series = self.samples[kind] = deque(maxlen=self.max_samples)
        series.append((now, value, weight))
        self._trim(series, now)

    def _trim(self, series: deque[tuple[float, float, int]], now: float) -> None:
        horizon = now - self.seconds
        while series and series[0][0] < horizon:
            series.popleft()

    def recent(self, kind: str, now: float, seconds: float | None = None) -> list[tuple[float, int]]:
        """``(value, weight)`` of the samples of the last ``seconds`` (default: the window)."""
        horizon = now - (self.seconds if seconds is None else seconds)
        return [(v, w) for t, v, w in self.samples.get(kind, ()) if t >= horizon]

    def percentiles(self, kind: str, now: float, scale: float = 1.0) -> dict[str, float | int | None]:
        """p50/p90/p99 (times ``scale``) and the sample weight, over the window."""
        values = self.recent(kind, now)
        out: dict[str, float | int | None] = {"n": sum(w for _, w in values)}
        for q in PERCENTILES:
            out[f"p{q}"] = round(percentile(values, q) * scale, 3) if values else None
        return out

    def rate(self, kind: str, now: float, seconds: float) -> float:
        """Sum of the values of ``kind`` over the last ``seconds``, per second."""
        return sum(v * w for v, w in self.recent(kind, now, seconds)) / seconds

    def series(self, kind: str, now: float, step: float) -> list[float]:
        """Per-second rate of ``kind`` in each ``step``-second bucket of the window, oldest first."""
        buckets = [0.0] * max(int(self.seconds // step), 1)
        start = now - len(buckets) * step
        for t, v, w in self.samples.get(kind, ()):
            i = int((t - start) // step)
            if 0 <= i < len(buckets):
                buckets[i] += v * w
        return [round(b / step, 3) for b in buckets]
