"""What a worker remembers of ``Cancel`` messages, to drop work that arrives after its
cancel (a redelivery, a superseded attempt). Plain Python, no I/O.

A cancel of the whole request applies to submissions of its ``rid`` published up to the
cancel's ``issued_at``, so a later request that reuses the id is served. A cancel of
attempts below ``n`` (a migration) applies to those attempts only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.schemas import Cancel

MEMORY_SECONDS = 600.0


@dataclass
class Mark:
    published_before: float = -math.inf  # whole-request cancel: submissions published up to this
    attempts_below: int = 0  # superseded attempts
    noted_at: float = 0.0  # monotonic


class Cancels:
    def __init__(self) -> None:
        self._marks: dict[str, Mark] = {}

    def note(self, cancel: Cancel, now: float) -> None:
        mark = self._marks.setdefault(cancel.rid, Mark())
        mark.noted_at = now
        if cancel.attempt > 0:
            mark.attempts_below = max(mark.attempts_below, cancel.attempt)
        else:
            mark.published_before = max(mark.published_before, cancel.issued_at or math.inf)

    def applies(self, rid: str, attempt: int = 0, published_at: float = 0.0) -> bool:
        """Whether a cancel noted here covers attempt ``attempt`` of ``rid`` published at
        ``published_at`` (0: unknown, covered by any whole-request cancel)."""
        mark = self._marks.get(rid)
        if mark is None:
            return False
        if attempt < mark.attempts_below:
            return True
        return mark.published_before > -math.inf and (published_at == 0.0 or published_at <= mark.published_before)

    def forget(self, now: float, seconds: float = MEMORY_SECONDS) -> None:
        """Drop marks older than ``seconds`` (a redelivery comes long before)."""
        cutoff = now - seconds
        for rid in [rid for rid, mark in self._marks.items() if mark.noted_at < cutoff]:
            del self._marks[rid]
