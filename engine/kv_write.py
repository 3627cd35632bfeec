"""Write-through to the group tiers (disk, Mooncake Store), the part of
:class:`~pdserve.engine.kv_tiers.KVTiers` that runs on its writer thread.

A page group is offered once computed (:meth:`WriteThrough.offer`). Unless every group tier
already holds it, its pages are snapshotted (on a GPU: gathered on a side stream and copied
to a reused pinned buffer, so the compute stream waits only for the gather) and queued; the
writer thread encodes the group (:mod:`.kv_blob`) and puts it into each tier that lacks it.
A full queue drops the write (counted), never blocks a step. The writer also measures each
tier's load rate off the request path (:meth:`WriteThrough.calibrate`), reading groups as a
load does (up to :data:`LOAD_THREADS` at once): the group of the tier's first write, the last
:data:`LOAD_THREADS` written once there are as many (that reading replaces the narrower one),
the last ones every :data:`RECALIBRATE_EVERY` writes after, and at start groups a tier already
holds.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.engine import kv_blob
from pdserve.engine.kv_buffers import ReadBuffer, ReadBuffers
from pdserve.engine.kv_cost import some_run_pays
from pdserve.engine.kv_pool import page_index
from pdserve.engine.kv_store import StoreError
from pdserve.engine.threads import helper_pool, helper_thread

if TYPE_CHECKING:
    from pdserve.engine.config import KVTierConfig
    from pdserve.engine.kv_cost import CostEstimates
    from pdserve.engine.kv_pool import KVPool

log = logging.getLogger(__name__)

TIER_NAMES = ("host", "disk", "store")


class GroupTier(Protocol):
    """A tier of page-group blobs (disk, store). Methods may block."""

    name: str
    local: bool  # asking it what it holds costs no round trip (a disk: a file's stat; a store: its master)

    def contains(self, key: bytes) -> bool: ...
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...  # in one round trip where it can
    def get(self, key: bytes) -> bytes | bytearray | None: ...
    def get_into(self, key: bytes, buffer: ReadBuffer) -> memoryview | bytearray | None: ...  # into a reused buffer
    def prepare(self, buffers: Sequence[ReadBuffer]) -> int: ...  # before its first reads into them
    def put(self, key: bytes, *parts: bytes | memoryview) -> None: ...  # a blob, in parts
    def discard(self, key: bytes) -> None: ...


@dataclass
class TierCounters:
    """Cumulative counts of one tier."""

    hit_pages: int = 0  # pages loaded from this tier into the pool
    load_bytes: int = 0
    stored_pages: int = 0  # pages written into this tier
    store_bytes: int = 0
    corrupt: int = 0  # blobs that failed their checks (treated as misses)
    declined_pages: int = 0  # found here, computed instead (kv_cost: loading was the slower)
    prefetched_groups: int = 0  # groups read ahead into host memory while their request waited
    prefetch_hits: int = 0  # of those, groups a load then took from memory
    prefetch_wasted: int = 0  # of those, groups dropped unused (the memory's limit; the request went elsewhere)
    calibrations: int = 0  # groups read back off the request path to measure this tier's rate (KVTiers.calibrate)
    overlapped_pages: int = 0  # pages loaded beside the computing of the prefix before them (KVTiers.load_behind)
    unbuffered_reads: int = 0  # group reads into a fresh buffer: every reused one was out (kv_buffers)
    saved_seconds: float = 0.0  # what its loads were expected to save against computing (the rule's estimates)
    skipped_lookups: int = 0  # prefix lookups not asked of it: no run of the prefix from it could pay
    unwritten_groups: int = 0  # computed groups not written to it: no leading run of them could be worth loading


@dataclass
class TierStats:
    tiers: dict[str, TierCounters] = field(default_factory=lambda: {n: TierCounters() for n in TIER_NAMES})
    lookups: int = 0  # prefix lookups that went below the device
    missed_pages: int = 0  # pages those lookups wanted and no tier had
    write_drops: int = 0  # groups not written: the writer's queue was full
    snapshot_allocations: int = 0  # snapshot buffers pinned on the engine's thread: none was free
    write_errors: int = 0  # groups a tier failed to take (logged)
    already_held: int = 0  # computed groups every (local) tier already held: not copied off the device
    held_at_write: int = 0  # groups copied off the device that every tier turned out to hold (a store's: asked there)
    lookup_seconds: float = 0.0
    load_seconds: float = 0.0


_REMEMBERED_GROUPS = 1 << 16
# A tier's rate is measured again (a group read back by the writer) every this many groups it
# takes: a rate measured slow once (a busy moment) would otherwise decline the tier for good,
# since declined loads measure nothing.
RECALIBRATE_EVERY = 32
LOAD_THREADS = 4  # a load's group reads at once (kv_tiers.KVTiers.load), and a calibration's
# A load keeps two batch reads of a store in flight (its read buffers: 2 x LOAD_THREADS groups):
# a calibration of a tier that reads in batches makes as many calls at once.
CALIBRATION_CALLS = 2
CALIBRATION_ROUNDS = 3  # ... each made this many times, one after another (see calibrate)
_PINNED_KEPT = 64  # pinned snapshot buffers kept for reuse (a GPU pool's group writes)
# Snapshot buffers pinned at the writer's start, in one allocation: a process's first request
# otherwise pinned each of its groups' buffers on the engine's thread, on its own path.
PINNED_AT_START = 16


@dataclass
class _Write:
    key: bytes
    pages: torch.Tensor  # on the host
    ready: torch.cuda.Event | None
    tiers: tuple[str, ...]  # the group tiers to write it to (those where a load of it could pay)


@dataclass
class _Calibrate:
    """A measurement of ``tier`` for the writer: time reading ``keys`` back."""

    tier: GroupTier
    keys: tuple[bytes, ...]


class WriteThrough:
    """The writer of :class:`~pdserve.engine.kv_tiers.KVTiers` (which it is a base of: the
    attributes below are the tiers')."""

    pool: KVPool
    config: KVTierConfig
    ident: bytes
    group_pages: int
    groups: list[GroupTier]
    stats: TierStats
    estimates: CostEstimates
    _failure: BaseException | None
    _read_buffers: ReadBuffers

    def _read_buffer(self, tier: str) -> ReadBuffer | None:
        """A reused buffer for a read from group tier ``tier`` (its blob of a group); ``None``
        for the host tier, or when all are out (counted: that read gets a fresh buffer)."""
        if tier == "host":
            return None
        buffer = self._read_buffers.take()
        if buffer is None:
            self.stats.tiers[tier].unbuffered_reads += 1
        return buffer

    def start_writer(self, max_pending: int) -> None:
        self._written: OrderedDict[bytes, frozenset[str]] = OrderedDict()  # groups lately given to tiers
        self._queue: queue.Queue[_Write | _Calibrate | None] = queue.Queue(maxsize=max_pending)
        self._copy_stream: torch.cuda.Stream | None = None  # a GPU pool's group snapshots (see _enqueue)
        self._pinned_free: list[torch.Tensor] = []  # their pinned buffers, for reuse
        self._pinned_lock = threading.Lock()
        if self.groups and self.pool.device.type == "cuda":
            shape = (PINNED_AT_START, self.group_pages, *self.pool.tensor.shape[1:])
            self._pinned_free = list(torch.empty(shape, dtype=self.pool.tensor.dtype, pin_memory=True).unbind(0))
        self._writes_since_calibration = dict.fromkeys((t.name for t in self.groups), 0)  # when to measure again
        self._unwritten = dict.fromkeys((t.name for t in self.groups), 0)  # groups not given a tier since it took one
        self._measuring: set[str] = set()  # tiers with a measurement queued by measure_soon
        self._recent = {t.name: deque[bytes](maxlen=LOAD_THREADS) for t in self.groups}  # groups written last
        self._width = dict.fromkeys((t.name for t in self.groups), 0)  # groups read at once by the rate's reading
        self._calibrator: ThreadPoolExecutor | None = None
        self._writer: threading.Thread | None = None
        if self.groups:
            self._writer = helper_thread(self._write_loop, "kv-tier-writer")
            self._writer.start()
            for tier in self.groups:  # a tier that already holds groups (a restart): measured now,
                sample = getattr(tier, "sample_keys", None)  # before the worker takes a request
                keys = sample(LOAD_THREADS) if sample is not None else []
                if keys:
                    self.calibrate(tier, keys)
                elif getattr(tier, "shared", False):
                    self._probe(tier)

    def _probe(self, tier: GroupTier) -> None:
        """Measure a shared tier (a store, which cannot list what it holds) before the worker
        takes a request: other workers' groups may be found there at its first lookup, and
        timing the tier then cost that request a group's read (a second worker's first reply
        1.4x a cold one at 2,048 tokens on an H100, 2026-12-05). :data:`LOAD_THREADS` probe
        groups (the pool's first pages) are read back as :meth:`calibrate` reads, written first
        where missing. They stay: every worker of the model shares the same probe keys (its
        store namespace is the model's and layout's identity), a store's read leases an object
        for seconds (not removable then), and the master evicts them under pressure like any
        other. A tier that fails here stays unmeasured (logged), timed at its first use."""
        keys = [hashlib.blake2b(b"pdserve-probe" + bytes([i]), digest_size=16).digest() for i in range(LOAD_THREADS)]
        try:
            missing = [key for key, held in zip(keys, tier.contains_many(keys), strict=True) if not held]
            if missing:
                pages = self.pool.tensor[: self.group_pages].cpu()
                for key in missing:
                    tier.put(key, *kv_blob.encode_parts(self.ident, key, pages))
        except (OSError, StoreError) as exc:  # another worker's put of the same key at once, a full store
            log.warning("KV tier probe groups not all written", extra={"tier": tier.name, "error": str(exc)})
        try:
            measured = self.calibrate(tier, keys)
        except (OSError, StoreError) as exc:
            measured = False
            log.warning("KV tier not measured at start", extra={"tier": tier.name, "error": str(exc)})
        if not measured:
            log.warning("KV tier not measured at start: timed at its first use", extra={"tier": tier.name})

    def stop_writer(self) -> bool:
        """Finish the queued writes and stop the writer; False if there was none."""
        if self._writer is None:
            return False
        self._queue.put(None)
        self._writer.join()
        self._writer = None
        if self._calibrator is not None:
            self._calibrator.shutdown()
            self._calibrator = None
        return True

    def offer(self, hashes: Sequence[bytes], page_table: Sequence[int], old_full: int, new_full: int) -> None:
        """Pages ``old_full..new_full`` of a sequence became full and indexed: queue the page
        groups of the sequence each tier should take and does not have yet.

        A tier takes a sequence's groups once a leading run of them could be worth loading
        from it (:meth:`_tiers_worth_writing`, by the measured rates: a load takes a prefix's
        groups from its first, so a group is only ever loaded with all those before it). Until
        then none is copied off the device for it, and the groups stay unmarked for it, so that
        the sequence's later pages (or a longer prompt sharing them) bring them all."""
        self.check()
        if not self.groups:
            return
        g = self.group_pages
        fresh_from = (old_full // g + 1) * g
        if fresh_from > new_full:  # no group completed (most decode steps' pages): nothing changed
            return
        ends = range(g, new_full + 1, g)
        wanted = self._tiers_worth_writing(len(ends))
        forced: list[tuple[int, str]] = []  # (group end, tier): written for a measurement
        for tier in self.groups:
            if tier.name in wanted:
                continue
            for e in range(fresh_from, new_full + 1, g):  # every RECALIBRATE_EVERY one is written anyway
                if tier.name in self._written.get(hashes[e - 1], ()):
                    continue
                self._unwritten[tier.name] += 1
                if self._unwritten[tier.name] >= RECALIBRATE_EVERY:
                    self._unwritten[tier.name] = 0
                    self._writes_since_calibration[tier.name] = RECALIBRATE_EVERY  # measured after its write
                    forced.append((e, tier.name))
                else:
                    self.stats.tiers[tier.name].unwritten_groups += 1
        needs: dict[int, set[str]] = {}
        for e in ends:
            have = self._written.get(hashes[e - 1], frozenset())
            missing = {name for name in wanted if name not in have}
            if missing:
                needs[e] = missing
        for e, name in forced:
            needs.setdefault(e, set()).add(name)
        # Groups a local tier already holds (a restarted worker computing what its disk has)
        # are not copied off the device for it. Only local tiers are asked: a store's master is
        # a round trip, which here, on the engine's thread after the step that filled the
        # groups, would delay that step's tokens (the writer asks it before writing instead).
        for tier in self.groups:
            asked = [e for e, names in needs.items() if tier.name in names] if tier.local else []
            if asked:
                for e, held in zip(asked, tier.contains_many([hashes[e - 1] for e in asked]), strict=True):
                    if held:
                        needs[e].discard(tier.name)
                        self._mark(hashes[e - 1], (tier.name,))
        todo: list[tuple[bytes, Sequence[int], tuple[str, ...]]] = []
        for e, names in needs.items():
            key = hashes[e - 1]
            if not names:
                self.stats.already_held += 1
                continue
            self._mark(key, tuple(names))
            todo.append((key, page_table[e - g : e], tuple(t.name for t in self.groups if t.name in names)))
        self._enqueue(todo)

    def _mark(self, key: bytes, tiers: tuple[str, ...]) -> None:
        """Remember ``key`` as given to (or found in) ``tiers`` (the most recent groups)."""
        self._written[key] = self._written.get(key, frozenset()) | frozenset(tiers)
        self._written.move_to_end(key)
        if len(self._written) > _REMEMBERED_GROUPS:
            self._written.popitem(last=False)

    def _unmark(self, key: bytes, tier: str) -> None:
        """Forget that ``tier`` holds ``key`` (it was found missing there)."""
        have = self._written.get(key)
        if have is not None and tier in have:
            self._written[key] = have - {tier}

    def _tiers_worth_writing(self, groups: int) -> set[str]:
        """The group tiers a sequence of ``groups`` full page groups should be written to: those
        for which some leading run of them could be worth loading
        (:func:`~pdserve.engine.kv_cost.some_run_pays`: each group's computing where it stands
        in the prompt, less its load at the tier's rate, as the loads weigh it); every tier while
        its rate or the prefill is unmeasured, with ``--kv-tier-load always`` and with overlap on
        (a slower tier's pages still load beside the computing). A group no load would take is
        neither copied off the device nor written (a first or second worker with a store at 512
        tokens of a 7B model on an H100: 1.08x a cold one, writing, 2026-12-06). A load is asked
        for first (a lookup's round trip): a run that would save less than that is not worth
        writing either, as it is not worth asking for (:meth:`KVTiers._cannot_pay`)."""
        g = self.group_pages
        if self.config.load == "always" or self.config.overlap:
            return {t.name for t in self.groups}
        unit_bytes, unit_tokens = g * self.pool.page_bytes, g * self.pool.layout.page_size
        return {
            t.name
            for t in self.groups
            if some_run_pays(
                self.estimates,
                t.name,
                unit_bytes,
                unit_tokens,
                0,
                groups,
                groups * unit_tokens,
                ask_seconds=self.estimates.call_seconds.get(t.name, 0.0),  # a load's lookup first
            )
        }

    def _pinned(self, pages: int) -> torch.Tensor:
        """A pinned host buffer for a group's snapshot, reused once the writer is done with
        one (allocating pinned memory per group cost the engine's thread more than the copy)."""
        with self._pinned_lock:
            if self._pinned_free:
                buf = self._pinned_free.pop()
                if buf.shape[0] == pages:
                    return buf
        self.stats.snapshot_allocations += 1  # counted: the slower path (PINNED_AT_START were all out)
        return torch.empty((pages, *self.pool.tensor.shape[1:]), dtype=self.pool.tensor.dtype, pin_memory=True)

    def _release_pinned(self, buf: torch.Tensor) -> None:
        with self._pinned_lock:
            if len(self._pinned_free) < _PINNED_KEPT:
                self._pinned_free.append(buf)

    def _enqueue(self, groups: Sequence[tuple[bytes, Sequence[int], tuple[str, ...]]]) -> None:
        """Snapshot the pages of ``groups`` (key, pages, tiers) and queue them for the writer."""
        if not groups:
            return
        for item in self._snapshot(groups):
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.stats.write_drops += 1
                self._written.pop(item.key, None)  # offered again next time it is computed

    def _snapshot(self, groups: Sequence[tuple[bytes, Sequence[int], tuple[str, ...]]]) -> list[_Write]:
        """The pages of ``groups`` (key, pages, tiers) copied to the host for the writer: one
        gather of all of them, then a host copy of each group (on a GPU, per group a launch or
        two on the engine's thread, where a gather, an event and an index of its own each had
        cost a 512-token prompt of a 7B model 1.4 ms with a disk tier on an H100, 2026-12-06)."""
        index = page_index([page for _, pages, _ in groups for page in pages], self.pool.device)
        items: list[_Write] = []
        if self.pool.device.type == "cuda":
            # The groups are gathered on a side stream (after the work queued so far) and copied
            # to the host from there: the compute stream waits only for the gather, not for the
            # copy over PCIe (on the compute stream, a chat turn's writes delayed the next
            # turn's prefill by 60 ms at 8,192 tokens on an H200).
            main = torch.cuda.current_stream(self.pool.device)
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.pool.device)
            side = self._copy_stream
            side.wait_stream(main)
            with torch.cuda.stream(side):
                gathered = self.pool.tensor.index_select(0, index)  # (the host does not wait for the device)
                gathered_event = torch.cuda.Event()
                gathered_event.record(side)
                snaps = []
                start = 0
                for _, pages, _ in groups:
                    snap = self._pinned(len(pages))
                    snap.copy_(gathered[start : start + len(pages)], non_blocking=True)
                    snaps.append(snap)
                    start += len(pages)
                ready = torch.cuda.Event()
                ready.record(side)
            main.wait_event(gathered_event)  # later writes to these pages come after the gather
            items = [_Write(key, snap, ready, tiers) for (key, _, tiers), snap in zip(groups, snaps, strict=True)]
        else:
            gathered = self.pool.tensor.index_select(0, index)
            start = 0
            for key, pages, tiers in groups:
                items.append(_Write(key, gathered[start : start + len(pages)], None, tiers))
                start += len(pages)
        return items

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                self._write(item)
            except (OSError, StoreError) as exc:  # a full disk, a store away: this group is not kept
                if isinstance(item, _Calibrate):  # the tier stays unmeasured: its loads declined
                    self._measuring.discard(item.tier.name)
                    log.warning("KV tier not measured", extra={"tier": item.tier.name, "error": str(exc)})
                else:
                    self.stats.write_errors += 1
                    log.warning("KV page group not written", extra={"key": item.key.hex(), "error": str(exc)})
            except Exception as exc:  # a bug: counted, and raised on the engine's thread at its next call
                self.stats.write_errors += 1
                log.exception("KV page group write failed")
                self._failure = self._failure or exc
            finally:
                self._queue.task_done()

    def _write(self, item: _Write | _Calibrate) -> None:
        if isinstance(item, _Calibrate):
            self.calibrate(item.tier, item.keys)
            return
        if item.ready is not None:
            item.ready.synchronize()
        parts: tuple[bytes, memoryview] | None = None
        held = 0
        targets = [tier for tier in self.groups if tier.name in item.tiers]
        for tier in targets:
            if tier.contains(item.key):
                held += 1
                continue
            parts = parts or kv_blob.encode_parts(self.ident, item.key, item.pages)
            tier.put(item.key, *parts)
            counters = self.stats.tiers[tier.name]
            counters.stored_pages += item.pages.shape[0]
            counters.store_bytes += len(parts[0]) + len(parts[1])
            self._writes_since_calibration[tier.name] += 1
            recent = self._recent[tier.name]
            recent.append(item.key)
            unmeasured = self.estimates.load_seconds(tier.name, 1) is None
            wider = self._width[tier.name] < len(recent) == LOAD_THREADS  # read now as a load reads
            if unmeasured or wider or self._writes_since_calibration[tier.name] >= RECALIBRATE_EVERY:
                self.calibrate(tier, list(recent))
        if held == len(targets):
            self.stats.held_at_write += 1
        if item.ready is not None:  # a pinned snapshot, written by now: reusable
            self._release_pinned(item.pages)

    def measure_soon(self, name: str, keys: Sequence[bytes]) -> None:
        """Queue a measurement of tier ``name`` reading groups ``keys`` (the first
        :data:`LOAD_THREADS`; one measurement at a time a tier; a full queue drops it: the
        next lookup asks again)."""
        tier = next(t for t in self.groups if t.name == name)
        if name in self._measuring:
            return
        self._measuring.add(name)  # before the put: the writer discards it when it measures
        try:
            self._queue.put_nowait(_Calibrate(tier, tuple(keys[:LOAD_THREADS])))
        except queue.Full:
            self._measuring.discard(name)

    def calibrate(self, tier: GroupTier, keys: Sequence[bytes]) -> bool:
        """Time reading groups ``keys`` (up to :data:`LOAD_THREADS`) back from ``tier`` and
        checking them, at once on as many threads as a load uses (off the engine's path; a
        tier that reads in batches: :data:`CALIBRATION_CALLS` batch reads at once, as a long
        load keeps in flight, each made :data:`CALIBRATION_ROUNDS` times), as a load-rate
        reading of that tier, so that the cost rule does not have to load a whole prefix on a
        request's path to learn a tier is slower than computing. A reading of
        more groups at once than the last replaces it (a single group read on one thread
        understates what a load's parallel reads deliver); others join the running average.
        The copy to the device, a small part beside a disk or a store, is not in it: real
        loads refine the estimate. Returns whether it measured."""
        self._measuring.discard(tier.name)
        keys = list(keys[:LOAD_THREADS])

        def read(key: bytes) -> int:
            buffer = self._read_buffer(tier.name)  # as a load reads
            try:
                return self._checked_size(key, tier.get(key) if buffer is None else tier.get_into(key, buffer))
            finally:
                if buffer is not None:
                    self._read_buffers.give(buffer)

        # what a first read pays once (pinning the buffers, a store registering them, the
        # threads) is paid before the clock starts: it is no part of a load's rate
        tier.prepare(self._read_buffers.allocate())
        many = getattr(tier, "get_many_into", None)
        threads = None
        if len(keys) > 1 or many is not None:
            if self._calibrator is None:
                self._calibrator = helper_pool(LOAD_THREADS, "kv-tier-calibrate")
            threads = self._calibrator
        began = time.perf_counter()
        if many is not None:
            # as a long load reads the store: a batch of groups a call to the client, two such
            # calls in flight, each made CALIBRATION_ROUNDS times (the keys read again and
            # again): a load's checks of one batch run beside the next batch's transfer, which
            # a single round of calls cannot show. One call alone read 1.7-1.9 GB/s on an H100
            # where the loads it was to predict ran at 3.1-4.1 (two calls at once: 2.0-2.4),
            # and the rule then declined (and stopped writing) a store that paid (0.54x at
            # 8,192 tokens), 2026-12-06.
            assert threads is not None

            def rounds() -> list[list[int]]:  # one of the calls in flight, made again and again
                return [self._read_many(tier, many, keys) for _ in range(CALIBRATION_ROUNDS)]

            calls = [threads.submit(rounds) for _ in range(CALIBRATION_CALLS)]
            sizes_each = [sizes for call in calls for sizes in call.result()]
            sizes = [n if all(each[i] for each in sizes_each) else 0 for i, n in enumerate(sizes_each[0])]
            total = sum(sum(each) for each in sizes_each)
            seconds = time.perf_counter() - began
            # then one call alone, as a load of no more groups makes it (the median of a few):
            # the rate of a short load (CostEstimates.load_seconds)
            alone = []
            for _ in range(CALIBRATION_ROUNDS):
                at = time.perf_counter()
                one = sum(self._read_many(tier, many, keys))
                alone.append(time.perf_counter() - at)
            if one:
                self.estimates.note_one_call(tier.name, one, statistics.median(alone))
        else:
            sizes = list(threads.map(read, keys)) if threads is not None else [read(k) for k in keys]
            total = sum(sizes)
            seconds = time.perf_counter() - began
        width = sum(1 for n in sizes if n)
        if not width:
            return False
        if width > self._width[tier.name]:
            self.estimates.bytes_per_s.pop(tier.name, None)  # replaced, not averaged
            self._width[tier.name] = width
        self.estimates.note_load(tier.name, total, seconds)
        self.stats.tiers[tier.name].calibrations += 1
        self._writes_since_calibration[tier.name] = 0
        return True

    def _read_many(
        self,
        tier: GroupTier,
        many: Callable[[list[bytes], list[ReadBuffer]], list[memoryview | bytearray | None]],
        keys: list[bytes],
    ) -> list[int]:
        """Bytes of each of ``keys`` read from ``tier`` in one ``get_many_into`` call and
        checked (0: missing or corrupt), as :meth:`calibrate`'s ``read`` does one at a time."""
        buffers = [b for b in (self._read_buffer(tier.name) for _ in keys) if b is not None]
        try:
            blobs = many(keys[: len(buffers)], buffers) + [tier.get(k) for k in keys[len(buffers) :]]
            return [self._checked_size(key, blob) for key, blob in zip(keys, blobs, strict=True)]
        finally:
            for buffer in buffers:
                self._read_buffers.give(buffer)

    def _checked_size(self, key: bytes, blob: bytes | bytearray | memoryview | None) -> int:
        """Bytes of group ``key``'s ``blob`` as read back, 0 where it is missing or corrupt."""
        if blob is None:
            return 0
        try:
            kv_blob.decode(blob, self.ident, key, self.pool.layout)
        except kv_blob.CorruptBlob:
            return 0
        return len(blob)

    def check(self) -> None:
        """Raise a bug of the writer or prefetcher thread here, on the engine's thread: a tier
        that fails every write must end the worker loudly, not serve on without it."""
        if self._failure is not None:
            raise RuntimeError("a KV tier thread failed (its traceback is logged above)") from self._failure

    def drain(self) -> None:
        """Block until every queued write is done (tests, benchmarks, shutdown)."""
        if self._writer is not None:
            self._queue.join()
