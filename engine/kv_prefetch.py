"""Reading ahead from the group tiers (disk, Mooncake Store), the part of
:class:`~pdserve.engine.kv_tiers.KVTiers` that runs on its prefetch thread.

When a request arrives behind others, :meth:`ReadAhead.prefetch` queues the groups of its
prompt that only the group tiers hold; the prefetch thread reads them while it waits (not
from a tier that loads read faster than they take read-ahead groups) into host memory within
``prefetch_bytes`` (oldest dropped first, counted as wasted), so that a later load takes
them from memory (:meth:`ReadAhead._take_prefetched`) instead of reading the tier on the
step's path.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.engine.kv_store import StoreError
from pdserve.engine.threads import helper_thread

if TYPE_CHECKING:
    from pdserve.engine.config import KVTierConfig
    from pdserve.engine.kv_cost import CostEstimates
    from pdserve.engine.kv_host import HostTier
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.kv_write import GroupTier, TierStats

log = logging.getLogger(__name__)


class ReadAhead:
    """The prefetcher of :class:`~pdserve.engine.kv_tiers.KVTiers` (which it is a base of:
    the attributes below are the tiers')."""

    pool: KVPool
    config: KVTierConfig
    group_pages: int
    host: HostTier | None
    groups: list[GroupTier]
    stats: TierStats
    estimates: CostEstimates
    _failure: BaseException | None

    def start_prefetcher(self) -> None:
        # prefetched groups: key -> (tier name, blob), oldest first, within config.prefetch_bytes
        self._fetched: OrderedDict[bytes, tuple[str, bytes | bytearray]] = OrderedDict()
        self._fetched_bytes = 0
        self._fetch_lock = threading.Lock()
        self._prefetches: queue.Queue[tuple[list[bytes], int, int] | None] = queue.Queue(
            maxsize=self.config.max_pending_writes
        )
        self._prefetcher: threading.Thread | None = None
        if self.groups and self.config.prefetch_bytes > 0:
            self._prefetcher = helper_thread(self._prefetch_loop, "kv-tier-prefetch")
            self._prefetcher.start()

    def stop_prefetcher(self) -> None:
        if self._prefetcher is not None:
            self._prefetches.put(None)
            self._prefetcher.join()
            self._prefetcher = None

    def prefetch(self, hashes: Sequence[bytes], start: int, ahead: int = 0) -> bool:
        """Read ahead, on the prefetch thread, the groups of ``hashes[start:]`` (a prompt's
        full pages past those the device holds) that only the group tiers have, into host
        memory, while ``ahead`` requests wait before this one (its wait pays for the read) and
        from a tier whose direct loads are not faster than loads from memory. Returns whether
        it was queued (a full queue drops it: counted nowhere, the load then reads the tier
        itself); never where nothing would be read."""
        if self._prefetcher is None or start >= len(hashes):
            return False
        if not any(self._worth_reading_ahead(t.name, ahead) for t in self.groups):
            # nothing would be read (a request scheduled at once): not even asked, since the
            # asking (a store's round trip to its master, a disk's stats) ran beside the
            # engine's thread for every request (a 512-token prompt of a 7B model with a store
            # that declined every lookup: 1.05x no tier on an H100, 2026-12-06)
            return False
        try:
            self._prefetches.put_nowait((list(hashes), start, ahead))
        except queue.Full:
            return False
        return True

    def _prefetch_loop(self) -> None:
        while True:
            item = self._prefetches.get()
            try:
                if item is None:
                    return
                self._prefetch(*item)
            except (OSError, StoreError) as exc:  # a tier away: the load reads it (or computes) later
                log.warning("KV prefetch failed", extra={"error": str(exc)})
            except Exception as exc:  # a bug: the engine raises it at its next call (as the writer's)
                log.exception("KV prefetch failed")
                self._failure = self._failure or exc
            finally:
                self._prefetches.task_done()

    def _prefetch(self, hashes: list[bytes], start: int, ahead: int) -> None:
        g = self.group_pages
        i = start
        # which tier holds each group of the range, asked once a tier (a store's lookup is a
        # round trip to its master: one for the prefix, not one a group)
        keys = [hashes[end - 1] for end in range((start // g + 1) * g, len(hashes) + 1, g)]
        held = {t.name: {k for k, yes in zip(keys, t.contains_many(keys), strict=True) if yes} for t in self.groups}
        while i < len(hashes):
            if self.host is not None and self.host.contains(hashes[i]):
                i += 1
                continue
            group_end = (i // g + 1) * g
            if group_end > len(hashes):
                return
            key = hashes[group_end - 1]
            with self._fetch_lock:
                have = key in self._fetched
            if not have:
                tier = next((t for t in self.groups if key in held[t.name]), None)
                if tier is None or not self._worth_reading_ahead(tier.name, ahead):
                    return
                blob = tier.get(key)
                if blob is None:
                    return
                self._keep_prefetched(key, tier.name, blob)
            i = group_end

    def _worth_reading_ahead(self, tier: str, ahead: int) -> bool:
        """Whether to read ``tier``'s groups ahead for a request ``ahead`` others wait before:
        only while it waits (one scheduled at once would race its own load for the same
        groups and the interpreter, and a read-ahead group is slower to load than a direct
        read into a pinned buffer), and never from a tier whose loads read at least as fast
        as loads take read-ahead groups (on an H200 a disk in the page cache at 19 GB/s,
        read-ahead groups at 0.6: unchecked, in pageable memory, 2026-12-05)."""
        direct = self.estimates.bytes_per_s.get(tier, 0.0)
        from_memory = self.estimates.bytes_per_s.get("prefetched", 0.0)
        return ahead > 0 and not (direct > 0.0 and from_memory > 0.0 and direct >= from_memory)

    def _keep_prefetched(self, key: bytes, tier: str, blob: bytes | bytearray) -> None:
        with self._fetch_lock:
            self._fetched[key] = (tier, blob)
            self._fetched_bytes += len(blob)
            self.stats.tiers[tier].prefetched_groups += 1
            while self._fetched_bytes > self.config.prefetch_bytes and self._fetched:
                _, (old_tier, old) = self._fetched.popitem(last=False)
                self._fetched_bytes -= len(old)
                self.stats.tiers[old_tier].prefetch_wasted += 1

    def _take_prefetched(self, key: bytes) -> bytes | bytearray | None:
        with self._fetch_lock:
            found = self._fetched.pop(key, None)
            if found is None:
                return None
            self._fetched_bytes -= len(found[1])
            return found[1]

    def drain_prefetches(self) -> None:
        """Block until every queued prefetch is done (tests, benchmarks)."""
        if self._prefetcher is not None:
            self._prefetches.join()
