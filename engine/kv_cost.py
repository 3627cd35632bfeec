"""Whether loading a cached prefix from a KV tier beats computing it again.

A worker keeps two running estimates: how fast each tier below the device delivers
(bytes a second, measured on each load) and what one more prompt token costs its prefill
(seconds, from the steps that computed prompt tokens). The second is a *marginal* cost: a
step has a fixed part (every weight read once, the launches) that a short prefill pays
almost whole, so a step's seconds over its tokens says little when the tokens are few (on an
H200 a 36-token step of a 7B model takes ~15 ms, 400 us a token, while 8,192 tokens take
30 us a token). Loading a cached prefix saves only the marginal part (the uncached tokens
are computed in a step anyway), so the rate is the slope of seconds against tokens over the
last :data:`READINGS` steps, capped by the cheapest reading's rate; without a spread of
sizes, that cheapest rate (an upper bound of the marginal cost: it can only make loading look
better than it is, as no estimate at all would). A prefix found below the
device is a run of pages in prompt order, each from some tier; only a leading part of it
can be used (a page's KV depends on every token before it). :func:`pages_worth_loading`
picks the length of that leading part that saves the most time against computing it: all
of it where the tiers are fast, none where computing is cheaper (a fast GPU, a slow disk or
a store over tcp), and in between where a fast tier's pages come first and a slow one's
after. Until the prefill has been measured the rule loads (the first load is its measurement);
so it does from a memory tier not measured yet, but a tier named in ``measure_first`` (a disk
or a store, which can be several times slower than computing) is not loaded before its rate
is known: its pages are computed while the caller measures it off the request's path.

A step also has a floor it does not go below however few its tokens (on a GPU the host
launching each layer's kernels: a 7B model's steps of 96 to 384 tokens all took ~10 ms on an
H100): loading part of a prompt saves at most the step's time above the floor for the tokens
still computed (:meth:`CostEstimates.headroom_seconds`), the floor read from a worker's
start-up probes (:meth:`CostEstimates.measure_floor`). A tier's run is loaded whole or not at
all; a disk's or store's load is weighed at :data:`GROUP_LOAD_MARGIN` times its estimate, and
every load at one round trip to its tier (the median of its last lookups) more than its bytes.

Where a tier is slower than computing, its pages can still save time beside the computing:
the leading part of them is computed on the device while the rest is loaded from the tier at
the same time (the later pages' KV is only data: computing the earlier ones does not need it).
:func:`overlap_split` picks the split where the two take about as long. Plain arithmetic, no
I/O: the tests drive it with numbers.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

# Weight of each new reading in the running estimates of the tiers (an exponential average).
SMOOTHING = 0.2
# Prefill steps kept for the marginal cost of a token; a fit needs sizes SPREAD times apart.
READINGS = 32
SPREAD = 2.0
COLLINEAR = 1e-3  # tokens and pairs this close to proportional (1 - correlation²) fit one term
# A step slower than a smaller one scaled up by this (after its tokens' and pairs' growth) paid
# one-time costs (a shape's first kernels, the allocator growing): not a reading of the rate.
ONE_TIME = 1.5
# A page group from a disk or store is weighed at this many times its expected load: its rate
# varies from load to load and its calls cost what its bytes do not show, while a load that
# barely pays by the estimate makes the request slower where the estimate is a little off.
GROUP_LOAD_MARGIN = 1.25
# Steps within this fraction of the fastest one, of sizes SPREAD times apart, show the floor a
# step does not go below however few its tokens (on a GPU the host's launches of every layer's
# kernels; the weights read once): the prefill's floor, measured.
FLAT = 0.1
# Round trips kept for a tier's call time (their median: a client's first calls set up its
# connection, 8 and 4 ms against 0.1 for a store's lookups on this CPU; an average seeded by
# the first one priced every later load of a 2,048-token prefix on an H100 that much dearer,
# and the disk and the store were never asked again, 1.00x no tier, 2026-12-06).
CALLS = 9


def _ema(old: float, new: float) -> float:
    return new if old <= 0.0 else (1.0 - SMOOTHING) * old + SMOOTHING * new


def marginal_cost(readings: Sequence[tuple[int, float]]) -> float:
    """Seconds one more prompt token costs, from ``(tokens, seconds)`` prefill steps (0.0:
    not measured). The least-squares slope where the sizes spread, never above the cheapest
    step's own rate (a step's fixed part is not negative); else that cheapest rate."""
    if not readings:
        return 0.0
    cheapest = min(s / t for t, s in readings)
    sizes = [t for t, _ in readings]
    if max(sizes) >= SPREAD * min(sizes):
        slope, _ = _slope(readings)
        if slope > 0.0:
            return min(slope, cheapest)
    return cheapest


def _slope(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """The least-squares ``(slope, intercept)`` of seconds against tokens (sizes that differ)."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    slope = sum((t - mean_t) * (s - mean_s) for t, s in points) / sum((t - mean_t) ** 2 for t, _ in points)
    return slope, mean_s - slope * mean_t


def _least_squares(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float] | None:
    """Coefficients of the least-squares fit of ``y`` by ``columns`` (None where the columns
    are dependent). The normal equations, each column scaled to a largest value of 1 first
    (tokens and pairs are orders of magnitude apart)."""
    scales = [max(abs(v) for v in c) or 1.0 for c in columns]
    cols = [[v / s for v in c] for c, s in zip(columns, scales, strict=True)]
    k = len(cols)
    m = [[sum(a * b for a, b in zip(ci, cj, strict=True)) for cj in cols] for ci in cols]
    r = [sum(a * b for a, b in zip(ci, y, strict=True)) for ci in cols]
    for i in range(k):  # Gaussian elimination with partial pivoting
        pivot = max(range(i, k), key=lambda row: abs(m[row][i]))
        if abs(m[pivot][i]) <= 1e-12 * max(1.0, max(abs(v) for row in m for v in row)):
            return None
        m[i], m[pivot], r[i], r[pivot] = m[pivot], m[i], r[pivot], r[i]
        for row in range(i + 1, k):
            f = m[row][i] / m[i][i]
            m[row] = [a - f * b for a, b in zip(m[row], m[i], strict=True)]
            r[row] -= f * r[i]
    x = [0.0] * k
    for i in reversed(range(k)):
        x[i] = (r[i] - sum(m[i][j] * x[j] for j in range(i + 1, k))) / m[i][i]
    return [v / s for v, s in zip(x, scales, strict=True)]


def prefill_model(readings: Sequence[tuple[int, float, float]]) -> tuple[float, float]:
    """``(seconds a prompt token, seconds a pair)`` of :func:`prefill_line`."""
    return prefill_line(readings)[1:]


def prefill_line(readings: Sequence[tuple[int, float, float]], is_steady: bool = False) -> tuple[float, float, float]:
    """``(fixed seconds, seconds a prompt token, seconds a pair)`` from ``(tokens, seconds,
    pairs)`` prefill steps, ``pairs`` the (query, key) pairs their attention computed (a chunk
    of ``n`` tokens after ``c`` others: ``n * (c + n / 2)``): the least-squares fit of ``seconds
    = fixed + a * tokens + b * pairs`` with no part negative (where the full fit has a negative
    part, the fit through the origin: no fixed part) where the steps tell tokens and pairs apart;
    else, or where no such fit has an attention term, ``(fixed, marginal_cost, 0.0)``, the
    fixed part what the slope leaves of the steps' mean (0 where the slope is the cheapest
    step's rate). A prefix's
    later tokens cost more than its first (each attends to all before it): on an H200 a 7B model's 2,048-token prompt took 24 us a token, an
    8,192-token one 30. Dropping the attention's term for a negative fixed part priced an
    8,192-token prefix's last pages at a third of their cost there, and a restarted worker
    declined its disk (2026-12-05). ``is_steady``: ``readings`` are :func:`steady`'s already
    (it keeps its own output whole: dropping a reading only loosens the others' bounds)."""
    readings = list(readings) if is_steady else steady(readings)
    if not readings:
        return 0.0, 0.0, 0.0
    slope = marginal_cost([(t, sec) for t, sec, _ in readings])
    n = len(readings)
    sizes = [t for t, _, _ in readings]
    fixed = max(0.0, sum(sec for _, sec, _ in readings) / n - slope * sum(sizes) / n)
    linear = (0.0 if slope >= min(sec / t for t, sec, _ in readings) else fixed, slope, 0.0)
    if n < 3 or max(sizes) < SPREAD * min(sizes):
        return linear
    mt = sum(sizes) / n
    mp = sum(p for _, _, p in readings) / n
    stt = sum((t - mt) ** 2 for t in sizes)
    spp = sum((p - mp) ** 2 for _, _, p in readings)
    stp = sum((t - mt) * (p - mp) for t, _, p in readings)
    det = stt * spp - stp * stp
    if spp <= 0.0 or det <= COLLINEAR * stt * spp:  # pairs that only follow tokens: no second term
        return linear
    tokens = [float(t) for t in sizes]
    pairs = [p for _, _, p in readings]
    seconds = [sec for _, sec, _ in readings]
    for columns in ([[1.0] * n, tokens, pairs], [tokens, pairs]):  # with a fixed part, then through the origin
        fit = _least_squares(columns, seconds)
        if fit is not None:
            *part, a, b = fit
            if a > 0.0 and b > 0.0 and all(v >= 0.0 for v in part):
                return (part[0] if part else 0.0), a, b
    return linear


def prefill_floor(readings: Sequence[tuple[int, float, float]]) -> tuple[float, float, int] | None:
    """``(seconds, seconds a token, widest step's tokens)``: the floor of a prefill step, where
    the steady steps show one: the line through the steps within :data:`FLAT` of the fastest (the
    widest of them: where the steps above the floor begin), if their sizes are
    :data:`SPREAD` times apart (a step that many times larger took about as long; its slope no
    less than 0); None where they do not show one. On an H100 a 7B model's steps of 96 to 384
    tokens took 10.0 to 10.6 ms (the host launching each layer's kernels), 544 tokens 14.8:
    loading 480 of a prompt's 544 tokens saves ~4.8 ms, where a line through all those steps
    priced it at 0.3 and the rule declined even host memory (2026-12-06)."""
    readings = steady(readings)
    if len(readings) < 2:
        return None
    fastest = min(sec for _, sec, _ in readings)
    flat = [(t, sec) for t, sec, _ in readings if sec <= fastest * (1.0 + FLAT)]
    sizes = [t for t, _ in flat]
    if len(flat) < 2 or max(sizes) < SPREAD * min(sizes):
        return None
    slope, intercept = _slope(flat)
    if slope < 0.0:  # flat within the noise: its mean
        return sum(sec for _, sec in flat) / len(flat), 0.0, max(sizes)
    return max(0.0, intercept), slope, max(sizes)


def spreads(readings: Sequence[tuple[int, float, float]], is_steady: bool = False) -> bool:
    """Whether the steady ``(tokens, seconds, pairs)`` prefill steps of ``readings`` differ
    enough in size (:data:`SPREAD`) for a slope: a marginal cost, not a step's whole rate."""
    sizes = [t for t, _, _ in (readings if is_steady else steady(readings))]
    return len(sizes) >= 2 and max(sizes) >= SPREAD * min(sizes)


def steady(readings: Sequence[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """The ``(tokens, seconds, pairs)`` prefill steps that paid no one-time costs: a step is
    dropped where another with no more tokens and pairs, scaled by the larger of the two
    growths, is still :data:`ONE_TIME` times faster (a fixed part only makes a smaller step
    look dearer, so the bound holds for a steady step). On an H100, a fresh process's first
    544-token step took 60 ms against 9.7 for 384 tokens before it, and its slope made a
    store's load of a 512-token prefix look cheaper than computing it: 1.58x the cold time
    (2026-12-06)."""
    if len(readings) < 2:
        return list(readings)
    t, sec, p = (np.array(c, dtype=np.float64) for c in zip(*readings, strict=True))
    smaller = (t[None, :] <= t[:, None]) & (p[None, :] <= p[:, None])  # [i, j]: j no larger than i
    np.fill_diagonal(smaller, False)
    with np.errstate(divide="ignore", invalid="ignore"):
        pairs = np.where((p[:, None] > 0.0) & (p[None, :] > 0.0), p[:, None] / p[None, :], 0.0)
        growth = np.maximum(t[:, None] / t[None, :], pairs)
    bound = np.where(smaller, sec[None, :] * growth * ONE_TIME, np.inf).min(axis=1)
    return [r for r, ok in zip(readings, sec <= bound, strict=True) if ok]


class CostEstimates:
    """One worker's running estimates: ``bytes_per_s`` of each tier's loads, and
    ``prefill_s_per_token``, the marginal cost of a prompt token in its own prefill (0: not
    measured yet), with ``prefill_s_per_pair``, a (query, key) pair of the prefill's attention:
    :func:`prefill_model` of ``prefill_readings``, fitted when next read (a fit is ~0.1 ms of
    the interpreter: at every prefill step, on the engine's thread, it was part of what a tier
    that loads nothing costs a request). Once the readings have spread in size, readings that
    no longer do (a chat's turns, all of one length, pushing the worker's start-up probes out)
    keep the last fit that had a spread rather than fall back to the cheapest step's rate: that
    rate has the step's fixed part in it, and on an H100 it priced a 512-token prompt of a 7B
    model at 24 us a token where its slope was 0.4 (a step there is mostly the host's
    launches), so that a store and a disk were written and loaded where neither could pay
    (1.04x no tier, 2026-12-06)."""

    def __init__(
        self,
        bytes_per_s: dict[str, float] | None = None,
        prefill_s_per_token: float = 0.0,
        prefill_s_per_pair: float = 0.0,
        prefill_floor_s: float = 0.0,
        prefill_fixed_s: float = 0.0,
        prefill_floor_s_per_token: float = 0.0,
    ) -> None:
        self.bytes_per_s: dict[str, float] = dict(bytes_per_s or {})
        # a tier that reads in batches: the bytes of one batch call alone and its seconds (a
        # load of no more than that is one call, without the calls in flight a long load keeps)
        self.one_call: dict[str, tuple[int, float]] = {}
        self.call_seconds: dict[str, float] = {}  # a round trip to each tier (its lookups'): the median of
        self._calls: dict[str, deque[float]] = {}  # the last CALLS
        self.prefill_readings: deque[tuple[int, float, float]] = deque(maxlen=READINGS)
        self._per_token = prefill_s_per_token
        self._per_pair = prefill_s_per_pair
        self._floor = prefill_floor_s
        self._floor_per_token = prefill_floor_s_per_token
        self._fixed = prefill_fixed_s
        self._floor_tokens = 0  # the widest step the floor was measured at (0: none)
        self._unfitted = False  # readings came since the last fit
        self._spread_fit: tuple[float, float, float] | None = None  # the last line of readings that spread
        # a prompt's tokens computed in steps of at most this many (the engine's chunked prefill;
        # 0: one step), each step paying the line's fixed part (:meth:`steps_seconds`)
        self.chunk_tokens = 0

    def _fit(self) -> None:
        if self._unfitted:  # (a heartbeat may read beside the engine's thread: a copy is fitted)
            self._unfitted = False
            # (a step that paid one-time costs is no reading: a fresh process's first 544-token
            # step, 64 ms against 14, alone above the floor priced a token at 117 us, and a
            # restarted worker loaded a 512-token prefix from its disk at 1.18x computing it)
            readings = steady(tuple(self.prefill_readings))
            # the line through the steps above the floor (those at it say nothing of a token's cost)
            # and wider than the floor's widest step, in tokens or attention pairs: a step no
            # larger than that took the floor's time when measured, whatever a noisy spell makes
            # of it (a 512-token prompt of a 7B model on an H100, chunks of 512 and tails of
            # 32-104 tokens after them a little above the floor, fitted 10.3 ms + 7.3 us a token
            # where the probes' 384 tokens took 10 ms; loading 512 of a 576-token turn was then
            # priced at 3.7 ms, where host memory's saved ~6, and a disk that had read 0.86x no
            # tier was declined, 2026-12-06)
            knee, knee_pairs = self._floor_tokens, self._floor_tokens * self._floor_tokens / 2.0
            above = [
                r
                for r in readings
                if r[1] > self.floor_seconds(r[0]) * (1.0 + FLAT) and (r[0] > knee or r[2] > knee_pairs)
            ]
            # (steady once: a fit runs on the engine's thread, ~0.2 ms of this CPU's interpreter
            # with steady three times over, two thirds of it)
            line = prefill_line(above, True) if above else (0.0, min(sec / t for t, sec, _ in readings), 0.0)
            if above and spreads(above, True):
                self._spread_fit = line
            elif self._spread_fit is not None:
                line = self._spread_fit
            self._fixed, self._per_token, self._per_pair = line

    def refresh(self) -> None:
        """Fit the readings noted since the last fit now (a caller with time to spare: the
        engine, once a step is launched), not at the next read of an estimate."""
        self._fit()

    @property
    def prefill_s_per_token(self) -> float:
        self._fit()
        return self._per_token

    @prefill_s_per_token.setter
    def prefill_s_per_token(self, value: float) -> None:
        self._fit()
        self._per_token = value

    @property
    def prefill_s_per_pair(self) -> float:
        self._fit()
        return self._per_pair

    @prefill_s_per_pair.setter
    def prefill_s_per_pair(self, value: float) -> None:
        self._fit()
        self._per_pair = value

    @property
    def prefill_floor_s(self) -> float:
        """The least a prefill step takes, however few its tokens (0: not seen)."""
        self._fit()
        return self._floor

    @property
    def prefill_floor_s_per_token(self) -> float:
        """What a token adds to a step at the floor (the floor's own slope)."""
        self._fit()
        return self._floor_per_token

    def measure_floor(self) -> bool:
        """Take the floor the readings show (:func:`prefill_floor`), if they show one: a worker's
        start-up probes, of sizes chosen apart on a quiet engine. Only theirs: read from a chat's
        steps (chunks, a noisy spell, sizes near one another) a floor came out at a whole turn's
        time, 14.6 ms at 512 tokens on an H100, and host memory was declined (1.04x no tier,
        2026-12-06). Returns whether one was found (the last one found stays otherwise)."""
        floor = prefill_floor(tuple(self.prefill_readings))
        if floor is not None:
            # (its widest step: steps no larger are no reading of the line above it, _fit)
            self._floor, self._floor_per_token, self._floor_tokens = floor
            self._spread_fit = None  # a line fitted through steps at the floor goes
            self._unfitted = bool(self.prefill_readings)  # refitted above it
        return floor is not None

    def keep_fastest(self) -> None:
        """Of readings of one size (their tokens and pairs), keep the fastest, where it stood: the
        start-up probes are timed in more than one round, so that one slow step is no reading (on
        an H100 a restarted worker's probes of 96, 192 and 384 tokens took 36.7, 19.1 and 28.0 ms
        in its one timed round, where a step there takes ~10: no floor showed, and the worker
        loaded every 512-token prefix from its disk, 24.8 ms a prompt against 14.8 computed by a
        fresh process, 2026-12-07)."""
        fastest: dict[tuple[int, float], tuple[int, float, float]] = {}
        for reading in self.prefill_readings:
            key = (reading[0], reading[2])
            if key not in fastest or reading[1] < fastest[key][1]:
                fastest[key] = reading
        self.prefill_readings.clear()
        self.prefill_readings.extend(fastest.values())
        self._unfitted = bool(self.prefill_readings)

    def floor_seconds(self, tokens: int) -> float:
        """A step of ``tokens`` tokens at the floor (0 where none was seen)."""
        return self._floor + self._floor_per_token * tokens if self._floor > 0.0 else 0.0

    @property
    def prefill_fixed_s(self) -> float:
        """The fixed part of the line the steps above the floor follow."""
        self._fit()
        return self._fixed

    def note_load(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0.0:
            self.bytes_per_s[tier] = _ema(self.bytes_per_s.get(tier, 0.0), nbytes / seconds)

    def clear_prefill(self) -> None:
        """Forget the prefill's readings and fits (the next readings start afresh)."""
        self.prefill_readings.clear()
        self._spread_fit = None
        self._unfitted = False
        self._per_token = self._per_pair = self._floor = self._fixed = self._floor_per_token = 0.0
        self._floor_tokens = 0

    def note_prefill(self, tokens: int, seconds: float, pairs: float = 0.0) -> None:
        """A prefill step: ``tokens`` prompt tokens in ``seconds``, its attention ``pairs``
        (:func:`prefill_model`; 0: not known). A step faster than the floor says shows the floor
        too high (the start-up probes ran in a slow spell): the floor comes down to it."""
        if tokens > 0 and seconds > 0.0:
            self.prefill_readings.append((tokens, seconds, pairs))
            self._unfitted = True
            if 0.0 < seconds < self.floor_seconds(tokens):
                # (on an H100 a worker's probes of 96 to 384 tokens took 17-22 ms, its 512-token
                # turns 15: the headroom left by that floor was none, and host memory was declined
                # at every turn, 2026-12-06)
                slope = self._floor_per_token if self._floor_per_token * tokens < seconds else 0.0
                self._floor, self._floor_per_token = seconds - slope * tokens, slope

    def note_call(self, tier: str, seconds: float) -> None:
        """A round trip to ``tier`` (a lookup of a prompt's groups) took ``seconds``: the tier's
        ``call_seconds`` is the median of the last :data:`CALLS` (one slow call, a connection's
        first, does not price every later load)."""
        if seconds > 0.0:
            calls = self._calls.setdefault(tier, deque(maxlen=CALLS))
            calls.append(seconds)
            # (statistics', not numpy's: np.median imports numpy.ma at its first call, 9 ms of a
            # worker's first lookup on a request's path on this project's CPU, 2026-12-07)
            self.call_seconds[tier] = statistics.median(calls)

    def load_seconds(self, tier: str, nbytes: int, calls: int = 1) -> float | None:
        """Expected time to load ``nbytes`` from ``tier`` in ``calls`` round trips (each as
        long as its lookups took: a load of a store's groups asks its master first, as a
        lookup does); None before its first load. Short loads are what the round trip
        weighs on: a store's single group at 512 tokens of a 7B model on an H100 looked
        worth loading by its bytes alone, and the store was asked at every turn (1.07x).
        A load (``calls`` at least 1) of no more bytes than one batch call of the tier reads
        (:attr:`one_call`) is priced at least at that call's rate: the rate a long load
        reads at keeps two calls in flight, which a load of one call does not (on an H100 a
        store read 1.7-1.9 GB/s a call alone where its long loads ran at 3.1-4.1, and a second
        worker's 512-token loads, one call each, took 21 ms where computing took 14: priced
        by the long loads' rate, 2026-12-06)."""
        rate = self.bytes_per_s.get(tier, 0.0)
        if rate <= 0.0:
            return None
        seconds = nbytes / rate + calls * self.call_seconds.get(tier, 0.0)
        one = self.one_call.get(tier)
        if calls >= 1 and one is not None and 0 < nbytes <= one[0]:
            seconds = max(seconds, nbytes * one[1] / one[0])
        return seconds

    def note_one_call(self, tier: str, nbytes: int, seconds: float) -> None:
        """One batch call of ``tier`` alone read ``nbytes`` in ``seconds`` (its calibration's)."""
        if nbytes > 0 and seconds > 0.0:
            self.one_call[tier] = (nbytes, seconds)

    def recompute_seconds(self, tokens: int, start: int = 0) -> float | None:
        """Expected time to compute ``tokens`` prompt tokens after ``start`` others (their
        attention grows with it) above a step's fixed part; None before the first prefill."""
        if self.prefill_s_per_token <= 0.0:
            return None
        return tokens * self.prefill_s_per_token + self.prefill_s_per_pair * tokens * (start + tokens / 2)

    def steps(self, tokens: int) -> int:
        """The prefill steps that compute ``tokens`` prompt tokens (at least one: a prompt
        loaded whole still computes its last token)."""
        return max(1, -(-tokens // self.chunk_tokens)) if self.chunk_tokens > 0 else 1

    def steps_seconds(self, begin: int, end: int | None, loaded: int) -> float:
        """The fixed parts of the steps that loading ``loaded`` of prompt tokens ``begin..end``
        (its first ones) saves: a prompt longer than a step's budget is computed in several
        steps, each reading every weight again (an 8,192-token prompt of a 7B model in four
        steps of 2,048 on an H100, the line's fixed part 12 ms: the rule priced computing it
        at 205 ms against 256 taken, and a store that loads it in 128 ms was declined and not
        written, 2026-12-06). 0 where the prompt's end is not given."""
        if end is None or end <= begin:
            return 0.0
        return self.prefill_fixed_s * (self.steps(end - begin) - self.steps(max(0, end - begin - loaded)))

    def headroom_seconds(self, begin: int, end: int | None, loaded: int = 0) -> float:
        """The most that not computing ``loaded`` of prompt tokens ``begin..end`` (its first
        ones) can save: the steps' expected time above the floor's for the tokens still
        computed (:func:`prefill_floor`: a step of a few tokens takes that anyway), the tokens
        after a loaded prefix computed in as few steps as the chunk allows. Unbounded where no
        floor was seen or the prompt's end is not given."""
        if end is None or self.prefill_floor_s <= 0.0 or end <= begin:
            return float("inf")
        rest = max(0, end - begin - loaded)
        line = self.prefill_fixed_s * self.steps(end - begin) + (self.recompute_seconds(end - begin, begin) or 0.0)
        return max(0.0, line - self.prefill_fixed_s * (self.steps(rest) - 1) - self.floor_seconds(rest))


def _cuts(
    parts: Sequence[int],
    computing: Callable[[int], float],
    bound: Callable[[int], float],
    estimates: CostEstimates,
    end_tokens: int | None,
    at_tokens: int,
    unit_tokens: int,
) -> list[int]:
    """Of a run's leading parts (``parts``: its length in units of ``unit_tokens`` tokens after
    each of its steps, in order, the run beginning at prompt token ``at_tokens``), those where
    the best saving can lie, shortest first: what a part saves is its computing, bounded by
    ``bound``, less its load; the computing is convex in the part's length between the chunk
    boundaries (where it leaves a step out and jumps up), the load linear, so the first part,
    the parts either side of where the computing reaches the bound, and the first part past each
    chunk boundary decide (the steps saved cancel out of computing less bound: the search
    stands): a few loads weighed, not one a page (a host run of 512 pages, 6 ms of this CPU's
    interpreter)."""
    last = len(parts) - 1
    chosen = {0, last}
    if computing(parts[last]) > bound(parts[last]):  # the first part whose computing reaches the bound
        lo, hi = 0, last
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if computing(parts[mid]) > bound(parts[mid]) else (mid + 1, hi)
        chosen |= {lo, max(0, lo - 1)}
    if end_tokens is not None and estimates.chunk_tokens > 0:  # where one step fewer is left to compute
        span, chunk = end_tokens - at_tokens, estimates.chunk_tokens
        for k in range(1, estimates.steps(span)):
            j = bisect.bisect_left(parts, -(-(span - k * chunk) // unit_tokens))
            if j <= last:
                chosen.add(j)
    return [parts[j] for j in sorted(chosen)]


def some_run_pays(
    estimates: CostEstimates,
    tier: str,
    unit_bytes: int,
    unit_tokens: int,
    first: int,
    units: int,
    end_tokens: int | None = None,
    shortest: int = 1,
    ask_seconds: float = 0.0,
) -> bool:
    """Whether loading some leading run of ``units`` units (pages, or groups of pages), at least
    ``shortest`` long, from ``tier``, the run beginning at unit ``first`` of a prompt of
    ``end_tokens`` tokens, is measured cheaper than computing it by more than ``ask_seconds``
    (what finding out costs: a lookup's round trip to the tier, which a load that saves less
    than it cannot repay even when the tier holds the run; a 7B model's 2,048-token chat on an
    H100 asked its store at every turn, about 0.7 ms on the engine's thread, to decline a load
    at its margin, 1.033x no tier, 2026-12-06): a load takes a prefix in
    order, and a unit costs more to compute the later it stands (it attends to all before it),
    so a run that pays only past its first units pays only if long enough. Computing the run's
    first ``k`` units costs an amount convex in ``k``, 0 at ``k = 0``, of which at most the
    step's time above its floor is saved
    (:meth:`CostEstimates.headroom_seconds`): the saving less ``k`` loads is convex up to the
    ``k`` whose computing reaches that bound and falls after it, so the run's first unit, the
    units either side of that ``k`` and the whole run decide; in a prompt longer than a step's
    budget (:attr:`CostEstimates.chunk_tokens`) a load also saves the fixed part of each step
    it leaves out (:meth:`CostEstimates.steps_seconds`, a step up at each ``k`` that leaves one
    step fewer to compute), so those ``k`` decide too. True while the tier or the prefill is
    unmeasured (there is no telling)."""
    shortest = max(1, shortest)
    if units < shortest:
        return False
    if estimates.load_seconds(tier, unit_bytes) is None or estimates.recompute_seconds(unit_tokens) is None:
        return True
    begin = first * unit_tokens

    def load(k: int) -> float:  # (only a disk's or store's runs are weighed here)
        return (estimates.load_seconds(tier, k * unit_bytes) or 0.0) * GROUP_LOAD_MARGIN

    def compute(k: int) -> float:  # the steps it saves included
        tokens = k * unit_tokens
        return (estimates.recompute_seconds(tokens, begin) or 0.0) + estimates.steps_seconds(begin, end_tokens, tokens)

    def bound(k: int) -> float:
        return estimates.headroom_seconds(begin, end_tokens, k * unit_tokens)

    ks = _cuts(range(shortest, units + 1), compute, bound, estimates, end_tokens, begin, unit_tokens)
    return any(min(compute(k), bound(k)) - load(k) > ask_seconds for k in ks)


@dataclass(frozen=True)
class Decision:
    """How many of a prefix's found pages to load (a leading run), and the expected
    seconds saved against computing them (0 when nothing is loaded; None when a tier or
    the prefill was not measured yet, and the rule loaded everything to measure it).
    ``unmeasured``: the ``measure_first`` tiers whose pages were not loaded for want of a rate."""

    pages: int
    saved_seconds: float | None
    unmeasured: tuple[str, ...] = ()


def pages_worth_loading(
    runs: Sequence[tuple[str, int]],
    page_bytes: int,
    page_tokens: int,
    estimates: CostEstimates,
    measure_first: Collection[str] = (),
    start_tokens: int = 0,
    end_tokens: int | None = None,
    cut_runs: bool = False,
) -> Decision:
    """``runs``: the found prefix in prompt order, as (tier, pages) runs, from prompt token
    ``start_tokens`` on, of a prompt of ``end_tokens`` tokens (its step saves at most its time
    above the floor: :meth:`CostEstimates.headroom_seconds`). Returns the leading number of
    pages whose loading saves the most time against computing them (ties: fewer pages, so a
    break-even load is declined). The ``measure_first`` tiers (a disk, a store) are weighed at
    :data:`GROUP_LOAD_MARGIN` times their expected load; a run of one without a rate ends the
    prefix there (named in the decision's ``unmeasured``). A tier's consecutive runs are one,
    taken whole or not at all, unless ``cut_runs``: then its leading runs alone may be taken
    (``runs`` as given: a group, or a page, each), as :func:`some_run_pays` and the writer
    assume a load can."""
    total = sum(n for _, n in runs)
    if total == 0:
        return Decision(0, 0.0)
    if estimates.recompute_seconds(1) is None:
        return Decision(total, None)
    merged: list[tuple[str, list[int]]] = []  # a tier's consecutive groups: one run
    for tier, n in runs:
        if merged and merged[-1][0] == tier:
            merged[-1][1].append(n)
        elif n > 0:
            merged.append((tier, [n]))
    best_pages, best_saved = 0, 0.0
    done = 0
    computed = loaded = 0.0  # of the pages before the run
    unmeasured = False

    def computing(m: int) -> float:
        """Computing the pages before this run and ``m`` of it, the steps they leave out included."""
        whole = estimates.recompute_seconds(m * page_tokens, start_tokens + done * page_tokens) or 0.0
        return computed + whole + estimates.steps_seconds(start_tokens, end_tokens, (done + m) * page_tokens)

    def bound(m: int) -> float:
        return estimates.headroom_seconds(start_tokens, end_tokens, (done + m) * page_tokens)

    def saving(tier: str, m: int, load: float) -> float:
        """Loading the pages before this run and ``m`` of it, against computing them."""
        return min(computing(m), bound(m)) - loaded - load * (GROUP_LOAD_MARGIN if tier in measure_first else 1.0)

    for tier, sizes in merged:
        n = sum(sizes)
        load = estimates.load_seconds(tier, n * page_bytes)
        if cut_runs and load is not None and len(sizes) > 1:  # its leading parts (ties: fewer pages)
            parts = list(itertools.accumulate(sizes[:-1]))  # (pages)
            for m in _cuts(
                parts, computing, bound, estimates, end_tokens, start_tokens + done * page_tokens, page_tokens
            ):
                saved = saving(tier, m, estimates.load_seconds(tier, m * page_bytes) or 0.0)
                if saved > best_saved:
                    best_pages, best_saved = done + m, saved
        if load is None and tier in measure_first:  # computed until the caller has measured it
            return Decision(best_pages, None if unmeasured and best_pages else best_saved, (tier,))
        if load is None:  # a tier not measured yet: loaded (that measures it) if all before it pays
            if best_pages != done:
                break
            load, unmeasured = 0.0, True  # and so are its later runs (a prefix's groups come a run each)
        # by default a run whole or not at all: a part of it cut where the step nears its floor,
        # where neither the step's time nor a short load's is well measured, saved less than its
        # load (a 7B model's 600-token chat turns on an H100: three groups of a disk, 1.09x
        # computing them; host memory's pages cut where a noisy floor said, 1.09x, 2026-12-06)
        saved = saving(tier, n, load)
        if saved > best_saved:
            best_pages, best_saved = done + n, saved
        computed += estimates.recompute_seconds(n * page_tokens, start_tokens + done * page_tokens) or 0.0
        loaded += load * (GROUP_LOAD_MARGIN if tier in measure_first else 1.0)
        done += n
    return Decision(best_pages, None if unmeasured and best_pages else best_saved)


@dataclass(frozen=True)
class Split:
    """Of a run of found pages, compute the leading ``head`` while loading the ``tail`` after
    them; ``seconds`` the longer of the two, ``saved`` against computing them all."""

    head: int
    tail: int
    seconds: float
    saved: float
    load: float = 0.0  # the tail's own load time (without what was queued before it)


def overlap_split(
    runs: Sequence[tuple[str, int]],
    page_bytes: int,
    page_tokens: int,
    estimates: CostEstimates,
    queued: float = 0.0,
    start_tokens: int = 0,
) -> Split | None:
    """``runs``: found pages in prompt order, as (tier, pages), that loading up front does not
    pay for (what :func:`pages_worth_loading` left). The split of them into a computed head and
    a tail loaded meanwhile that ends soonest, or ``None`` where none beats computing them all
    (a tier or the prefill not measured yet, or a tier too slow for even one page's load to hide
    behind the head's computing). ``queued``: seconds of loads already queued ahead of this one
    (one loader serves them in turn); ``start_tokens``: the prompt tokens before the runs."""
    total = sum(n for _, n in runs)
    whole = estimates.recompute_seconds(total * page_tokens, start_tokens)
    if total == 0 or whole is None:
        return None
    per_page: list[float] = []  # each page's load time, in prompt order
    for tier, n in runs:
        one = estimates.load_seconds(tier, page_bytes, calls=0)  # (the tail's one round trip: in ``queued``'s noise)
        if one is None:
            return None
        per_page += [one] * n
    best: Split | None = None
    load = 0.0
    for head in range(total, -1, -1):  # the tail grows a page at a time, from the end
        if head < total:
            load += per_page[head]
        compute = estimates.recompute_seconds(head * page_tokens, start_tokens) or 0.0
        seconds = max(compute, queued + load)
        if best is None or seconds < best.seconds:
            best = Split(head, total - head, seconds, whole - seconds, load)
        if queued + load > whole:
            break  # the tail alone takes longer than computing everything
    return best if best is not None and best.tail > 0 and best.saved > 0.0 else None
