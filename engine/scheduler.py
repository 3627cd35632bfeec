"""Continuous batching with chunked prefill and prefix reuse. Policy only: no tensors, no I/O.

Each step the scheduler takes every running sequence for one decode token (growing
its pages as needed, preempting the newest sequence when pages run out), then spends
the rest of the token budget on prefill chunks of waiting sequences, oldest first.
"""

from __future__ import annotations

from collections import deque

from pdserve.engine.block_manager import BlockManager, page_hash
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ScheduledBatch
from pdserve.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def page_size(self) -> int:
        return self.blocks.page_size

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` (+1 to decode) could fit in an empty pool."""
        return self.blocks.pages_for(num_tokens + 1) <= self.blocks.num_pages

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        decodes = self._schedule_decodes()
        prefills = self._schedule_prefills(self.config.chunked_prefill_size - len(decodes))
        return ScheduledBatch(decodes, prefills)

    # ---- decode ------------------------------------------------------------
    def _schedule_decodes(self) -> list[Sequence]:
        self.running.sort(key=lambda s: s.arrival)
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < len(self.running):
            seq = self.running[len(scheduled)]
            if self._grow(seq, seq.num_tokens):
                scheduled.append(seq)
                continue
            victim = self.running[-1]
            self.preempt(victim)
        return scheduled

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` pages for ``num_tokens`` tokens; False if the pool is short."""
        need = self.blocks.pages_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        seq.block_table.extend(self.blocks.allocate(need))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and send it back to wait for recomputation (its full
        pages usually stay in the prefix cache, so recomputing is cheap)."""
        self.running.remove(seq)
        self._release_pages(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- prefill -----------------------------------------------------------
    def _schedule_prefills(self, budget: int) -> list[tuple[Sequence, int]]:
        prefills: list[tuple[Sequence, int]] = []
        watermark = len(self.running)  # leave each running sequence room to grow a page
        active = len(self.running)
        blocked = False
        for seq in list(self.waiting):
            if budget <= 0 or len(prefills) >= self.config.max_prefill_seqs:
                break
            started = seq.num_computed > seq.num_cached
            if blocked and not started:
                continue  # once short of pages, only half-done prefills go on (they finish and free)
            if not seq.block_table and seq.num_computed == 0:
                if active >= self.config.max_num_seqs:
                    blocked = True
                    continue
                self._admit(seq)
            n = min(seq.num_uncomputed, budget)
            need = self.blocks.pages_for(seq.num_computed + n) - len(seq.block_table)
            if need > 0 and not self.blocks.can_allocate(need + watermark):
                if not started:
                    self._release_pages(seq)  # give back the prefix pages; retry later
                blocked = True
                continue
            self._grow(seq, seq.num_computed + n)
            prefills.append((seq, n))
            budget -= n
            active += 1
        if blocked and not prefills and not self.running:
            self._unblock()
        return prefills

    def _unblock(self) -> None:
        """Nothing runs and half-done prefills hold the pages the oldest one needs:
        send the newest of them back to recompute later (its full pages stay cached)."""
        holders = [s for s in self.waiting if s.block_table]
        if holders:
            newest = max(holders, key=lambda s: s.arrival)
            self._release_pages(newest)
            newest.num_preemptions += 1
            self.num_preemptions += 1

    def _admit(self, seq: Sequence) -> None:
        """Attach cached pages of the longest known prefix (at least one token is left to compute)."""
        seq.page_hashes = self.blocks.match_prefix(seq.tokens)
        cached = self.blocks.lookup(seq.page_hashes)[: (seq.num_tokens - 1) // self.page_size]
        self.blocks.share(cached)
        seq.block_table = list(cached)
        seq.num_computed = seq.num_cached = len(cached) * self.page_size
        seq.num_registered_pages = len(cached)

    # ---- after a step ------------------------------------------------------
    def on_computed(self, seq: Sequence, num_new: int) -> None:
        """``num_new`` more tokens of ``seq`` now have KV; index newly full pages."""
        seq.num_computed += num_new
        self._register_full_pages(seq)

    def start_running(self, seq: Sequence) -> None:
        """A waiting sequence finished its prefill and got its next token."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _register_full_pages(self, seq: Sequence) -> None:
        full = seq.num_computed // self.page_size
        tokens = None
        for i in range(seq.num_registered_pages, full):
            if i >= len(seq.page_hashes):
                tokens = tokens or seq.tokens
                parent = seq.page_hashes[-1] if seq.page_hashes else None
                seq.page_hashes.append(page_hash(parent, tokens[i * self.page_size : (i + 1) * self.page_size]))
            self.blocks.register(seq.block_table[i], seq.page_hashes[i])
        seq.num_registered_pages = max(seq.num_registered_pages, full)

    def remove(self, seq: Sequence, keep_pages: bool = False) -> None:
        """Take ``seq`` out of the queues; its pages are freed unless ``keep_pages``."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if not keep_pages:
            self._release_pages(seq)

    def _release_pages(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = seq.num_cached = 0
        seq.num_registered_pages = 0
