"""Page allocator and prefix index: the only code that edits a sequence's page table.
Plain Python, no I/O, no tensors.

A page holds ``page_size`` consecutive tokens of one sequence (all layers, K and V).
Pages are reference counted: a full page whose token content is known gets a chained
hash (hash of the previous page's hash and its own tokens) and stays findable in the
prefix index after its last owner lets go; such unreferenced cached pages form an LRU
and are the first reused when the free list runs dry.

With :attr:`PageManager.tiers` set (``engine/kv_tiers.py``), a cached page about to be
reused is first demoted to the tiers below, a prefix that misses in the index is looked
up there and its pages promoted into fresh pages, and full pages are offered to them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.engine.sequence import Sequence as Seq
from pdserve.schemas.kv_events import page_hashes


class PrefixTiers(Protocol):
    """The KV tiers below the pool, as the page manager uses them (``KVTiers``)."""

    def demote(self, page: int, h: bytes) -> None: ...
    def find(self, hashes: Sequence[bytes], start: int, limit: int) -> Any: ...  # a plan with ``num_pages``
    # what loads faster than computing: ``now`` (a plan), then ``head`` pages computed while ``later`` loads
    def worth_loading(self, plan: Any, overlap: bool = False) -> Any: ...
    def load(self, plan: Any, pages: Sequence[int]) -> int: ...
    def load_behind(self, plan: Any, pages: Sequence[int]) -> Future[int]: ...  # load, on a thread of its own
    def offer(self, hashes: Sequence[bytes], page_table: Sequence[int], old_full: int, new_full: int) -> None: ...
    def prefetch(self, hashes: Sequence[bytes], start: int, ahead: int = 0) -> bool: ...  # read ahead (slow tiers)


class OutOfPages(RuntimeError):
    pass


@dataclass
class TailLoad:
    """Pages of a sequence's cached prefix loading from a tier (``future``: how many arrived,
    in order) while the tokens before ``head_end`` are computed; ``pages`` and ``hashes`` the
    tail's, in prompt order, right after ``head_end``."""

    future: Future[int]
    head_end: int
    pages: list[int]
    hashes: list[bytes]


class PageManager:
    """Owns page ids ``0..num_pages-1``: refcounts, free list, prefix index."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True) -> None:
        assert num_pages > 0 and page_size > 0
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0, LRU order
        self.tiers: PrefixTiers | None = None
        self.record_events = False  # keep what the index gains and loses, for take_events
        self._stored: list[bytes] = []
        self._evicted: list[bytes] = []
        # While a step that may still write into pages is queued on the device, an
        # unreferenced, uncached page is parked under that step's serial (``park_tag``) and
        # handed out again only once that step is done (:meth:`unpark`): a page given to a
        # transfer or a new request is then never written by a step queued before.
        self.park_tag: int | None = None
        self._parked: list[tuple[int, int]] = []  # (serial, page)

    # ---- queries -----------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now (free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_parked_pages(self) -> int:
        """Freed pages waiting for the step queued when they were freed."""
        return len(self._parked)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        return len(self._hash_of)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def match_prefix(self, tokens: Sequence[int], root: bytes | None = None) -> list[bytes]:
        """Hashes of the leading full pages of ``tokens`` (whether or not cached); ``root``: the
        chain's start (a request's ``sampling.page_root``)."""
        return page_hashes(tokens, self.page_size, root)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Cached pages for the longest run of leading ``hashes`` found in the index."""
        if not self.enable_prefix_cache:
            return []
        pages: list[int] = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    # ---- actions -----------------------------------------------------------
    def allocate(self, num_pages: int) -> list[int]:
        """``num_pages`` fresh pages with refcount 1; evicts LRU cached pages if needed."""
        if not self.can_allocate(num_pages):
            raise OutOfPages(f"need {num_pages} pages, {self.num_free_pages} free")
        pages = []
        for _ in range(num_pages):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                if self.tiers is not None:
                    self.tiers.demote(page, self._hash_of[page])
                self._forget(page)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: Sequence[int]) -> None:
        """Take one more reference on each page (prefix hits, holds)."""
        for page in pages:
            if self._refs[page] == 0:
                self._evictable.pop(page, None)
            self._refs[page] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page; unreferenced cached pages stay findable."""
        for page in reversed(pages):
            assert self._refs[page] > 0, f"double free of page {page}"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._evictable[page] = None
                elif self.park_tag is not None:
                    self._parked.append((self.park_tag, page))
                else:
                    self._free.append(page)

    def unpark(self, serial: int | None = None) -> int:
        """Pages parked under steps up to ``serial`` (every one: ``None``) become free; how many."""
        done = [page for tag, page in self._parked if serial is None or tag <= serial]
        self._parked = [(tag, page) for tag, page in self._parked if not (serial is None or tag <= serial)]
        self._free.extend(reversed(done))
        return len(done)

    def register(self, page: int, h: bytes) -> None:
        """Record that ``page`` holds the full page with chained hash ``h``."""
        if not self.enable_prefix_cache or page in self._hash_of:
            return
        if h in self._page_of:
            return  # an equal page is already indexed; this copy stays private
        self._hash_of[page] = h
        self._page_of[h] = page
        if self.record_events:
            self._stored.append(h)

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes indexed and forgotten since the last call (with ``record_events``)."""
        stored, evicted = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return stored, evicted

    def reset_prefix_cache(self, in_use: bool = False) -> int:
        """Forget the cached prefixes of unreferenced pages (they become free), and with
        ``in_use`` those of pages in use too (no longer found as a prefix, freed when their
        owners let go). Returns the cached pages that became free."""
        freed = len(self._evictable)
        for page in list(self._evictable):
            self._forget(page)
            self._free.append(page)
        self._evictable.clear()
        if in_use:
            for page in list(self._hash_of):
                self._forget(page)
        return freed

    def fork(self, parent: Seq, child: Seq) -> int | None:
        """Give ``child`` ``parent``'s computed KV: its full pages shared, and a fresh page for
        the partial last one, whose id is returned for the caller to copy into (``None``:
        nothing to copy). Raises :class:`OutOfPages` (nothing changed) if no page is free."""
        assert not child.page_table, f"{child.rid} already has pages"
        full = parent.num_computed // self.page_size
        partial = parent.num_computed % self.page_size != 0
        fresh = self.allocate(1) if partial else []
        shared = parent.page_table[:full]
        self.share(shared)
        child.page_table = list(shared) + fresh
        child.num_computed = parent.num_computed
        child.num_cached = parent.num_cached
        child.page_hashes = parent.page_hashes[:full]
        child.num_registered_pages = child.num_offered_pages = min(parent.num_registered_pages, full)
        return fresh[0] if fresh else None

    def _forget(self, page: int) -> None:
        h = self._hash_of.pop(page, None)
        if h is not None and self._page_of.get(h) == page:
            del self._page_of[h]
            if self.record_events:
                self._evicted.append(h)

    # ---- a sequence's pages --------------------------------------------------
    def attach_prefix(self, seq: Seq, max_tokens: int, overlap_reserve: int | None = None) -> None:
        """Give ``seq`` the cached pages of its longest known prefix, up to ``max_tokens``
        tokens; they count as computed (and cached). With ``overlap_reserve`` (the pages to leave
        free), a part of the prefix in a tier slower than computing may load while the part
        before it is computed (``seq.tail_load``; the scheduler computes up to its ``head_end``,
        then :meth:`finish_tail`)."""
        assert not seq.page_table, f"{seq.rid} already has pages"
        limit = max_tokens // self.page_size
        root = seq.sampling.page_root
        if self.tiers is None:  # hashed as far as the index knows the prefix; the rest later (hash_pages)
            seq.page_hashes = self._known_prefix(seq.tokens, limit, root)
        elif len(seq.page_hashes) != len(seq.tokens) // self.page_size:  # the tiers below may know more of it
            seq.page_hashes = self.match_prefix(seq.tokens, root)  # (unless prefetch hashed the prompt already)
        cached = self.lookup(seq.page_hashes)[:limit]
        self.share(cached)
        seq.page_table = list(cached)
        ready = len(cached)
        if self.tiers is not None and self.enable_prefix_cache and len(cached) < limit:
            pages, loaded = self._promote(seq, len(cached), limit - len(cached), overlap_reserve)
            seq.page_table += pages
            ready += loaded
        seq.num_computed = seq.num_cached = ready * self.page_size
        seq.num_registered_pages = ready

    def prefetch(self, seq: Seq, ahead: int = 0) -> bool:
        """A request just queued behind ``ahead`` others: have the tiers read ahead the part of
        its prompt's prefix the device does not hold (only the slow tiers' page groups are
        read; the load, when the request is scheduled, then copies from memory). Returns
        whether it was asked."""
        if self.tiers is None or not self.enable_prefix_cache or seq.page_table:
            return False
        hashes = seq.page_hashes = self.match_prefix(seq.tokens, seq.sampling.page_root)  # attach_prefix takes them
        start = len(self.lookup(hashes))
        return start < len(hashes) and self.tiers.prefetch(hashes, start, ahead)

    def _known_prefix(self, tokens: Sequence[int], limit: int, root: bytes | None = None) -> list[bytes]:
        """Hashes of the leading full pages of ``tokens``, computed a block of pages at a time
        while the index holds them all (at most ``limit`` pages; the block of the first miss
        is kept whole): a cold prompt costs one block, not every page."""
        size = self.page_size
        hashes: list[bytes] = []
        block = 16
        while len(hashes) < limit and self.enable_prefix_cache:
            start = len(hashes)
            new = page_hashes(tokens[start * size : (start + block) * size], size, hashes[-1] if hashes else root)
            hashes += new
            if len(new) < block or any(h not in self._page_of for h in new):
                break
            block *= 2
        return hashes

    def hash_pages(self, seq: Seq, num_tokens: int) -> None:
        """Extend ``seq.page_hashes`` over the full pages of its first ``num_tokens`` tokens
        (the engine calls it while the device computes them; :meth:`register_full_pages`
        then finds them done)."""
        have = len(seq.page_hashes)
        if num_tokens // self.page_size > have:
            tokens = seq.tokens[have * self.page_size : num_tokens]
            parent = seq.page_hashes[-1] if have else seq.sampling.page_root
            seq.page_hashes += page_hashes(tokens, self.page_size, parent)

    def _promote(self, seq: Seq, start: int, limit: int, overlap_reserve: int | None) -> tuple[list[int], int]:
        """Pages for ``seq.page_hashes[start:]`` loaded from the tiers below (at most
        ``limit``, and no more than are free), indexed like computed ones, referenced once;
        then, where the tiers advise it and ``overlap_reserve`` pages stay free, fresh pages
        for a head to compute and a tail loading meanwhile (``seq.tail_load``). Returns the
        pages and how many of them (the leading ones) hold their KV now."""
        assert self.tiers is not None
        hashes = seq.page_hashes
        loads = self.tiers.worth_loading(self.tiers.find(hashes, start, limit), overlap_reserve is not None)
        n = min(loads.now.num_pages, self.num_free_pages)
        pages = self.allocate(n) if n > 0 else []
        loaded = self.tiers.load(loads.now, pages) if pages else 0
        for page, h in zip(pages[:loaded], hashes[start:], strict=False):
            self.register(page, h)  # an equal page still indexed keeps its place; this copy stays private
        self.free(pages[loaded:])
        pages = pages[:loaded]
        later = loads.later
        if later is None or loaded != loads.now.num_pages:
            return pages, loaded
        assert overlap_reserve is not None
        head, tail = loads.head, later.num_pages
        if head + tail + overlap_reserve > self.num_free_pages:
            return pages, loaded
        fresh = self.allocate(head + tail)
        first = start + loaded + head
        future = self.tiers.load_behind(later, fresh[head:])
        seq.tail_load = TailLoad(future, first * self.page_size, fresh[head:], hashes[first : first + tail])
        return pages + fresh, loaded

    def finish_tail(self, seq: Seq) -> int:
        """Wait for ``seq``'s tail load (its head computed) and take what arrived as computed and
        cached, indexed like computed pages; pages that did not arrive (a group gone or corrupt
        since the lookup) stay in its page table to be computed. Returns the tokens taken."""
        tail = seq.tail_load
        assert tail is not None and seq.num_computed == tail.head_end, (seq.rid, seq.num_computed)
        seq.tail_load = None
        loaded = tail.future.result()
        for page, h in zip(tail.pages[:loaded], tail.hashes, strict=False):
            self.register(page, h)
        tokens = loaded * self.page_size
        seq.num_computed += tokens
        seq.num_cached += tokens
        seq.num_registered_pages = seq.num_computed // self.page_size
        return tokens

    def _drop_tail(self, seq: Seq) -> None:
        """A sequence let go of before its tail load finished: wait for the load (its pages are
        written until then), keep nothing of it."""
        tail, seq.tail_load = seq.tail_load, None
        if tail is not None:
            tail.future.result()

    def grow(self, seq: Seq, num_tokens: int, reserve: int = 0) -> bool:
        """Pages for ``num_tokens`` tokens of ``seq``, leaving ``reserve`` pages free;
        False (nothing changed) if the pool is short."""
        need = self.pages_for(num_tokens) - len(seq.page_table)
        if need <= 0:
            return True
        if not self.can_allocate(need + reserve):
            return False
        seq.page_table.extend(self.allocate(need))
        return True

    def shrink(self, seq: Seq, num_tokens: int) -> None:
        """Give back ``seq``'s pages past those ``num_tokens`` tokens need (a rejected
        speculative draft's); never a page whose KV is computed."""
        keep = max(self.pages_for(num_tokens), self.pages_for(seq.num_computed))
        if len(seq.page_table) > keep:
            self.free(seq.page_table[keep:])
            del seq.page_table[keep:]

    def reserve_prompt(self, seq: Seq, reserve: int = 0) -> bool:
        """Pages for ``seq``'s known tokens, reusing its cached prefix, leaving ``reserve``
        pages free; the KV of all but the last token (the prompt, and any output it was
        resumed with) is to be written by a transfer. False (nothing held) if the pool is short."""
        num_kv = seq.num_tokens - 1
        self.attach_prefix(seq, num_kv)
        # Sharing took the cached pages off the evictable list, so counting starts after it.
        if self.grow(seq, num_kv + 1, reserve):
            return True
        self.release(seq)
        return False

    def release(self, seq: Seq) -> None:
        """Drop ``seq``'s pages (cached full pages stay findable); nothing of it is computed."""
        self._drop_tail(seq)
        self.free(seq.page_table)
        seq.page_table = []
        seq.num_computed = seq.num_cached = 0
        seq.num_registered_pages = seq.num_offered_pages = 0

    def register_full_pages(self, seq: Seq) -> None:
        """Index ``seq``'s pages that became full since the last call (and offer the tiers
        those :meth:`offer_computed` did not)."""
        full = seq.num_computed // self.page_size
        self.hash_pages(seq, full * self.page_size)
        for i in range(seq.num_registered_pages, full):
            self.register(seq.page_table[i], seq.page_hashes[i])
        self._offer(seq, full)
        seq.num_registered_pages = max(seq.num_registered_pages, full)

    def _offer(self, seq: Seq, full: int) -> bool:
        """Offer the tiers ``seq``'s full pages up to ``full`` not offered yet; whether any."""
        offered = max(seq.num_registered_pages, seq.num_offered_pages)
        if self.tiers is None or not self.enable_prefix_cache or full <= offered:
            return False
        self.tiers.offer(seq.page_hashes, seq.page_table, offered, full)
        return True

    def offer_computed(self, seq: Seq, num_tokens: int) -> None:
        """Offer the tiers the full pages of ``seq``'s first ``num_tokens`` tokens that a step
        just launched computes (its hashes known: :meth:`hash_pages`): their snapshot is queued
        on the device after that step, so the host's part of it runs while the device computes
        rather than after the step's tokens come (0.4-1.0 ms of a 512-token prompt's TTFT with
        a disk or store on an H100, 2026-12-06). :meth:`register_full_pages` offers them no more.
        Called by :meth:`Engine.launch`, on the thread and stream that launched the step."""
        full = min(num_tokens // self.page_size, len(seq.page_hashes), len(seq.page_table))
        if self._offer(seq, full):
            seq.num_offered_pages = full

    def check_invariants(self) -> None:
        """For tests: every page is exactly one of free, evictable, referenced, parked."""
        free = set(self._free)
        parked = {page for _, page in self._parked}
        assert len(free) == len(self._free), "duplicate page in free list"
        assert len(parked) == len(self._parked), "duplicate parked page"
        for page in range(self.num_pages):
            states = (page in free) + (page in self._evictable) + (self._refs[page] > 0) + (page in parked)
            assert states == 1, f"page {page} is in {states} states"
        for page in self._evictable:
            assert page in self._hash_of
