"""Continuous batching with chunked prefill and prefix reuse. Policy only: no tensors, no I/O.

Each step the scheduler takes every running sequence for one decode token (growing
its pages as needed, preempting the newest sequence of the lowest priority when pages run
out), with speculative decoding on gives those whose draft pays a verify of it instead
(``engine/speculative.py``), then spends the rest of the token budget on prefill chunks of
waiting sequences, by priority (a request's ``priority``, lower first), then oldest first. A
waiting request that a full batch keeps out takes the seat of a running one of a lower
priority (which waits again, its pages cached, to be recomputed).
"""

from __future__ import annotations

from collections import deque

from pdserve.engine.config import EngineConfig
from pdserve.engine.page_manager import PageManager
from pdserve.engine.sequence import ScheduledBatch, Sequence, Status
from pdserve.engine.speculative import Speculator

# Prompt tokens a step computes of a prompt whose log-probabilities are asked for: each keeps
# its row's logits (a 150,000-token vocabulary's 2,048 rows in float32 would be 1.2 GB).
SCORED_ROWS = 512


class Scheduler:
    def __init__(self, config: EngineConfig, pages: PageManager, max_model_len: int | None = None) -> None:
        self.config = config
        self.pages = pages
        self.max_model_len = max_model_len or config.max_model_len or 1 << 62
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of those, running requests that gave a higher-priority one their seat
        self.num_tail_tokens = 0  # prompt tokens loaded from a tier beside the computing of the part before them
        self.speculator: Speculator | None = None  # speculative decoding's drafter (the engine sets it)

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    def add(self, seq: Sequence) -> None:
        ahead = self._wait(seq)
        if seq.prompt_scores is None:  # the KV tiers read its cached prefix ahead while it waits
            self.pages.prefetch(seq, ahead)

    def _wait(self, seq: Sequence, first: bool = False) -> int:
        """Queue ``seq`` behind the waiting sequences of its priority or a higher one (lower
        values), or with ``first`` (a preempted one) ahead of those of its own; returns how
        many wait ahead of it."""
        waiting = self.waiting
        p = seq.sampling.priority
        if first:
            if not waiting or waiting[0].sampling.priority >= p:
                waiting.appendleft(seq)
                return 0
            at = next((i for i, s in enumerate(waiting) if s.sampling.priority >= p), len(waiting))
        else:
            if not waiting or waiting[-1].sampling.priority <= p:
                waiting.append(seq)
                return len(waiting) - 1
            at = next(i for i, s in enumerate(waiting) if s.sampling.priority > p)
        waiting.insert(at, seq)
        return at

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` (+1 to decode) could fit in an empty pool."""
        return self.pages.pages_for(num_tokens + 1) <= self.pages.num_pages

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        self.running.sort(key=_rank)  # the last is the one preempted first
        self._seat_by_priority()
        decodes = self._schedule_decodes()
        verifies = self._schedule_drafts(decodes) if self.speculator is not None and decodes else []
        if verifies:
            drafted = {id(s) for s, _ in verifies}
            decodes = [s for s in decodes if id(s) not in drafted]
        used = len(decodes) + sum(len(d) + 1 for _, d in verifies)
        prefills = self._schedule_prefills(self.config.chunked_prefill_size - used)
        return ScheduledBatch(decodes, prefills, verifies=verifies)

    def _seat_by_priority(self) -> None:
        """The first waiting request not started that a full batch (or a pool too short for
        its first chunk) keeps out takes the seat and pages of the running request of the
        lowest priority below its own (the newest of them), which waits again (its full
        pages stay cached: recomputing is a prefix hit), as many as it needs (an ``n > 1``
        request a seat a sample); a batch grown past its size by imported requests of a
        higher priority gives back as many seats. Preempted this way:
        :attr:`num_priority_preemptions`."""
        running = self.running
        # requests imported past a full batch for their priority (a decode worker's urgent
        # lane): the batch back to its size by those of the lowest priority below the highest
        while len(running) > self.config.max_num_seqs and running[-1].sampling.priority > running[0].sampling.priority:
            self.preempt(running[-1])
            self.num_priority_preemptions += 1
        best = next((s for s in self.waiting if not s.page_table and s.num_computed == 0 and not s.num_pending), None)
        if best is None or not running or running[-1].sampling.priority <= best.sampling.priority:
            return  # (no running request of a lower priority: every step of equal priorities ends here)
        seats = self.config.max_num_seqs - 1 - len(best.forks)
        chunk = self.pages.pages_for(min(best.num_tokens, self.config.chunked_prefill_size) + 1)
        while len(self.running) > seats or not self.pages.can_allocate(chunk + len(self.running)):
            worst = self.running[-1]  # (sorted by rank)
            if worst.sampling.priority <= best.sampling.priority:
                return
            self.preempt(worst)
            self.num_priority_preemptions += 1
            if not self.running:
                return

    def _schedule_drafts(self, decodes: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """The decodes that verify a speculative draft this step, with their drafts (pages
        grown for them; a draft that finds no page is dropped, its sequence decodes plainly)."""
        speculator = self.speculator
        assert speculator is not None
        price = speculator.begin_step(len(decodes))
        budget = self.config.chunked_prefill_size - len(decodes)
        verifies: list[tuple[Sequence, list[int]]] = []
        for seq in decodes:
            # no more positions than the context holds, no more tokens than the request may get
            limit = min(seq.sampling.max_new_tokens - seq.num_outputs - 1, self.max_model_len - seq.num_tokens, budget)
            draft = speculator.draft(seq, limit, price)
            if draft and self.pages.grow(seq, seq.num_tokens + len(draft)):
                verifies.append((seq, draft))
                budget -= len(draft)
        return verifies

    # ---- decode ------------------------------------------------------------
    def _schedule_decodes(self) -> list[Sequence]:
        """(``running`` sorted by rank: :meth:`schedule`.)"""
        scheduled: list[Sequence] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.num_pending and self._ends_with_pending(seq):
                i += 1  # its pending token is its last: nothing more to compute
            elif self.pages.grow(seq, seq.num_tokens):
                scheduled.append(seq)
                i += 1
            else:
                self.preempt(self.running[-1])
        return scheduled

    def _ends_with_pending(self, seq: Sequence) -> bool:
        return seq.num_outputs >= seq.sampling.max_new_tokens or seq.num_tokens >= self.max_model_len

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and send it back to wait for recomputation (its full
        pages usually stay in the prefix cache, so recomputing is cheap)."""
        self.running.remove(seq)
        self.pages.release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._wait(seq, first=True)

    # ---- prefill -----------------------------------------------------------
    def _schedule_prefills(self, budget: int) -> list[tuple[Sequence, int]]:
        prefills: list[tuple[Sequence, int]] = []
        watermark = len(self.running)  # leave each running sequence room to grow a page
        active = len(self.running)
        blocked = False
        for seq in list(self.waiting):
            if budget <= 0 or len(prefills) >= self.config.max_prefill_seqs:
                break
            if seq.num_pending:
                continue  # preempted with a token still on the device: prefill once it is known
            started = seq.num_computed > seq.num_cached
            if blocked and not started:
                continue  # once short of pages, only half-done prefills go on (they finish and free)
            need = 1 + len(seq.forks)  # an n > 1 request's samples all run after its prefill
            if not seq.page_table and seq.num_computed == 0:
                if active + need > self.config.max_num_seqs:
                    blocked = True
                    continue
                # at least one token left to compute; a slow tier's part may load while the part before it computes
                self.pages.attach_prefix(seq, _reusable(seq), overlap_reserve=watermark)
            tail = seq.tail_load
            if tail is not None and seq.num_computed >= tail.head_end:
                if not tail.future.done() and (prefills or self.running):
                    continue  # its tail is still loading: the others go on meanwhile
                self.num_tail_tokens += self.pages.finish_tail(seq)  # (waits, when nothing else can run)
            n = min(seq.num_uncomputed, budget)
            if seq.prompt_scores is not None:  # every row's logits are kept: a bounded chunk
                n = min(n, SCORED_ROWS)
            if seq.tail_load is not None:  # compute up to where its loading tail begins
                n = min(n, seq.tail_load.head_end - seq.num_computed)
            if not self.pages.grow(seq, seq.num_computed + n, reserve=watermark):
                if not started:
                    self.pages.release(seq)  # give back the prefix pages; retry later
                blocked = True
                continue
            prefills.append((seq, n))
            budget -= n
            active += need
        if blocked and not prefills and not self.running:
            self._unblock()
        return prefills

    def _unblock(self) -> None:
        """Nothing runs and half-done prefills hold the pages the oldest one needs:
        send the newest of them back to recompute later (its full pages stay cached)."""
        holders = [s for s in self.waiting if s.page_table]
        if holders:
            newest = max(holders, key=lambda s: s.arrival)
            self.pages.release(newest)
            newest.num_preemptions += 1
            self.num_preemptions += 1

    # ---- after a step ------------------------------------------------------
    def on_verified(self, seq: Sequence, num_new: int) -> None:
        """A verify step kept ``num_new`` tokens' KV (its last token and the accepted draft):
        the pages past what ``seq`` now needs go back (their slots held rejected tokens)."""
        self.on_computed(seq, num_new)
        self.pages.shrink(seq, seq.num_tokens)

    def on_computed(self, seq: Sequence, num_new: int) -> None:
        """``num_new`` more tokens of ``seq`` now have KV; index newly full pages."""
        seq.num_computed += num_new
        self.pages.register_full_pages(seq)

    def start_running(self, seq: Sequence) -> None:
        """A waiting sequence finished its prefill and got its next token."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence, keep_pages: bool = False) -> None:
        """Take ``seq`` out of the queues; its pages are freed unless ``keep_pages``."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if not keep_pages:
            self.pages.release(seq)


def _rank(seq: Sequence) -> tuple[int, float]:
    """Scheduling order: priority (lower first), then arrival."""
    return seq.sampling.priority, seq.arrival


def _reusable(seq: Sequence) -> int:
    """How much of ``seq``'s prefix may come from the cache: all but its last token, or for a
    prompt to score no more than it has scored (the cache keeps KV, not logits)."""
    limit = seq.num_tokens - 1
    return limit if seq.prompt_scores is None else min(limit, seq.prompt_scores.num)
