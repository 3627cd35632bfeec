"""CPU workers of one host taking turns at its cores (``pdserve up`` PD on a CPU host).

A prefill and a decode worker on the same few cores cannot both step well at once: with a
fixed split each gets its share even while the other has nothing to do, and the decode
worker keeps stepping on its share with a half-full batch while prompts queue at prefill;
with more OpenMP threads than cores, a thread preempted mid-operation holds up its whole
team. Here every worker runs on all the cores, one step at a time: before a step it takes
the host's turn (an exclusive ``flock`` on a file in the data directory, which the kernel
hands back when a worker dies, even mid-step), and gives it back as soon as the forward pass
is done, so the other role's waiting step goes next. On 2 cores (SmolLM2, 256 in / 64 out,
2026-12-05, docs/cpu.md): 43.8 / 180.0 out tok/s at 1 / 16 in flight, 1.06x / 0.96x of
unified serving's; a fixed split of a thread each 32.8 / 157.1.

The cost: a decode step waits for the prefill chunk in progress, as in unified serving;
workers with cores of their own (``up --pin-cores``, other hosts) do not wait. The time each
step waited is a histogram of the worker's ``/metrics`` (``pdserve_core_turn_wait_seconds``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class CoreTurns:
    """The engine's :class:`~pdserve.engine.engine.StepObserver`: each step run holding the
    exclusive lock of ``path`` (shared by every worker of the host), taken before the
    forward pass and given back right after it."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.perf_counter) -> None:
        # O_CLOEXEC: a child of this worker (a tensor-parallel rank, a helper) must not
        # hold the lock's open file past this process.
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.path = path
        self._clock = clock
        self.turns = 0
        self.waited = 0.0  # seconds, all turns
        self.held = False
        self.observe: Callable[[float], None] | None = None  # each turn's wait (a histogram)

    def before_launch(self, batch: Any) -> None:
        started = self._clock()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.held = True
        wait = self._clock() - started
        self.turns += 1
        self.waited += wait
        if self.observe is not None:
            self.observe(wait)

    def after_launch(self, launched: Any) -> None:
        # A CPU step's work is done when launch returns (torch's CPU operators are synchronous).
        self._release()

    def after_collect(self, launched: Any, result: Any) -> None:
        self._release()  # a no-op unless launch failed between the two

    def _release(self) -> None:
        if self.held:
            self.held = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def summary(self) -> dict[str, float]:
        return {"turns": self.turns, "waited_s": round(self.waited, 3)}

    def close(self) -> None:
        self._release()
        os.close(self._fd)
