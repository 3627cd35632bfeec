"""When each request is sent: open-loop arrival schedules.

Inter-arrival gaps follow a gamma distribution with shape ``burstiness`` and mean
``1 / rate``: ``burstiness == 1`` is a Poisson process (exponential gaps), smaller values
are burstier (same mean, larger variance: CV = 1/sqrt(burstiness)), larger values more
regular. ``rate == inf`` sends everything at time 0.
"""

from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int | None = 0) -> list[float]:
    """Send times in seconds from the start, non-decreasing; the first request is at 0."""
    if n < 0:
        raise ValueError("n must be >= 0")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf); got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0; got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    shape = burstiness
    scale = 1.0 / (rate * burstiness)
    offsets = []
    t = 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(shape, scale)
        offsets.append(t)
    return offsets


def offered_rate(offsets: list[float]) -> float | None:
    """The rate the schedule actually offers: (n - 1) gaps over its span; None when it has
    no span (one request, or rate inf)."""
    if len(offsets) < 2 or offsets[-1] <= 0:
        return None
    return (len(offsets) - 1) / offsets[-1]


def parse_rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"request rate must be > 0 or inf; got {text}")
    return value
