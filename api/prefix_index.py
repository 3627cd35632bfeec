"""Which worker holds which prefix: an approximate index built from the workers' KV events,
and the rule that places a request on the worker holding most of its prompt.

Plain Python, no I/O. Approximate by design: events travel on core NATS and may be lost, an
eviction may come late, and the index is bounded (the least recently touched hashes go
first). A wrong guess costs time, never correctness: a placed request that its worker does
not take in time goes to the shared queue (``api/gateway.py``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from pdserve.schemas import KVEvents
from pdserve.schemas.kv_events import page_hashes


class PrefixIndex:
    """Page hash (hex) → the workers that announced it, for at most ``max_hashes`` hashes."""

    def __init__(self, max_hashes: int = 200_000) -> None:
        assert max_hashes > 0
        self.max_hashes = max_hashes
        self._holders: OrderedDict[str, set[str]] = OrderedDict()
        self.page_sizes: dict[str, int] = {}  # worker → its page size
        self.pages: dict[str, int] = {}  # worker → hashes the index holds for it

    def __len__(self) -> int:
        return len(self._holders)

    def apply(self, events: KVEvents) -> None:
        worker = events.worker_id
        self.page_sizes[worker] = events.page_size
        count = self.pages.get(worker, 0)
        for h in events.evicted:
            holders = self._holders.get(h)
            if holders is not None and worker in holders:
                holders.discard(worker)
                count -= 1
                if not holders:
                    del self._holders[h]
        for h in events.stored:
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = set()
            else:
                self._holders.move_to_end(h)
            if worker not in holders:
                holders.add(worker)
                count += 1
        self.pages[worker] = count
        while len(self._holders) > self.max_hashes:
            _, gone = self._holders.popitem(last=False)
            for w in gone:
                self.pages[w] -= 1

    def forget(self, workers: Iterable[str]) -> None:
        """Drop every entry of ``workers`` (they left the registry)."""
        gone = set(workers)
        if not gone:
            return
        for h in list(self._holders):
            holders = self._holders[h]
            holders -= gone
            if not holders:
                del self._holders[h]
        for w in gone:
            self.page_sizes.pop(w, None)
            self.pages.pop(w, None)

    def workers(self) -> set[str]:
        return set(self.page_sizes)

    def matches(self, prompt: tuple[int, ...] | list[int], root: bytes | None = None) -> dict[str, int]:
        """Each worker's longest run of leading prompt tokens the index believes it caches
        (workers with none left out); ``root``: the salted chain's start (``cache_salt``)."""
        found: dict[str, int] = {}
        for page_size in sorted(set(self.page_sizes.values())):
            alive = {w for w, size in self.page_sizes.items() if size == page_size}
            for i, h in enumerate(page_hashes(prompt, page_size, root)):
                holders = self._holders.get(h.hex())
                if holders is None:
                    break
                self._holders.move_to_end(h.hex())
                alive &= holders
                if not alive:
                    break
                for w in alive:
                    found[w] = (i + 1) * page_size
        return found


@dataclasses.dataclass(frozen=True)
class Target:
    worker_id: str
    cached_tokens: int


def coldest_worker(candidates: Iterable[str], pages: Mapping[str, int]) -> str | None:
    """The candidate whose cache holds the fewest pages (``pages``: the index's, plus those
    of prefixes just sent its way), ties by id: where a prefix nobody caches yet goes, so
    that the tenants' prefixes spread over the workers instead of each worker caching all."""
    ranked = sorted(candidates, key=lambda w: (pages.get(w, 0), w))
    return ranked[0] if ranked else None


def best_worker(
    matches: Mapping[str, int], candidates: Iterable[str], min_tokens: int, busy: Mapping[str, int] | None = None
) -> Target | None:
    """The candidate with the longest cached prefix of at least ``min_tokens``, or ``None``;
    among equals the least ``busy`` (requests in hand), then the first id."""
    busy = busy or {}
    ranked = sorted(candidates, key=lambda w: (-matches.get(w, 0), busy.get(w, 0), w))
    if not ranked or matches.get(ranked[0], 0) < min_tokens:
        return None
    return Target(ranked[0], matches[ranked[0]])
