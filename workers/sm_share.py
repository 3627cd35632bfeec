"""Prefill's share of a co-located GPU, following the load (``--prefill-sms auto``).

Prefill's forward passes run in a green context: a stream whose kernels see only some of
the GPU's SMs, so decode's kernels beside them always find SMs free. A fixed share is wrong
both ways: with many sequences decoding, every SM prefill holds slows each of their steps
(on an H200, a 16-32 sequence decode step took 1.2x its time alone beside prefill on 44 SMs,
1.35x beside 66: ``docs/data/colocate_probe_h200.json``); with few or none decoding, or
prompts piling up, the SMs prefill is denied are TTFT lost.

So one green context is made per level (several SM counts, made once: creating one is
slow) and before each of its steps prefill moves to the stream of the level :class:`ShareRule`
picks, ordered after everything it queued before (``wait_stream``). The rule, plain Python:

- nothing decoding: the largest level (there is no step to protect);
- otherwise the smallest level that drains the prompt tokens waiting within ``target``
  seconds at that level's measured rate (prefill tokens per device second, an average per
  level; a level not yet measured is estimated from a measured one in proportion to SMs).

Every step's level is counted (``pdserve_prefill_sm_steps_total{sms}``) and the rates are
logged at DEBUG, so what the rule did is visible.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pdserve.engine.engine import Engine
    from pdserve.engine.outputs import ExecResult, Launched
    from pdserve.engine.sequence import ScheduledBatch

log = logging.getLogger(__name__)

# The levels, as fractions of the GPU's SMs (rounded to an even count).
LEVEL_FRACTIONS = (1 / 3, 1 / 2, 3 / 4)
# Weight of the newest measurement in a level's running rate.
RATE_WEIGHT = 0.3


def levels_for(total: int, fractions: Sequence[float] = LEVEL_FRACTIONS) -> tuple[int, ...]:
    """SM counts of ``total`` at ``fractions`` (even, at least 2, below ``total``), ascending."""
    counts = {min((total - 1) // 2 * 2, max(2, round(total * f / 2) * 2)) for f in fractions}
    return tuple(sorted(c for c in counts if 0 < c < total))


def parse_prefill_sms(value: str) -> str | int:
    """``--prefill-sms``: ``auto``, or a fixed SM count (0: no cap; -1: half the GPU)."""
    if value == "auto":
        return value
    try:
        sms = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: auto, or a number of SMs") from None
    if sms < -1:
        raise argparse.ArgumentTypeError(f"{sms}: auto, 0 (no cap), -1 (half) or a number of SMs")
    return sms


@dataclass
class ShareRule:
    """Which level (an SM count of ``levels``) prefill's next step runs at."""

    levels: tuple[int, ...]
    target: float = 2.0  # seconds: the waiting prompt tokens should drain within this
    rates: dict[int, float] = field(default_factory=dict)  # measured prefill tokens per device second

    def __post_init__(self) -> None:
        if not self.levels or list(self.levels) != sorted(set(self.levels)):
            raise ValueError(f"levels must be distinct SM counts, ascending: {self.levels}")
        if self.target <= 0:
            raise ValueError(f"target must be positive: {self.target}")

    def rate(self, sms: int) -> float | None:
        """``sms``'s rate: measured, else scaled from the nearest measured level."""
        if sms in self.rates:
            return self.rates[sms]
        if not self.rates:
            return None
        near = min(self.rates, key=lambda m: abs(m - sms))
        return self.rates[near] * sms / near

    def choose(self, decoding: int, waiting_tokens: int) -> int:
        if decoding == 0:
            return self.levels[-1]
        for sms in self.levels:
            rate = self.rate(sms)
            if rate is None:  # nothing measured yet: the middle level
                return self.levels[len(self.levels) // 2]
            if waiting_tokens <= rate * self.target:
                return sms
        return self.levels[-1]

    def observe(self, sms: int, tokens: int, seconds: float) -> None:
        """A step at ``sms`` computed ``tokens`` prompt tokens in ``seconds`` of device time."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.rates.get(sms)
        self.rates[sms] = rate if old is None else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * rate


def green_stream(sms: int, device: int) -> torch.cuda.Stream:
    """A stream whose kernels run on ``sms`` SMs of ``device`` (a green context's)."""
    from torch.cuda.green_contexts import GreenContext

    context: Any = GreenContext.create(num_sms=sms, device_id=device)  # torch's stubs lack Stream()
    # Never destroyed: at interpreter exit its tensors' blocks would outlive it ("context is
    # destroyed" in a destructor); the process's end frees it.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(context))
    return context.Stream()


class PrefillShare:
    """Moves the prefill engine between its levels' streams; built in prefill's engine thread
    (the streams' first is made current there), its hooks run there too."""

    def __init__(
        self,
        rule: ShareRule,
        streams: dict[int, Any],
        decode: Engine,
        count: Callable[[int], None] | None = None,
        current_stream: Callable[[], Any] | None = None,
        set_stream: Callable[[Any], None] | None = None,
    ) -> None:
        if current_stream is None or set_stream is None:
            import torch

            current_stream, set_stream = torch.cuda.current_stream, torch.cuda.set_stream
        self._current_stream, self._set_stream = current_stream, set_stream
        self.rule = rule
        self.streams = streams
        self.prefill: Engine | None = None  # the engine it observes (set once that is built)
        self.decode = decode
        self.count = count
        self.current: int | None = None
        self.steps: dict[int, int] = dict.fromkeys(rule.levels, 0)
        self._launched_at: dict[int, int] = {}  # id(launched) -> its level

    @classmethod
    def create(
        cls, device: int, total: int, target: float, decode: Engine, make_stream: Callable[[int, int], Any]
    ) -> PrefillShare:
        levels = levels_for(total)
        streams = {sms: make_stream(sms, device) for sms in levels}
        log.info("prefill's SM share follows the load", extra={"levels": list(levels), "of": total, "target_s": target})
        return cls(ShareRule(levels, target), streams, decode)

    def before_launch(self, batch: ScheduledBatch) -> None:
        assert self.prefill is not None, "PrefillShare.prefill: the engine it observes"
        waiting = self.prefill.num_prefill_tokens_waiting
        sms = self.rule.choose(self.decode.num_running, waiting)
        if sms != self.current:
            stream = self.streams[sms]
            stream.wait_stream(self._current_stream())  # after all prefill queued before
            self._set_stream(stream)
            self.current = sms
        self.steps[sms] += 1
        if self.count is not None:
            self.count(sms)

    def summary(self) -> dict[str, Any]:
        """Steps per level and each measured rate (prompt tokens per device second)."""
        return {
            "steps": {str(k): v for k, v in self.steps.items()},
            "tokens_per_s": {str(k): round(v) for k, v in sorted(self.rule.rates.items())},
        }

    def after_launch(self, launched: Launched) -> None:
        if self.current is not None:
            self._launched_at[id(launched)] = self.current

    def after_collect(self, launched: Launched, result: ExecResult) -> None:
        sms = self._launched_at.pop(id(launched), None)
        if sms is None:
            return
        # Queued behind the step before, a step's span from its start event includes that
        # wait; the span between the two steps' ends does not, when the device was busy.
        # Untimed (no device events), the host's span from launch to collect stands in.
        seconds = result.seconds
        if result.gpu_seconds is not None:
            seconds = min(result.gpu_seconds, result.gpu_period or result.gpu_seconds)
        tokens = sum(n for _, n in launched.batch.prefills)
        self.rule.observe(sms, tokens, seconds)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("prefill share", extra={"sms": sms, "tokens": tokens, "ms": round(seconds * 1e3, 2)})
