"""The KV cache tiers below the device pool: host memory, a directory, Mooncake Store.

A prefix is looked up fastest medium first: the device pool's prefix index (the page
manager's), then host memory page by page, then the group tiers (disk, then store) a
page group at a time. Keys are the prefix cache's chained page hashes, so equal keys
mean equal whole prefixes; the group tiers add the model and layout identity.

- **Demotion**: a cached device page the page manager evicts is first copied to host
  memory (:meth:`KVTiers.demote`, queued on the device's stream: off the host's path).
- **Write-through**: a page group (``group_pages`` consecutive full pages, keyed by the
  hash of its last page) is offered to the group tiers once computed
  (:meth:`KVTiers.offer`): its pages are snapshotted and a writer thread encodes and
  writes them; a full queue drops the write (counted), never blocks a step
  (:mod:`.kv_write`, which also measures each tier's rate off the request path).
- **Promotion**: a prefix that misses on the device but hits below is loaded into fresh
  pool pages (:meth:`KVTiers.find`, then :meth:`KVTiers.load`), which join the prefix
  index like computed ones. A group blob that fails its checks is a miss (counted) and
  is removed from its tier.
- **Prefetch**: when a request arrives, a prefetch thread reads the groups of its prompt
  that only the group tiers hold, from a tier the cost rule would load from, into host
  memory (:meth:`KVTiers.prefetch`, within ``prefetch_bytes``), so that by the time the
  request is scheduled its load is a copy from memory, not a disk read or a store fetch on
  the step's path; the cost rule prices such a group at the measured rate of prefetched
  loads (``prefetched``), not its tier's.

Used through the page manager's two hooks (``demote`` and ``promote``); the page
manager stays free of tensors and I/O.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine import kv_blob
from pdserve.engine.config import KVTierConfig
from pdserve.engine.kv_buffers import ReadBuffer, ReadBuffers
from pdserve.engine.kv_cost import CostEstimates, Decision, overlap_split, pages_worth_loading, some_run_pays
from pdserve.engine.kv_host import HostTier
from pdserve.engine.kv_pool import KVPool, page_index
from pdserve.engine.kv_prefetch import ReadAhead
from pdserve.engine.kv_write import LOAD_THREADS, GroupTier, TierStats, WriteThrough
from pdserve.engine.threads import helper_pool
from pdserve.schemas import TierCounts

# Groups a load reads from the store in one call (its client's batch read), two such reads in
# flight at once (the read buffers: 2 x LOAD_THREADS); the disk reads a group a thread.
READ_BATCH = LOAD_THREADS
# A tier the rule stopped asking is asked again at every this many skipped lookups, and a group
# it holds re-timed off the request's path: its rate and round trip are measured only where it is
# asked, and one slow spell (a store read at 2.3 GB/s where it reads 3-4) would otherwise keep it
# unasked for good.
RECHECK_EVERY = 16

log = logging.getLogger(__name__)

# KVTiers.warm_up runs at a worker's start (bench/kv_tiers.py --compare-warm-up turns it off in
# one restarted worker of two)
WARM_UP = True


@dataclass
class _Step:
    """Part of a load: ``count`` pages from ``tier`` (host: one page, ``key`` its hash;
    a group tier: pages ``skip..skip+count`` of the group under ``key``)."""

    tier: str
    key: bytes
    skip: int
    count: int


@dataclass
class Plan:
    """What :meth:`KVTiers.find` found for ``hashes[start:start + num_pages]``."""

    hashes: Sequence[bytes]
    start: int
    steps: list[_Step]

    @property
    def num_pages(self) -> int:
        return sum(s.count for s in self.steps)


@dataclass
class Loads:
    """What :meth:`KVTiers.worth_loading` makes of a found prefix: ``now`` loaded before its
    computing goes on; then ``head`` pages computed while ``later`` (if any) loads beside them
    into the pages after (:meth:`KVTiers.load_behind`); the rest computed."""

    now: Plan
    head: int = 0
    later: Plan | None = None


def _cut(steps: Sequence[_Step], begin: int, end: int) -> list[_Step]:
    """The steps of pages ``begin..end`` of a plan (counted from its first page)."""
    out: list[_Step] = []
    at = 0
    for step in steps:
        lo, hi = max(begin, at), min(end, at + step.count)
        if lo < hi:
            out.append(_Step(step.tier, step.key, step.skip + lo - at, hi - lo))
        at += step.count
    return out


@dataclass
class _Fetched:
    """What :meth:`KVTiers._fetch_group` found: the group's pages (None: a miss) and whence."""

    source: str
    group: torch.Tensor | None
    corrupt: bool = False


class KVTiers(WriteThrough, ReadAhead):
    """The tiers of one pool. ``observe(name, seconds)`` receives each lookup's
    (``lookup``) and load's (``load``) duration, for the worker's histograms."""

    def __init__(self, pool: KVPool, config: KVTierConfig, ident: bytes) -> None:
        self.pool = pool
        self.config = config
        self.ident = ident
        self.group_pages = config.group_pages
        self.stats = TierStats()
        self.estimates = CostEstimates()  # the load-or-recompute rule's running inputs
        self.observe: Callable[[str, float], None] | None = None
        self.host = HostTier(pool, config.host_bytes) if config.host_bytes else None
        self.groups: list[GroupTier] = []
        if config.disk_dir:
            from pdserve.engine.kv_disk import DiskTier

            self.groups.append(DiskTier(Path(config.disk_dir), ident, config.disk_bytes))
        if config.store_master:
            from pdserve.engine.kv_store import StoreTier

            self.groups.append(
                StoreTier(config.store_master, config.store_metadata, ident, config.store_host, config.store_bytes)
            )
        # the disk's and the store's reads into reused buffers (pinned on a GPU), as many as a
        # load keeps ahead
        self._read_buffers = ReadBuffers(
            kv_blob.HEADER_BYTES + self.group_pages * pool.page_bytes,
            2 * LOAD_THREADS,
            pool.device.type == "cuda",
            offset=-kv_blob.HEADER_BYTES % 64,  # the pages 64-byte aligned
        )
        # a bug in the writer or the prefetcher, raised on the engine's thread at its next call
        self._failure: BaseException | None = None
        self.start_writer(config.max_pending_writes)
        self.start_prefetcher()
        self._loaders: ThreadPoolExecutor | None = None  # a load's group reads (see load)
        self._behind: ThreadPoolExecutor | None = None  # loads beside the engine's steps (load_behind)
        self._behind_until = 0.0  # when the loads queued there are expected to be done (perf_counter)
        self._behind_stream: torch.cuda.Stream | None = None  # a GPU pool's copies of those loads
        self._skips: dict[str, int] = {}  # each group tier's lookups skipped in a row (RECHECK_EVERY)

    @property
    def enabled(self) -> bool:
        return self.host is not None or bool(self.groups)

    def tier(self, name: str) -> GroupTier | None:
        return next((t for t in self.groups if t.name == name), None)

    def counts(self) -> tuple[TierCounts, ...]:
        """Each configured tier's totals, for the worker's heartbeat (and metrics)."""
        present = {"host": self.host, **{t.name: t for t in self.groups}}
        page = self.pool.page_bytes
        recompute = self.estimates.recompute_seconds(self.pool.layout.page_size) or 0.0
        return tuple(
            TierCounts(
                name,
                **dataclasses.asdict(self.stats.tiers[name]),
                held_bytes=getattr(tier, "num_bytes", 0),
                load_s_per_page=self.estimates.load_seconds(name, page, calls=0) or 0.0,
                recompute_s_per_page=recompute,
                recompute_s_per_pair=self.estimates.prefill_s_per_pair,
                load_s_per_call=self.estimates.call_seconds.get(name, 0.0),
                recompute_floor_s=self.estimates.prefill_floor_s,
                load_s_per_page_one_call=self._one_call_page_seconds(name, page),
            )
            for name, tier in present.items()
            if tier is not None
        )

    def _one_call_page_seconds(self, name: str, page: int) -> float:
        one = self.estimates.one_call.get(name)
        return page * one[1] / one[0] if one is not None else 0.0

    def totals(self) -> dict[str, int]:
        """The tiers' :class:`WorkerCounters` fields."""
        s = self.stats
        return {
            "kv_tier_lookups": s.lookups,
            "kv_tier_missed_pages": s.missed_pages,
            "kv_tier_write_drops": s.write_drops,
            "kv_tier_write_errors": s.write_errors,
            "kv_tier_snapshot_allocations": s.snapshot_allocations,
        }

    # ---- demotion --------------------------------------------------------------
    def demote(self, page: int, h: bytes) -> None:
        """Device page ``page`` (hash ``h``) is about to be reused: keep a copy in host memory."""
        if self.host is not None:
            self.host.store(h, page)
            counters = self.stats.tiers["host"]
            counters.stored_pages += 1
            counters.store_bytes += self.pool.page_bytes

    # ---- promotion -------------------------------------------------------------
    def find(self, hashes: Sequence[bytes], start: int, limit: int) -> Plan:
        """Where the pages of ``hashes[start:start + limit]`` are, fastest tier first, for
        the longest run found (a page of the run may also still be on the device)."""
        self.check()
        began = time.perf_counter()
        steps: list[_Step] = []
        end = min(start + limit, len(hashes))
        i = start
        g = self.group_pages
        # each group tier is asked about every group of the range at once (one round trip to
        # the store's master, not one a group)
        keys = [hashes[e - 1] for e in range((start // g + 1) * g, min(len(hashes), end + g - 1) + 1, g)]
        with self._fetch_lock:
            read_ahead = any(k in self._fetched for k in keys)
        first = start  # where a group tier's run could begin: after the pages host memory holds
        while first < end and self.host is not None and self.host.contains(hashes[first]):
            first += 1
        held: dict[str, set[bytes]] = {}
        for t in self.groups:
            recheck = False
            if keys and not read_ahead and self._cannot_pay(t.name, first, end, hashes):
                self._skips[t.name] = self._skips.get(t.name, 0) + 1
                recheck = self._skips[t.name] % RECHECK_EVERY == 0
                if not recheck:
                    self.stats.tiers[t.name].skipped_lookups += 1
                    held[t.name] = set()
                    continue
            else:
                self._skips[t.name] = 0
            asked = time.perf_counter()
            held[t.name] = {k for k, yes in zip(keys, t.contains_many(keys), strict=True) if yes}
            self.estimates.note_call(t.name, time.perf_counter() - asked)
            for k in held[t.name]:  # not snapshotted for it when this prompt's pages are computed
                self._mark(k, (t.name,))  # (a second worker on a shared store: 0.4 ms a prompt)
            if recheck and held[t.name]:  # its rate read again on the writer's thread
                self.measure_soon(t.name, [k for k in keys if k in held[t.name]])

        while i < end:
            if i < first or (self.host is not None and self.host.contains(hashes[i])):  # before first: held there
                steps.append(_Step("host", hashes[i], 0, 1))
                i += 1
                continue
            group_end = (i // g + 1) * g
            if group_end > len(hashes):
                break  # a group is keyed by its last page: this one is not full in the prompt
            key = hashes[group_end - 1]
            tier = next((t for t in self.groups if key in held[t.name]), None)
            if tier is None:
                break
            count = min(group_end, end) - i
            steps.append(_Step(tier.name, key, i - (group_end - g), count))
            i += count
        self.stats.lookups += 1
        self.stats.missed_pages += end - i
        self._timed("lookup", began)
        return Plan(hashes, start, steps)

    def _cannot_pay(self, name: str, first: int, end: int, hashes: Sequence[bytes]) -> bool:
        """Whether no run of group tier ``name``'s pages that begins at page ``first`` (the
        first one a load could take from it) and ends by page ``end`` is measured worth
        loading: a load takes a prefix's pages in order, so a run that pays only past its first
        pages (each page attends to all before it: the later ones are the dearer to compute)
        pays only if it is long enough. Then :meth:`find` does not ask it (a store's lookup is
        a round trip to its master on the engine's thread, every request: a 2,048-token prompt
        of a 7B model on an H100, whose last pages cost more to compute than to load from the
        store but no leading run of them did, paid it at every turn, 1.02x no tier,
        2026-12-06); :meth:`find` asks it anyway at every :data:`RECHECK_EVERY`-th skip in a
        row, and times a group it holds again. Never with ``load='always'`` or overlap on (a
        slower tier's pages can still load beside the computing), nor while the tier or the
        prefill is unmeasured. The
        prompt's full pages (``hashes``) bound what computing fewer of them saves (a step's
        floor). Unless the decision may cut a run (``cut_runs``), it takes the run a lookup finds
        whole or not at all, and that run is at least as long as what this worker knows the tier
        holds of ``hashes`` (written there, or found there before: :meth:`_held_pages`): only runs
        that long are weighed (a 7B model's 512-token chat on an H100 asked its store at every
        turn, where one group would have paid and the decision, taking the context whole,
        declined it: 1.05x no tier, 2026-12-06). A run must save more than the lookup itself
        costs (the tier's measured round trip): one that would save less, at the rule's margin,
        cannot repay asking."""
        if self.config.load == "always" or self.config.overlap or first >= end:
            return False
        page_tokens = self.pool.layout.page_size
        shortest = 1 if self.config.cut_runs else self._held_pages(name, hashes, first, end)
        return not some_run_pays(
            self.estimates,
            name,
            self.pool.page_bytes,
            page_tokens,
            first,
            end - first,
            len(hashes) * page_tokens,
            shortest,
            self.estimates.call_seconds.get(name, 0.0),  # the lookup's own round trip
        )

    def _held_pages(self, name: str, hashes: Sequence[bytes], first: int, end: int) -> int:
        """How many pages from ``first`` on (up to ``end``) group tier ``name`` is known to hold
        in one run: its groups this worker wrote there or found there (the writer's record)."""
        g = self.group_pages
        held = first
        group_end = (first // g + 1) * g
        while held < end and group_end <= len(hashes) and name in self._written.get(hashes[group_end - 1], ()):
            held = min(group_end, end)
            group_end += g
        return held - first

    def worth_loading(self, plan: Plan, overlap: bool = False) -> Loads:
        """What to do with ``plan``: the leading pages whose loading beats computing them
        (:func:`~pdserve.engine.kv_cost.pages_worth_loading`) load first; with ``overlap``, of
        the group tiers' pages found after those, a head may be computed while the tail after it
        loads beside it (:func:`~pdserve.engine.kv_cost.overlap_split`). The pages neither way
        takes are counted as declined, per tier. A disk or store found holding a prefix before
        its rate is known (a second worker on a shared store) is timed here reading one of its
        groups (a load of the whole prefix blind cost an H200 2.4x computing it), then the rule
        decides; the writer thread times it again as wide as a load reads."""
        if self.config.load == "always":
            return Loads(plan)
        with self._fetch_lock:
            runs = [("prefetched" if s.key in self._fetched else s.tier, s.count) for s in plan.steps]
        group_tiers = [t.name for t in self.groups]
        page_tokens = self.pool.layout.page_size

        def decide() -> Decision:
            return pages_worth_loading(
                runs,
                self.pool.page_bytes,
                page_tokens,
                self.estimates,
                group_tiers,
                plan.start * page_tokens,
                len(plan.hashes) * page_tokens,  # the prompt's full pages: the step a load shortens
                self.config.cut_runs,
            )

        decision = decide()
        if decision.unmeasured:  # timed here reading one of its groups (bounded: one group's read), then decided
            for name in decision.unmeasured:
                tier = self.tier(name)
                assert tier is not None
                self.calibrate(tier, [next(s.key for s in plan.steps if s.tier == name)])
            decision = decide()
        for name in decision.unmeasured:  # (its group could not be read) measured on the writer's thread
            self.measure_soon(name, [s.key for s in plan.steps if s.tier == name])
        keep = decision.pages
        split = None
        rest = _cut(plan.steps, keep, plan.num_pages)
        overlap = overlap and self.config.overlap
        if overlap and rest and not decision.unmeasured and all(s.tier != "host" for s in rest):
            with self._fetch_lock:
                rest_runs = [("prefetched" if s.key in self._fetched else s.tier, s.count) for s in rest]
            queued = max(0.0, self._behind_until - time.perf_counter())  # loads beside others' heads
            split = overlap_split(
                rest_runs, self.pool.page_bytes, page_tokens, self.estimates, queued, (plan.start + keep) * page_tokens
            )
        head = split.head if split is not None else 0
        later = None
        if split is not None:
            later = Plan(plan.hashes, plan.start + keep + head, _cut(plan.steps, keep + head, plan.num_pages))
        for step in _cut(plan.steps, keep, keep + head if split is not None else plan.num_pages):
            self.stats.tiers[step.tier].declined_pages += step.count
        if decision.saved_seconds and keep:  # the time saved, as expected, shared by the pages loaded
            for step in _cut(plan.steps, 0, keep):
                self.stats.tiers[step.tier].saved_seconds += decision.saved_seconds * step.count / keep
        if later is not None and split is not None:
            for step in later.steps:
                self.stats.tiers[step.tier].saved_seconds += split.saved * step.count / split.tail
        return Loads(Plan(plan.hashes, plan.start, _cut(plan.steps, 0, keep)), head, later)

    def load_behind(self, plan: Plan, pages: Sequence[int]) -> Future[int]:
        """:meth:`load` on a thread of its own, beside the engine's steps (the split of
        :meth:`worth_loading`); the future's result is the pages loaded, once they are in the pool
        (a GPU pool's copies run on a stream of their own, waited for before the result)."""
        with self._fetch_lock:
            if self._behind is None:
                self._behind = helper_pool(1, "kv-tier-behind")
        counters = self.stats.tiers
        expected = 0.0
        for step in plan.steps:
            counters[step.tier].overlapped_pages += step.count
            expected += self.estimates.load_seconds(step.tier, step.count * self.pool.page_bytes) or 0.0
        self._behind_until = max(time.perf_counter(), self._behind_until) + expected  # one loader: in turn
        return self._behind.submit(self._load_behind, plan, list(pages))

    def _load_behind(self, plan: Plan, pages: list[int]) -> int:
        if self.pool.device.type != "cuda":
            return self.load(plan, pages)
        if self._behind_stream is None:  # one stream: the loads run one at a time on one thread
            self._behind_stream = torch.cuda.Stream(self.pool.device)
        with torch.cuda.stream(self._behind_stream):
            loaded = self.load(plan, pages)
        self._behind_stream.synchronize()
        return loaded

    def note_prefill(self, tokens: int, seconds: float, pairs: float = 0.0) -> None:
        """A step computed ``tokens`` prompt tokens (``pairs`` of them and the tokens before,
        attended) in ``seconds``: the recompute side's rate."""
        self.estimates.note_prefill(tokens, seconds, pairs)

    def load(self, plan: Plan, pages: Sequence[int]) -> int:
        """Fill ``pages`` with ``plan``'s pages in order; returns how many were loaded (a
        page lost since :meth:`find`, or a corrupt blob, ends the run there). The groups'
        reads and checks run on :data:`LOAD_THREADS` threads at once (file reads and the
        CRC let go of the interpreter), each disk or store group into a reused read buffer
        (:mod:`.kv_buffers`), up to as many groups ahead as there are buffers (the store's
        :data:`READ_BATCH` at a call to its client); their copies into the pool run in order
        on this thread."""
        began = time.perf_counter()
        assert len(pages) <= plan.num_pages
        spans: list[tuple[_Step, int, int]] = []  # (step, first page, pages) of what is wanted
        done = 0
        for step in plan.steps:
            if done >= len(pages):
                break
            n = min(step.count, len(pages) - done)
            spans.append((step, done, n))
            done += n
        threaded = sum(1 for step, _, _ in spans if step.tier != "host") > 1
        if threaded:
            with self._fetch_lock:  # a load beside the steps (load_behind) may be first
                if self._loaders is None:
                    self._loaders = helper_pool(LOAD_THREADS, "kv-tier-load")
        fetched: dict[int, tuple[Future[list[_Fetched]], int]] = {}  # a span's read and its place in it
        held: dict[int, ReadBuffer] = {}
        ahead = 0  # spans submitted so far

        def submit_ahead(upto: int) -> None:
            nonlocal ahead
            while ahead < len(spans) and ahead < upto + self._read_buffers.count:
                name = spans[ahead][0].tier
                if name == "host":
                    ahead += 1
                    continue
                # a tier that reads several groups in one call (the store) takes the run of its
                # spans here, up to READ_BATCH, once there is room for them all (else the reads
                # after the first two would go a group a call, as buffers come back one by one);
                # others a span a read
                most = READ_BATCH if hasattr(self.tier(name), "get_many_into") else 1
                run = 1
                while ahead + run < len(spans) and spans[ahead + run][0].tier == name and run < most:
                    run += 1
                if upto + self._read_buffers.count - ahead < run:
                    break
                batch: list[tuple[_Step, ReadBuffer | None]] = []
                first = ahead
                while (
                    ahead < len(spans)
                    and spans[ahead][0].tier == name
                    and len(batch) < most
                    and ahead < upto + self._read_buffers.count
                ):
                    buffer = self._read_buffer(name)
                    if buffer is not None:
                        held[ahead] = buffer
                    batch.append((spans[ahead][0], buffer))
                    ahead += 1
                assert self._loaders is not None
                future = self._loaders.submit(self._fetch_groups, batch)
                for place in range(len(batch)):
                    fetched[first + place] = (future, place)

        loaded = 0
        taken: dict[str, tuple[int, float]] = {}  # bytes and seconds a source, over the whole load
        mark = time.perf_counter()
        try:
            for i, (step, first, n) in enumerate(spans):
                if threaded:
                    submit_ahead(i)
                target = pages[first : first + n]
                if step.tier == "host":
                    assert self.host is not None
                    source = "host" if self.host.load(step.key, target[0]) else None
                else:
                    if i in fetched:
                        future, place = fetched.pop(i)
                        got = future.result()[place]
                    else:
                        buffer = self._read_buffer(step.tier)
                        if buffer is not None:
                            held[i] = buffer
                        got = self._fetch_group(step, buffer)
                    counters = self.stats.tiers[step.tier]
                    counters.prefetch_hits += got.source == "prefetched"
                    counters.corrupt += got.corrupt
                    source = None
                    if got.group is None:  # gone, or corrupt and removed: written again when computed
                        self._unmark(step.key, step.tier)
                    else:
                        source = got.source
                        self._copy_in(target, got.group[step.skip : step.skip + n])
                    if i in held:
                        self._give_back(held.pop(i))
                if source is None:
                    break
                now = time.perf_counter()  # this step's share of the wall time (reads overlap)
                nbytes, seconds = taken.get(source, (0, 0.0))
                taken[source] = (nbytes + n * self.pool.page_bytes, seconds + now - mark)
                mark = now
                counters = self.stats.tiers[step.tier]
                counters.hit_pages += n
                counters.load_bytes += n * self.pool.page_bytes
                loaded += n
        finally:
            for i, (future, _) in fetched.items():  # a run ended early: its reads still in flight
                future.result()
                if i in held:
                    self._give_back(held.pop(i))
        # one reading a source a load: a step whose group was read ahead of it takes only its
        # copy's time, and averaged step by step such steps made a disk read 19 GB/s on an H200
        # whose loads ran at about 3
        for source, (nbytes, seconds) in taken.items():
            self.estimates.note_load(source, nbytes, seconds)
        self._timed("load", began)
        return loaded

    def _copy_in(self, pages: Sequence[int], src: torch.Tensor) -> None:
        """Copy a group's pages ``src`` (on the host) into pool ``pages`` (queued on a GPU)."""
        index = page_index(pages, self.pool.device)
        self.pool.tensor.index_copy_(0, index, src.to(self.pool.device, non_blocking=True))

    def warm_up(self) -> None:
        """Run a disk's or store's load and write on the device once before the worker takes a
        request, without a tier: the pool's first group of pages (free at start) snapshotted as
        a write does and copied back through a read buffer as a load does, the pool left as it
        was, and the loaders' threads started. A process's first load paid these first times
        (the copy's kernel loaded, threads started) in the request's time to first token, and
        its tier's rate reading with them: on an H100 a restarted worker's first load of a
        512-token prefix took 14.4 and 16.9 ms where its later ones took 12.3-12.6, and where
        it read dear the rule declined the rest (2026-12-07). Nothing is counted or written.
        (:data:`WARM_UP` off: not run, for a benchmark's comparison.)"""
        if not WARM_UP or not self.groups or self.pool.num_pages < self.group_pages:
            return
        with self._fetch_lock:
            if self._loaders is None:
                self._loaders = helper_pool(LOAD_THREADS, "kv-tier-load")
        meet = threading.Barrier(LOAD_THREADS)  # each task waits for all: every thread started
        for future in [self._loaders.submit(meet.wait, 10.0) for _ in range(LOAD_THREADS)]:
            future.result()
        pages = list(range(self.group_pages))
        (write,) = self._snapshot([(b"warm-up", pages, ())])
        if write.ready is not None:
            write.ready.synchronize()
        buffer = self._read_buffers.take()
        if buffer is None:  # (all out: not at start)
            return
        start = buffer.offset + kv_blob.HEADER_BYTES  # where a read blob's pages lie (see _checked)
        nbytes = write.pages.numel() * write.pages.element_size()
        group = buffer.data[start : start + nbytes].view(write.pages.dtype).view(write.pages.shape)
        group.copy_(write.pages)
        self._copy_in(pages, group)
        self._give_back(buffer)
        if write.ready is not None:
            self._release_pinned(write.pages)
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()

    def _give_back(self, buffer: ReadBuffer) -> None:
        """``buffer`` back, once the copy out of it queued on the device has run."""
        ready = None
        if self.pool.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self._read_buffers.give(buffer, ready)

    def _fetch_group(self, step: _Step, buffer: ReadBuffer | None = None) -> _Fetched:
        """A group step's pages on the host, checked, and where they came from (its tier, or
        ``prefetched``); no pages for a miss (gone, or corrupt: removed from its tier). Read
        into ``buffer`` where given (the pages returned then live there). Runs on any
        thread: the caller counts what it returns."""
        return self._fetch_groups([(step, buffer)])[0]

    def _fetch_groups(self, batch: Sequence[tuple[_Step, ReadBuffer | None]]) -> list[_Fetched]:
        """:meth:`_fetch_group` of each ``(step, buffer)`` of one tier: a group read ahead from
        memory, one with a buffer into it (several in one call where the tier reads several at
        once, ``get_many_into``), one without (every buffer out) as ``get`` reads it."""
        tier = self.tier(batch[0][0].tier)
        assert tier is not None
        blobs: list[bytes | bytearray | memoryview | None] = [self._take_prefetched(step.key) for step, _ in batch]
        sources = ["prefetched" if blob is not None else tier.name for blob in blobs]
        into = [
            j
            for j, (blob, (_, buffer)) in enumerate(zip(blobs, batch, strict=True))
            if blob is None and buffer is not None
        ]
        many = getattr(tier, "get_many_into", None)
        batched = into if many is not None and len(batch) > 1 else []
        if many is not None and batched:
            keys = [batch[j][0].key for j in batched]
            for j, blob in zip(batched, many(keys, [batch[j][1] for j in batched]), strict=True):
                blobs[j] = blob
        for j, (step, buffer) in enumerate(batch):
            if sources[j] == tier.name and j not in batched:
                blobs[j] = tier.get(step.key) if buffer is None else tier.get_into(step.key, buffer)
        return [
            self._checked(step, tier, source, blob, buffer)
            for (step, buffer), source, blob in zip(batch, sources, blobs, strict=True)
        ]

    def _checked(
        self,
        step: _Step,
        tier: GroupTier,
        source: str,
        blob: bytes | bytearray | memoryview | None,
        buffer: ReadBuffer | None,
    ) -> _Fetched:
        """``blob`` of ``step``'s group as read from ``source``: its pages, checked."""
        if blob is None:
            return _Fetched(source, None)
        try:
            group = kv_blob.decode(blob, self.ident, step.key, self.pool.layout)
        except kv_blob.CorruptBlob as exc:
            log.warning(
                "corrupt KV page group: a miss", extra={"tier": tier.name, "key": step.key.hex(), "why": str(exc)}
            )
            tier.discard(step.key)
            return _Fetched(source, None, corrupt=True)
        if group.shape[0] != self.group_pages:
            tier.discard(step.key)
            return _Fetched(source, None, corrupt=True)
        if buffer is not None and isinstance(blob, memoryview):
            # the same bytes as a view of the buffer's own tensor: pinned, as the copy to the
            # device must know to run without the driver staging it again
            start = buffer.offset + kv_blob.HEADER_BYTES
            group = (
                buffer.data[start : start + group.numel() * group.element_size()].view(group.dtype).view(group.shape)
            )
        return _Fetched(source, group)

    # ---- upkeep ----------------------------------------------------------------
    def flush(self) -> int:
        """Forget the host tier's pages (the group tiers are shared and persist); returns how many."""
        self._written.clear()
        return self.host.clear() if self.host is not None else 0

    def close(self) -> None:
        """Finish queued writes, stop the writer and the prefetcher, close the store client
        (again: nothing)."""
        if self._behind is not None:  # its loads finish first: they use the loaders
            self._behind.shutdown()
            self._behind = None
        if self._loaders is not None:
            self._loaders.shutdown()
            self._loaders = None
        self.stop_prefetcher()
        if not self.stop_writer():
            return
        for tier in self.groups:
            close = getattr(tier, "close", None)
            if close is not None:
                close()

    def _timed(self, name: str, began: float) -> None:
        seconds = time.perf_counter() - began
        if name == "lookup":
            self.stats.lookup_seconds += seconds
        else:
            self.stats.load_seconds += seconds
        if self.observe is not None:
            self.observe(name, seconds)


def create_tiers(pool: KVPool, model: torch.nn.Module, config: KVTierConfig) -> KVTiers:
    """The tiers ``config`` asks for, below ``pool`` of ``model`` (its weights and the
    pool's layout name the group tiers' entries)."""
    name = Path(str(getattr(model.config, "_name_or_path", "") or "model")).name
    ident = kv_blob.identity(kv_blob.model_fingerprint(model, name), pool.layout, config.group_pages)
    return KVTiers(pool, config, ident)
