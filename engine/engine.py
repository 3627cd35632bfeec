"""The serving engine: requests in, tokens out, one step at a time.

``step()`` is ``schedule()`` → ``execute()`` → ``postprocess()``. Workers run
``execute`` (pure tensor work) in a thread and the other two on their event loop, so
new requests, aborts and releases never race a forward pass. The offline benchmark
and the tests call ``step()`` directly: no sockets anywhere in here.

Roles: a *prefill* request (``prefill_only``) stops after its first token and its
pages are *held* until :meth:`release`; an *imported* request arrives with its
prompt's KV written into pages by a transfer and starts decoding at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.page_manager import PageManager
from pdserve.engine.sampler import Sampler, SampleRequest
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import ScheduledBatch, Sequence, Status
from pdserve.schemas import SamplingParams, TokenLogprob

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve (too long for the model or the pool)."""


@dataclass
class RequestOutput:
    """New tokens of one request from one step. ``index`` is the output position of
    ``token_ids[0]``. ``finish_reason`` is set on the last output; ``held`` marks a
    prefill-only request whose KV now waits for a decode worker."""

    rid: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    held: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class ExecResult:
    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    seconds: float


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    busy_seconds: float = 0.0


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        eos_token_ids: Iterable[int] = (),
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.runner = runner
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.pages = PageManager(runner.num_pages, config.page_size, config.enable_prefix_cache)
        self.scheduler = Scheduler(config, self.pages)
        self.sampler = Sampler(runner.device)
        assert runner.max_model_len is not None
        self.max_model_len: int = runner.max_model_len
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._in_flight: set[str] = set()
        self._aborted_in_flight: set[str] = set()

    # ---- requests ----------------------------------------------------------
    def check_request(self, num_prompt: int, sampling: SamplingParams, num_output: int = 0) -> None:
        """Raise :class:`RequestError` if a request of this shape can never be served."""
        total = num_prompt + num_output
        if num_prompt < 1:
            raise RequestError("the prompt is empty")
        if total >= self.max_model_len:
            raise RequestError(f"the prompt has {total} tokens; the model's context is {self.max_model_len} tokens")
        pool = self.pages.num_pages * self.config.page_size
        if not self.scheduler.fits_ever(total):
            raise RequestError(f"the prompt has {total} tokens; the KV pool holds {pool}")
        longest = num_prompt + sampling.max_new_tokens
        if not self.scheduler.fits_ever(longest):
            raise RequestError(f"the request may need {longest} tokens of KV; the KV pool holds {pool}")

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        output_ids: list[int] | None = None,
        prefill_only: bool = False,
    ) -> Sequence:
        if rid in self.seqs or rid in self.held:
            raise RequestError(f"request {rid!r} is already in the engine")
        outputs = list(output_ids or [])
        self.check_request(len(prompt_ids), sampling, len(outputs))
        seq = Sequence(
            rid, list(prompt_ids), sampling, output_ids=outputs, num_resumed=len(outputs), prefill_only=prefill_only
        )
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return seq

    def reserve_import(
        self, rid: str, prompt_ids: list[int], output_ids: list[int], sampling: SamplingParams
    ) -> Sequence | None:
        """Pages for a request whose KV arrives by transfer, or ``None`` if the pool is short.

        The KV to arrive is that of every known token but the last: the prompt, and for a
        resumed request the output already streamed (``output_ids[:-1]``). The prefix
        already in this pool is reused: ``seq.num_cached`` tokens need no transfer. Follow
        with :meth:`commit_import` or :meth:`fail_import`.
        """
        self.check_request(len(prompt_ids), sampling, len(output_ids))
        seq = Sequence(rid, list(prompt_ids), sampling, output_ids=list(output_ids), num_resumed=len(output_ids))
        # The prompt's pages plus room to decode a page, and a watermark for the running batch.
        if not self.pages.reserve_prompt(seq, reserve=len(self.scheduler.running)):
            return None
        seq.status = Status.HELD
        self.seqs[rid] = seq
        return seq

    def commit_import(self, seq: Sequence) -> None:
        """The KV is in place: decode from the last known token on."""
        seq.num_computed = 0
        self.scheduler.on_computed(seq, seq.num_tokens - 1)
        if seq.output_ids:
            self.scheduler.start_running(seq)
        else:
            seq.status = Status.WAITING
            self.scheduler.add(seq)

    def fail_import(self, seq: Sequence) -> None:
        """Transfer failed: free the pages and compute the prompt here instead."""
        self.pages.release(seq)
        seq.status = Status.WAITING
        self.scheduler.add(seq)

    def abort(self, rid: str) -> bool:
        """Drop a request wherever it is; its pages are freed (after the step in flight)."""
        seq = self.seqs.get(rid) or self.held.get(rid)
        if seq is None:
            return False
        if rid in self._in_flight:
            self._aborted_in_flight.add(rid)
            return True
        self._drop(seq, "abort")
        return True

    def release(self, rid: str) -> bool:
        """Free a held prefill's pages (decode has pulled them, or they expired)."""
        seq = self.held.pop(rid, None)
        if seq is None:
            return False
        self.pages.release(seq)
        return True

    def _drop(self, seq: Sequence, reason: str) -> None:
        self.held.pop(seq.rid, None)
        self.seqs.pop(seq.rid, None)
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    # ---- stepping ----------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def schedule(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        self._in_flight = {s.rid for s in batch.decodes} | {s.rid for s, _ in batch.prefills}
        return batch

    def execute(self, batch: ScheduledBatch) -> ExecResult:
        """Forward pass and sampling. Touches only tensors; safe to run in a worker thread."""
        started = time.perf_counter()
        seqs, logits = self.runner.execute(batch)
        if logits is None:
            return ExecResult([], [], [], time.perf_counter() - started)
        rows = [SampleRequest(s.sampling, s.prompt_ids, s.output_ids) for s in seqs]
        sampled = self.sampler(logits, rows)
        return ExecResult(seqs, sampled.token_ids, sampled.logprobs, time.perf_counter() - started)

    def postprocess(self, batch: ScheduledBatch, result: ExecResult) -> list[RequestOutput]:
        self.stats.steps += 1
        self.stats.busy_seconds += result.seconds
        for seq in batch.decodes:
            self.scheduler.on_computed(seq, 1)
        for seq, n in batch.prefills:
            self.scheduler.on_computed(seq, n)
        outputs: list[RequestOutput] = []
        for seq, token, logprob in zip(result.seqs, result.token_ids, result.logprobs, strict=True):
            if seq.rid in self._aborted_in_flight:
                continue
            outputs.append(self._append(seq, token, logprob))
        for rid in self._aborted_in_flight:
            aborted = self.seqs.get(rid) or self.held.get(rid)
            if aborted is not None:
                self._drop(aborted, "abort")
        self._in_flight = set()
        self._aborted_in_flight = set()
        return outputs

    def fail(self, batch: ScheduledBatch) -> list[Sequence]:
        """The batch's forward pass raised: drop its requests (pages freed); returns them."""
        seqs = list(batch.decodes) + [s for s, _ in batch.prefills]
        self._in_flight = set()
        self._aborted_in_flight = set()
        for seq in seqs:
            self._drop(seq, "error")
        return seqs

    def step(self) -> list[RequestOutput]:
        batch = self.schedule()
        if batch.is_empty:
            self._in_flight = set()
            return []
        return self.postprocess(batch, self.execute(batch))

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        first = seq.status is Status.WAITING
        if first and seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
            self.stats.prompt_tokens += len(seq.prompt_ids)
            self.stats.cached_tokens += seq.num_cached
        seq.output_ids.append(token)
        self.stats.generated_tokens += 1
        reason, stop = self._check_stop(seq, token)
        out = RequestOutput(
            rid=seq.rid,
            index=len(seq.output_ids) - 1,
            token_ids=[token],
            logprobs=[logprob] if logprob is not None else None,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            cached_tokens=seq.num_cached,
        )
        if reason is not None:
            out.finish_reason, out.stop_reason = reason, stop
            seq.finish_reason, seq.stop_reason = reason, stop
            self._drop(seq, reason)
        elif first and seq.prefill_only:
            self.scheduler.remove(seq, keep_pages=True)
            self.seqs.pop(seq.rid, None)
            seq.status = Status.HELD
            self.held[seq.rid] = seq
            out.held = True
        elif first:
            self.scheduler.start_running(seq)
        return out

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str | None, str | int | None]:
        p = seq.sampling
        if token in p.stop_token_ids:
            return "stop", token
        if token in self.eos_token_ids and not p.ignore_eos:
            return "stop", None
        if p.stop and self.detokenize is not None:
            longest = max(len(s.encode()) for s in p.stop)
            tail = self.detokenize(seq.output_ids[-(longest + 2) :])
            for s in p.stop:
                if s in tail:
                    return "stop", s
        if len(seq.output_ids) >= p.max_new_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    # ---- introspection -----------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def held_pages(self, rid: str) -> tuple[list[int], int] | None:
        """A held request's pages and how many tokens of KV they hold (its prompt, and for a
        resumed request the output it was resumed with)."""
        seq = self.held.get(rid)
        if seq is None:
            return None
        return seq.page_table, seq.num_computed
