"""The prefill worker's held KV: which requests' pages wait for a decode worker, under
which generation, until when, and whether a reader has them leased. Plain Python, no I/O:
the worker frees the pages of whatever these methods say is done.

A hold ends on release, cancel or expiry, but never while a lease is running: a cancel
or an expiry during a read only dooms the hold, and it ends when the lease does. A lease
names the generation of the hold it wants; any other generation (a handle from an earlier
hold of the same request, whose pages may have been reused) is refused.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

MAX_LEASE_SECONDS = 60.0


@dataclass
class Hold:
    generation: int
    attempt: int
    published_at: float  # of the request (which submission of its rid this is)
    until: float  # monotonic: the hold expires after this
    lease_until: float = 0.0  # monotonic: a reader may be reading until this
    doomed: bool = False  # ends as soon as no lease runs

    def is_leased(self, now: float) -> bool:
        return now < self.lease_until


class Holds:
    def __init__(self) -> None:
        self._holds: dict[str, Hold] = {}
        # Generations are unique across restarts of a worker that keeps its id.
        self._generations = itertools.count(time.time_ns())

    def __contains__(self, rid: str) -> bool:
        return rid in self._holds

    def __len__(self) -> int:
        return len(self._holds)

    def get(self, rid: str) -> Hold | None:
        return self._holds.get(rid)

    def hold(self, rid: str, attempt: int, published_at: float, seconds: float, now: float) -> int:
        """Start holding ``rid``'s pages for ``seconds``; returns the hold's generation."""
        assert rid not in self._holds, f"{rid} is already held"
        generation = next(self._generations)
        self._holds[rid] = Hold(generation, attempt, published_at, now + seconds)
        return generation

    def lease(self, rid: str, generation: int, seconds: float, now: float) -> str | None:
        """Keep ``rid``'s hold ``generation`` for a read of up to ``seconds``. ``None`` when
        granted, else why not."""
        hold = self._holds.get(rid)
        if hold is None:
            return "no KV is held for this request (released, cancelled or expired)"
        if hold.generation != generation:
            return "the KV held for this request is of another generation"
        if hold.doomed:
            return "the KV of this request is being freed"
        hold.lease_until = max(hold.lease_until, now + min(seconds, MAX_LEASE_SECONDS))
        return None

    def release(self, rid: str, generation: int) -> bool:
        """The reader is done with hold ``generation`` (0: whichever): True when the pages
        are to be freed now (the hold is gone)."""
        hold = self._holds.get(rid)
        if hold is None or generation not in (0, hold.generation):
            return False
        del self._holds[rid]
        return True

    def end(self, rid: str, now: float) -> bool:
        """Cancel the hold: True when the pages are to be freed now, False when there is
        no hold or a lease runs (then they are freed when it ends, see :meth:`due`)."""
        hold = self._holds.get(rid)
        if hold is None:
            return False
        if hold.is_leased(now):
            hold.doomed = True
            return False
        del self._holds[rid]
        return True

    def due(self, now: float) -> list[tuple[str, bool]]:
        """Holds that end now, with whether each expired unclaimed (else it was doomed)."""
        done = []
        for rid, hold in list(self._holds.items()):
            if hold.is_leased(now) or not (hold.doomed or now > hold.until):
                continue
            del self._holds[rid]
            done.append((rid, not hold.doomed))
        return done

    def rids(self) -> list[str]:
        return list(self._holds)

    def is_leased(self, now: float) -> bool:
        """Whether a reader may be reading any hold now."""
        return any(hold.is_leased(now) for hold in self._holds.values())
