"""Whether loading a cached prefix from a KV tier beats computing it again.

A worker keeps two running estimates: how fast each tier below the device delivers
(bytes a second, measured on each load) and how long its own prefill takes a token
(seconds, measured on each step that computed prompt tokens). A prefix found below the
device is a run of pages in prompt order, each from some tier; only a leading part of it
can be used (a page's KV depends on every token before it). :func:`pages_worth_loading`
picks the length of that leading part that saves the most time against computing it: all
of it where the tiers are fast, none where computing is cheaper (a fast GPU, a slow disk or
a store over tcp), and in between where a fast tier's pages come first and a slow one's
after. Until a tier or the prefill has been measured the rule loads (the first load is its
measurement). Plain arithmetic, no I/O: the tests drive it with numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Weight of each new reading in the running estimates (an exponential average).
SMOOTHING = 0.2


def _ema(old: float, new: float) -> float:
    return new if old <= 0.0 else (1.0 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class CostEstimates:
    """One worker's running estimates: ``bytes_per_s`` of each tier's loads, and
    ``prefill_s_per_token`` of its own prefill (0: not measured yet)."""

    bytes_per_s: dict[str, float] = field(default_factory=dict)
    prefill_s_per_token: float = 0.0

    def note_load(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0.0:
            self.bytes_per_s[tier] = _ema(self.bytes_per_s.get(tier, 0.0), nbytes / seconds)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0.0:
            self.prefill_s_per_token = _ema(self.prefill_s_per_token, seconds / tokens)

    def load_seconds(self, tier: str, nbytes: int) -> float | None:
        """Expected time to load ``nbytes`` from ``tier``; None before its first load."""
        rate = self.bytes_per_s.get(tier, 0.0)
        return nbytes / rate if rate > 0.0 else None

    def recompute_seconds(self, tokens: int) -> float | None:
        """Expected time to compute ``tokens`` prompt tokens; None before the first prefill."""
        return tokens * self.prefill_s_per_token if self.prefill_s_per_token > 0.0 else None


@dataclass(frozen=True)
class Decision:
    """How many of a prefix's found pages to load (a leading run), and the expected
    seconds saved against computing them (0 when nothing is loaded; None when a tier or
    the prefill was not measured yet, and the rule loaded everything to measure it)."""

    pages: int
    saved_seconds: float | None


def pages_worth_loading(
    runs: Sequence[tuple[str, int]], page_bytes: int, page_tokens: int, estimates: CostEstimates
) -> Decision:
    """``runs``: the found prefix in prompt order, as (tier, pages) runs. Returns the leading
    number of pages whose loading saves the most time against computing them (ties: fewer
    pages, so a break-even load is declined)."""
    total = sum(n for _, n in runs)
    if total == 0:
        return Decision(0, 0.0)
    if estimates.recompute_seconds(1) is None:
        return Decision(total, None)
    best_pages, best_saved = 0, 0.0
    done, saved = 0, 0.0
    unmeasured = False
    for tier, n in runs:
        load = estimates.load_seconds(tier, n * page_bytes)
        if load is None:  # a tier not measured yet: loaded (that measures it) if all before it pays
            if best_pages != done:
                break
            load, unmeasured = 0.0, True  # and so are its later runs (a prefix's groups come a run each)
        compute = estimates.recompute_seconds(n * page_tokens)
        assert compute is not None
        saved += compute - load
        done += n
        if saved > best_saved:
            best_pages, best_saved = done, saved
    return Decision(best_pages, None if unmeasured and best_pages else best_saved)
