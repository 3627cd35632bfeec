"""The serving engine: requests in, tokens out, one step at a time.

``step()`` is ``schedule()`` → ``execute()`` (``launch()`` then ``collect()``) →
``postprocess()``. Workers run ``execute`` (pure tensor work) in a thread and the other
two on their event loop, so new requests, aborts and releases never race a forward
pass. On a GPU, ``step()`` overlaps: a pure decode step is left queued on the device
while the host schedules and launches the next one, which takes its input tokens from
the device, so the host's work per step hides behind the GPU's. The offline benchmark
and the tests call ``step()`` directly: no sockets anywhere in here.

Roles: a *prefill* request (``prefill_only``) stops after its first token and its
pages are *held* until :meth:`release`; an *imported* request arrives with its
prompt's KV written into pages by a transfer and starts decoding at once.

A request of ``n > 1`` samples is one sequence (sample 0, keyed by the request's id)
carrying the others as ``forks``: its prompt is computed once, the prompt's last logits
row is drawn from once per sample, and each fork takes the prompt's full pages by
reference and a copy of the partial last page (``PageManager.fork``). Every sample then
decodes on its own, its outputs under ``rid#i``. On a prefill worker the forks only draw
their first token (the decode worker forks the pulled KV the same way).

Structured output: a sequence with a constraint has a grammar matcher; its rows' token
masks are filled on the host right after the forward pass is queued (so on a GPU while
it runs), and such a step is never left queued (the next mask needs this token).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from pdserve.engine import outputs
from pdserve.engine.admission import Admission
from pdserve.engine.appending import Appending
from pdserve.engine.config import EngineConfig
from pdserve.engine.grammar import Grammars
from pdserve.engine.kv_tiers import KVTiers, create_tiers
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import EngineStats, ExecResult, Launched, RequestOutput, VerifyResult, with_forks
from pdserve.engine.page_manager import PageManager
from pdserve.engine.sampler import Sampler, SampleRequest, score_prompt, token_logprobs
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import ScheduledBatch, Sequence, Status, scored_rows
from pdserve.engine.speculative import Speculator, verify
from pdserve.schemas import SamplingParams

log = logging.getLogger(__name__)

# A worker with a disk or store tier times its own prefill at start, for the tiers' cost rule
# (else a restarted worker loaded a prefix from a disk slower than computing it: 540 against
# 298 ms at 8,192 tokens on an H200, 2026-12-04). Prompts of these lengths where all fit in half
# the pool (else a quarter, a half and all of that: with one size only the rule priced a page by
# a step's fixed part too and loaded a store slower than computing, 1.3x at 512 tokens on an
# H200, 2026-12-05), random tokens; on a GPU the last in chunks after others, to tell the
# attention's growing share apart (kv_cost.prefill_model; 13 s on 2 cores). The shortest shows,
# with the next, the floor a step does not go below (kv_cost.prefill_floor: on a GPU the host's
# launches), which bounds what loading part of a prompt saves.
PREFILL_PROBES = (64, 256, 1024, 4096)
# Rounds of them timed after the first (which compiles), by device type, each size's fastest
# kept (CostEstimates.keep_fastest): a GPU's steps of a few hundred tokens are mostly the host's
# launches, and a slow spell of the host in one round left a restarted worker no floor
# (2026-12-07); a CPU's steps are its own arithmetic (and a round there takes seconds).
PROBE_ROUNDS = {"cuda": 2, "cpu": 1}


def probe_sizes(limit: int, gpu: bool) -> list[int]:
    """The prompt lengths :meth:`Engine.measure_prefill` times, none above ``limit`` tokens:
    :data:`PREFILL_PROBES` (off a GPU the first three), or as many as far apart within ``limit``
    where they do not all fit (none under 64)."""
    probes = PREFILL_PROBES if gpu else PREFILL_PROBES[:3]
    if probes[-1] <= limit:
        return list(probes)
    if limit < 64:
        return []
    return [limit // 4, limit // 2, limit] if gpu else [limit // 4, limit]


class StepObserver(Protocol):
    """Called in the engine's thread around each step (:attr:`Engine.observer`)."""

    def before_launch(self, batch: ScheduledBatch) -> None: ...

    def after_launch(self, launched: Launched) -> None: ...

    def after_collect(self, launched: Launched, result: ExecResult) -> None: ...


class Engine(Appending, Admission):
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        eos_token_ids: Iterable[int] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.runner = runner
        self.grammars = grammars
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.pages = PageManager(runner.num_pages, config.page_size, config.enable_prefix_cache)
        self.tiers: KVTiers | None = None
        if config.kv_tiers.enabled and config.enable_prefix_cache:
            self.tiers = create_tiers(runner.pool, runner.model, config.kv_tiers)
            self.tiers.estimates.chunk_tokens = config.chunked_prefill_size
            self.pages.tiers = self.tiers
        self.scheduler = Scheduler(config, self.pages, runner.max_model_len)
        self.sampler = Sampler(runner.device, self.eos_token_ids)
        assert runner.max_model_len is not None
        self.max_model_len: int = runner.max_model_len
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._in_flight: list[ScheduledBatch] = []  # scheduled, not yet postprocessed
        # On a GPU a step runs after it is launched: pages freed meanwhile wait for it
        # (PageManager.park_tag), so an import may write into its pages at once.
        self.park_freed = runner.device.type == "cuda"
        self._serial = 0
        self._aborted: set[str] = set()  # aborted while in flight: dropped when their steps end
        self._pending: Launched | None = None  # a step left queued on the device by step()
        # Overlap needs tokens that can stay on the device: the fast path's (under tensor
        # parallelism they are shared with the other ranks, whose next step they feed too).
        self.overlap = config.overlap_schedule and runner.fast is not None and runner.fast.overlaps
        # Speculative decoding (``engine/speculative.py``): a draft needs the sequence's last
        # token on the host, so a step before one where a sequence is due to draft is not left
        # queued (``_may_overlap``). Under tensor parallelism rank 0 drafts, accepts and rolls
        # back; the followers compute the verify rows its step command names.
        self.speculator: Speculator | None = None
        if config.speculative_algorithm:
            self.speculator = self.scheduler.speculator = Speculator(config)
            self.stats.spec = self.speculator.stats
        # Time each step on the device (CUDA events; a step timeline at DEBUG): costs two
        # event records a step, so off unless asked.
        self.time_steps = False
        # Told of each step in the engine thread (``StepObserver``): co-located prefill's SM share.
        self.observer: StepObserver | None = None
        self._last_done: torch.cuda.Event | None = None
        capacity = config.max_num_seqs + config.max_prefill_seqs
        on_gpu = self.overlap and runner.device.type == "cuda"
        self._pinned = [torch.empty(capacity, dtype=torch.long, pin_memory=True) for _ in range(3)] if on_gpu else []
        self._next_pinned = 0
        self._prefill_clock = outputs.PrefillClock(runner.device.type == "cuda")  # the KV tiers' recompute rate
        # The stream the steps run on: the launching thread's, taken at each launch (a co-located
        # prefill's is its own, and its SM share switches it). Scheduling and postprocessing run
        # on it wherever they are called from (a worker's event loop), so that the device work
        # they queue (the KV tiers' loads, host-memory demotions, write snapshots) is ordered
        # with the steps around it.
        self.stream: torch.cuda.Stream | None = None
        self._default_stream: torch.cuda.Stream | None = None  # every thread's unless it set another
        if runner.device.type == "cuda":
            self.stream = torch.cuda.current_stream(runner.device)
            self._default_stream = torch.cuda.default_stream(runner.device)
        self.measure_prefill()
        if self.tiers is not None:
            self.tiers.warm_up()  # a load's and a write's device work, once before the first request

    def measure_prefill(self) -> bool:
        """Time prefills of :data:`PREFILL_PROBES` tokens for the KV tiers' cost rule (a first
        round compiles kernels, then :data:`PROBE_ROUNDS` rounds are timed and each size's fastest
        kept; the floor too, where they show one), where a disk or store tier decides by cost and
        nothing has run yet. Nothing of them is cached, offered to the tiers or
        counted in :attr:`stats`. Returns whether it measured."""
        tiers = self.tiers
        if tiers is None or not tiers.groups or tiers.config.load != "cost" or self.has_work():
            return False
        limit = min(self.max_model_len - 1, self.pages.num_pages * self.config.page_size // 2)
        sizes = probe_sizes(limit, self.runner.device.type == "cuda")
        if not sizes:
            return False
        rng = random.Random(0)
        greedy = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        saved, self.stats = self.stats, EngineStats()
        self.pages.enable_prefix_cache = False
        try:
            for round_ in range(1 + PROBE_ROUNDS.get(self.runner.device.type, 1)):
                if round_ < 2:  # (the first round's readings paid the compiles)
                    tiers.estimates.clear_prefill()
                for n in sizes:
                    self.add_request(
                        f"prefill-probe-{round_}-{n}", [rng.randrange(self.runner.vocab_size) for _ in range(n)], greedy
                    )
                    while self.has_work():
                        self.step()
            tiers.estimates.keep_fastest()
            tiers.estimates.measure_floor()  # the timed rounds' steps
        finally:
            self.pages.enable_prefix_cache = True
            self.stats = saved
        log.info(
            "prefill measured for the KV tiers",
            extra={
                "tokens": sizes,
                "us_per_token": round(tiers.estimates.prefill_s_per_token * 1e6, 2),
                "ns_per_pair": round(tiers.estimates.prefill_s_per_pair * 1e9, 4),
                "floor_ms": round(tiers.estimates.prefill_floor_s * 1e3, 3),
            },
        )
        return tiers.estimates.prefill_s_per_token > 0.0

    # ---- stepping ----------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    def schedule(self) -> ScheduledBatch:
        """The next step's work; its requests count as in flight until :meth:`postprocess`."""
        with self._on_stream():
            batch = self.scheduler.schedule()
        if not batch.is_empty:
            batch.scored = scored_rows(batch.prefills)
            self._serial += 1
            batch.serial = self._serial
            self._in_flight.append(batch)
            if self.park_freed:
                self.pages.park_tag = batch.serial
        return batch

    def _retire(self, batch: ScheduledBatch) -> None:
        """``batch`` is done on the device (or never ran): the pages parked under it and
        before are free; pages freed from now wait for the steps still in flight, if any."""
        self._in_flight = [b for b in self._in_flight if b is not batch]
        if not self.park_freed:
            return
        self.pages.unpark(batch.serial)
        self.pages.park_tag = max((b.serial for b in self._in_flight), default=None)

    @property
    def pending(self) -> Launched | None:
        """The step left queued on the device (its tokens feed the next one), if any."""
        return self._pending

    def launch(self, batch: ScheduledBatch) -> Launched:
        """Queue the forward pass and sampling. A decoding sequence whose last token is still
        pending (sampled by the step in flight before this one) is fed it on the device.
        Touches only tensors and the prefills' page hashes (``PageManager.hash_pages``,
        computed while the device runs them); safe to run in a worker thread."""
        if self.observer is not None:
            self.observer.before_launch(batch)
        launched = self._launch(batch)
        if self.observer is not None:
            self.observer.after_launch(launched)
        if self.stream is not None:
            self.stream = torch.cuda.current_stream(self.runner.device)
        if self.tiers is not None:  # snapshots for the writer, queued behind the step
            for seq, n in batch.prefills:
                self.pages.offer_computed(seq, seq.num_computed + n)
            # the rule's fit of the steps read since the last, made while the device runs this
            # one: in a request's lookup it was 0.1-0.3 ms of this CPU's interpreter before the
            # request's own step (on a GPU a 512-token step is mostly the host's launches)
            self.tiers.estimates.refresh()
        return launched

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        """The steps' stream made current (see ``stream``) where it is one of their own; on the
        default stream, which every thread has unless it set another, or off a GPU, nothing
        (no stream switch on every step of a decode loop for nothing)."""
        if self.stream is None or self.stream == self._default_stream:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def _launch(self, batch: ScheduledBatch) -> Launched:
        started = time.perf_counter()
        gpu_start = None
        if self.time_steps and self.runner.device.type == "cuda":
            gpu_start = torch.cuda.Event(enable_timing=True)
            gpu_start.record()
        prefill = self._prefill_clock.begin() if self.tiers is not None and batch.prefills else None
        feed = self._feed(batch)
        seqs, logits = self.runner.execute(batch, feed)
        self._prefill_clock.end(batch, prefill)
        if batch.scored and logits is not None:  # the prompt rows to score come last
            num_rows = logits.shape[0] - sum(n for _, _, n in batch.scored)
            self._score(batch.scored, logits[num_rows:])
            logits = logits[:num_rows] if seqs or batch.verifies else None
        verify_logits = None
        if batch.verifies and logits is not None:  # their rows come after the sampled ones
            num_rows = logits.shape[0] - sum(len(d) + 1 for _, d in batch.verifies)
            verify_logits = logits[num_rows:]
            logits = logits[:num_rows] if seqs else None
        for seq, n in batch.prefills:  # the prefix index's keys of the chunks, while the device computes them
            self.pages.hash_pages(seq, seq.num_computed + n)
        if logits is not None and any(s.forks for s in seqs):
            seqs, logits = with_forks(seqs, logits)
        launched = Launched(batch, seqs, started, gpu_start=gpu_start)
        if verify_logits is not None:
            launched.verified = self._verify(batch.verifies, verify_logits)
        if logits is None:
            return launched
        rows = [SampleRequest(s.sampling, s.prompt_ids, s.output_ids, index=s.num_outputs) for s in seqs]
        masks = None
        if self.grammars is not None and any(s.matcher is not None for s in seqs):
            # Filled on the host while the device runs the forward pass just queued.
            advance = self._catch_up(seqs)
            masks = self.grammars.masks([s.matcher for s in seqs], logits.device, advance)
        on_device = self.overlap and len(seqs) <= (len(self._pinned[0]) if self._pinned else len(seqs))
        tokens = self.sampler.sample_on_device(logits, rows, masks) if on_device else None
        if tokens is not None and self.runner.tp is not None:
            tokens = self.runner.share_tokens(tokens)
        if tokens is None:
            launched.host = self.sampler(logits, rows, masks)
        elif tokens.is_cuda:
            launched.tokens = tokens
            copy = self._pinned[self._next_pinned][: len(seqs)]
            self._next_pinned = (self._next_pinned + 1) % len(self._pinned)
            copy.copy_(tokens, non_blocking=True)
            launched.copy = copy
            launched.done = torch.cuda.Event(enable_timing=gpu_start is not None)
            launched.done.record()
        else:
            launched.tokens = launched.copy = tokens
        for seq in seqs:
            seq.num_pending += 1
        return launched

    def _score(self, scored: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> None:
        """Score prompt tokens on their rows' logits (row ``p`` of a prompt: token ``p + 1``)."""
        start = 0
        for seq, p, n in scored:
            assert seq.prompt_scores is not None and seq.prompt_scores.num == p, "prompt rows scored out of order"
            score_prompt(logits[start : start + n], seq.prompt_ids[p + 1 : p + 1 + n], seq.prompt_scores)
            self.stats.scored_prompt_tokens += n
            start += n

    def _verify(self, verifies: list[tuple[Sequence, list[int]]], logits: torch.Tensor) -> list[VerifyResult]:
        """Judge the drafts on their logits rows (``speculative.verify``): row ``t`` of a
        sequence draws its output index ``num_outputs + t`` after ``draft[:t]``."""
        rows = [
            [
                SampleRequest(
                    seq.sampling,
                    seq.prompt_ids,
                    seq.output_ids + draft[:t] if seq.sampling.reads_history else seq.output_ids,
                    index=seq.num_outputs + t,
                )
                for t in range(len(draft) + 1)
            ]
            for seq, draft in verifies
        ]
        masks = None  # structured output: each row under its grammar's mask after the draft before it
        if self.grammars is not None and any(seq.matcher is not None for seq, _ in verifies):
            masks = self.grammars.draft_masks([(seq.matcher, draft) for seq, draft in verifies], logits.device)
        judged = verify(self.sampler, logits, [d for _, d in verifies], rows, masks)
        out: list[VerifyResult] = []
        start = 0
        for (seq, draft), group, v in zip(verifies, rows, judged, strict=True):
            logprobs = None
            if seq.sampling.logprobs:
                n = len(v.tokens)
                logprobs = token_logprobs(logits[start : start + n], group[:n], v.tokens)
            out.append(VerifyResult(seq, len(draft), v.tokens, v.accepted, logprobs))
            start += len(draft) + 1
        return out

    def _catch_up(self, seqs: list[Sequence]) -> list[tuple[int, int] | None] | None:
        """The token each row's grammar must take before its mask is filled: the one the
        step left queued before this one sampled for it, ``(output index, token)`` (see
        ``Matcher.accept_at``). Waits for that step (the device meanwhile runs the forward
        pass just queued behind it)."""
        previous = self._pending
        if previous is None:
            return None
        behind = {id(s) for s in seqs if s.matcher is not None and s.num_pending}
        if not any(id(s) in behind for s in previous.seqs):
            return None
        result = self.collect(previous)
        took = {
            id(seq): (len(seq.output_ids), token)
            for seq, token in zip(result.seqs, result.token_ids, strict=True)
            if id(seq) in behind
        }
        return [took.get(id(s)) for s in seqs]

    def _feed(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]] | None:
        """The previous step's device tokens and, per decode, its row there (-1: known)."""
        previous = self._pending
        if previous is None or previous.tokens is None:
            return None
        row_of = {seq.rid: i for i, seq in enumerate(previous.seqs)}
        rows = [row_of.get(seq.rid, -1) if seq.num_pending else -1 for seq in batch.decodes]
        return (previous.tokens, rows) if any(r >= 0 for r in rows) else None

    def collect(self, launched: Launched) -> ExecResult:
        """Wait for a launched step's tokens (blocks: run it where blocking is fine)."""
        if launched.host is not None:
            tokens, logprobs = launched.host.token_ids, launched.host.logprobs
        elif launched.copy is not None:
            if launched.done is not None:
                launched.done.synchronize()
            tokens, logprobs = launched.copy.tolist(), [None] * len(launched.seqs)
        else:
            tokens, logprobs = [], []
        gpu = period = None
        if launched.gpu_start is not None and launched.done is not None:
            gpu = launched.gpu_start.elapsed_time(launched.done) / 1e3
            if self._last_done is not None:
                period = self._last_done.elapsed_time(launched.done) / 1e3
            self._last_done = launched.done
        result = ExecResult(
            launched.seqs, tokens, logprobs, time.perf_counter() - launched.started, gpu, period, launched.verified
        )
        if self.observer is not None:
            self.observer.after_collect(launched, result)
        return result

    def execute(self, batch: ScheduledBatch) -> ExecResult:
        """Forward pass and sampling, waited for. Safe to run in a worker thread."""
        return self.collect(self.launch(batch))

    def postprocess(self, batch: ScheduledBatch, result: ExecResult) -> list[RequestOutput]:
        """Account a step's tokens: pages indexed (and offered to the tiers), outputs made."""
        with self._on_stream():
            return self._postprocess(batch, result)

    def _postprocess(self, batch: ScheduledBatch, result: ExecResult) -> list[RequestOutput]:
        self._retire(batch)
        self.stats.steps += 1
        self.stats.batch_rows += len(batch.decodes) + len(batch.prefills) + len(batch.verifies)
        if self.speculator is not None and not batch.prefills and not batch.held:  # what drafts are weighed by
            # (a step left queued is timed from before the one ahead of it ended: not its own cost)
            self.speculator.observe_step(batch.num_tokens, len(batch.verifies), result.gpu_seconds or result.seconds)
        self.stats.busy_seconds += result.seconds
        if self.tiers is not None:  # the tiers' recompute rate (a step of less than a page: all fixed cost)
            for tokens, pairs, seconds in self._prefill_clock.readings(batch, result.seconds):
                if tokens >= self.config.page_size:
                    self.tiers.note_prefill(tokens, seconds, pairs)
        for seq in batch.decodes:
            if seq.status is Status.RUNNING:  # not preempted or finished while the step was queued
                self.scheduler.on_computed(seq, 1)
        for seq, n in batch.prefills:
            self.scheduler.on_computed(seq, n)
        outputs: list[RequestOutput] = []
        decoded = {id(s) for s in batch.decodes}
        unforked = self._branch(result.seqs)
        for seq, token, logprob in zip(result.seqs, result.token_ids, result.logprobs, strict=True):
            seq.num_pending -= 1
            if seq.rid in self._aborted or seq.group in self._aborted or seq.is_finished:
                continue  # aborted, or finished by the step before while this one was queued
            if id(seq) in unforked:
                continue  # no page to fork into (or its request is gone): it computes its prompt itself
            outputs.append(self._append(seq, token, logprob, id(seq) in decoded))
        for v in result.verified:
            seq = v.seq
            if seq.rid in self._aborted or seq.group in self._aborted or seq.status is not Status.RUNNING:
                continue
            outputs.append(self._append_verified(v))
        self._drop_aborted()
        return outputs

    def _branch(self, seqs: list[Sequence]) -> set[int]:
        """At an ``n > 1`` request's first token: its forks join the engine, on the prompt's
        KV (shared pages, a copy of the partial one) unless they only draw a first token
        (prefill role). Returns the forks (by ``id``) whose token this step must drop."""
        unforked: set[int] = set()
        for parent in seqs:
            if not parent.forks or parent.forked:
                continue
            forks, parent.forks = parent.forks, []
            if parent.rid in self._aborted:
                unforked.update(id(f) for f in forks)  # the request is gone: its forks never start
                continue
            for fork in forks:
                if fork.prefill_only:
                    continue  # its first token goes into the KV hand-off
                self.seqs[fork.rid] = fork
                if not self._fork(parent, fork):
                    unforked.add(id(fork))
                    self.scheduler.add(fork)
        return unforked

    def fail(self, batch: ScheduledBatch) -> list[Sequence]:
        """The batch's forward pass raised: drop its requests (pages freed); returns them."""
        seqs = list(batch.decodes) + [s for s, _ in batch.prefills] + [s for s, _ in batch.verifies]
        self._retire(batch)
        if self._pending is not None and self._pending.batch is batch:
            self._pending = None
        for seq in seqs:
            seq.num_pending = 0
            self._drop(seq, "error")
        self._drop_aborted()
        return seqs

    def discard_in_flight(self) -> list[Sequence]:
        """Drop the requests of every step scheduled but not postprocessed (a worker stopping
        mid-step); their pages are freed. Returns them."""
        dropped: list[Sequence] = []
        for batch in list(self._in_flight):
            dropped += self.fail(batch)
        return dropped

    def step(self) -> list[RequestOutput]:
        """One step. With overlap, a pure decode step stays queued on the device while the
        next one is scheduled and launched; its tokens come out one call later."""
        outputs: list[RequestOutput] = []
        batch = self.schedule()
        launched = None if batch.is_empty else self.launch(batch)
        if self._pending is not None:
            outputs += self.complete(self._pending, self.collect(self._pending))
        if launched is not None and not self.hold(launched):
            outputs += self.complete(launched, self.collect(launched))
        return outputs

    def hold(self, launched: Launched) -> bool:
        """Leave ``launched`` queued while the next step is scheduled, if it allows it."""
        if not self._may_overlap(launched):
            return False
        assert self._pending is None, "one step at a time may be left queued"
        self._pending = launched
        launched.batch.held = True
        self.stats.overlapped_steps += 1
        return True

    def complete(self, launched: Launched, result: ExecResult) -> list[RequestOutput]:
        """:meth:`postprocess` of a launched step, which then feeds no later step."""
        if self._pending is launched:
            self._pending = None
        return self.postprocess(launched.batch, result)

    def _may_overlap(self, launched: Launched) -> bool:
        """Whether the next step may be scheduled before this one's tokens are known: only
        decodes in it (no prefill progress to account), tokens on the device, and no row
        whose sampling reads its own history (penalties, bad words). A constrained row may: the next
        step's launch hands its grammar the token before filling its mask (``_catch_up``)."""
        batch = launched.batch
        held = self.overlap and launched.tokens is not None and not batch.prefills and not batch.verifies
        if held and any(s.sampling.reads_history for s in batch.decodes):
            held = False  # (the slower path: counted, as a user's penalties or bad words cost it)
            self.stats.history_unoverlapped_steps += 1
        speculator = self.speculator
        if held and speculator is not None and any(speculator.due(s, len(batch.decodes)) for s in batch.decodes):
            held = False  # the next step drafts for it: its last token must be on the host by then
            speculator.stats.unoverlapped_steps += 1
        return held

    def _drop_aborted(self) -> None:
        for rid in list(self._aborted):
            if not self.is_in_flight(rid):
                self._aborted.discard(rid)
                seq = self.seqs.get(rid) or self.held.get(rid)
                if seq is not None:
                    self._drop(seq, "abort")

    def is_in_flight(self, rid: str) -> bool:
        return any(rid in batch.rids for batch in self._in_flight)

    # ---- introspection -----------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_urgent(self) -> int:
        """Sequences held (waiting or running) of a priority above the default (below 0)."""
        sched = self.scheduler
        return sum(1 for seq in (*sched.waiting, *sched.running) if seq.sampling.priority < 0)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_prefill_tokens_waiting(self) -> int:
        """Tokens of waiting sequences not computed yet (prompts, and resumed outputs)."""
        return sum(seq.num_uncomputed for seq in self.scheduler.waiting)

    def held_pages(self, rid: str) -> tuple[list[int], int] | None:
        """A held request's pages and how many tokens of KV they hold (its prompt, and for a
        resumed request the output it was resumed with)."""
        seq = self.held.get(rid)
        if seq is None:
            return None
        return seq.page_table, seq.num_computed
