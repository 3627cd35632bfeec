"""What the engine hands out: a step's outputs per request (:class:`RequestOutput`), a step
queued on the device (:class:`Launched`) and its result (:class:`ExecResult`), the engine's
totals, the error for a request it cannot serve, and a step's sampled rows with its forks
(:func:`with_forks`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.engine.sampler import SamplerOutput
from pdserve.engine.sequence import ScheduledBatch, Sequence
from pdserve.schemas import PromptLogprobs, TokenLogprob

if TYPE_CHECKING:
    from pdserve.engine.speculative import SpecStats


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
    group: str = ""  # a sample of an n > 1 request: the request's id (``rid`` is the sample's)
    prompt_logprobs: PromptLogprobs | None = None  # on the first output, when the request asks for them


@dataclass
class VerifyResult:
    """One speculative verify's outcome: the tokens to append (the accepted draft tokens,
    then the corrected or bonus one), how many of the ``drafted`` were accepted, and the
    tokens' log-probabilities when the request asks for them."""

    seq: Sequence
    drafted: int
    tokens: list[int]
    accepted: int
    logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Launched:
    """A step whose forward pass and sampling are queued on the device."""

    batch: ScheduledBatch
    seqs: list[Sequence]  # the rows that get a token
    started: float
    tokens: torch.Tensor | None = None  # on the device
    copy: torch.Tensor | None = None  # pinned host copy, filled when ``done`` fires
    done: torch.cuda.Event | None = None
    host: SamplerOutput | None = None  # sampled on the host (log-probabilities asked)
    gpu_start: torch.cuda.Event | None = None  # when the device began it (``Engine.time_steps``)
    verified: list[VerifyResult] = field(default_factory=list)  # the batch's verifies, judged on the host


@dataclass
class ExecResult:
    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    seconds: float
    gpu_seconds: float | None = None  # the device's own time for the step (``Engine.time_steps``)
    gpu_period: float | None = None  # from the step before's end to this one's, on the device
    verified: list[VerifyResult] = field(default_factory=list)  # speculative verifies (``Launched.verified``)


@dataclass
class EngineStats:
    steps: int = 0
    batch_rows: int = 0  # sequences computed, summed over steps
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    busy_seconds: float = 0.0
    turn_wait_seconds: float = 0.0  # steps' waits for other workers' steps on shared cores
    overlapped_steps: int = 0  # steps left queued on the device while the next was launched
    history_unoverlapped_steps: int = 0  # decode steps not left queued: a row's sampling reads its history
    stop_regex_timeouts: int = 0  # a request's stop_regex given up, its search past STOP_REGEX_TIMEOUT
    grammar_refusals: int = 0  # sampled tokens a sequence's own grammar refused (0 unless a bug)
    scored_prompt_tokens: int = 0  # prompt tokens whose log-probabilities were asked for and computed
    spec: SpecStats | None = None  # speculative decoding's counters, when it is on


def with_forks(seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
    """The rows of a step with each ``n > 1`` request's first-token row repeated for its
    forks (each draws from the prompt's last logits with its own seed and matcher)."""
    rows: list[int] = []
    out: list[Sequence] = []
    for i, seq in enumerate(seqs):
        rows.append(i)
        out.append(seq)
        for fork in seq.forks:
            rows.append(i)
            out.append(fork)
    return out, logits[torch.tensor(rows, device=logits.device)]


class PrefillClock:
    """What prefill steps cost, for the KV tiers' recompute rate. On a GPU each step's own
    device time, between two events read once the device has passed them, in order (a chunk
    that samples no token returns before the device has run it: its host time is only its
    launch); elsewhere the step's time (the CPU computes it before the step returns)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._pending: deque[tuple[int, float, torch.cuda.Event, torch.cuda.Event]] = deque()

    @staticmethod
    def size(batch: ScheduledBatch) -> tuple[int, float]:
        """A step's prompt tokens and the (query, key) pairs their attention computes (a
        chunk of ``n`` after ``c`` computed tokens: ``n * (c + n / 2)``)."""
        tokens = sum(n for _, n in batch.prefills)
        return tokens, sum(n * (seq.num_computed + n / 2) for seq, n in batch.prefills)

    def begin(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def end(self, batch: ScheduledBatch, start: torch.cuda.Event | None) -> None:
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((*self.size(batch), start, end))

    def readings(self, batch: ScheduledBatch, seconds: float) -> list[tuple[int, float, float]]:
        """``(tokens, pairs, seconds)`` of the prefill steps timed by now: off a GPU this one's
        (``batch``, computed in ``seconds``; its sequences not yet advanced past it); on one,
        those whose events have fired."""
        if not self.cuda:
            tokens, pairs = self.size(batch)
            return [(tokens, pairs, seconds)] if tokens else []
        done = []
        while self._pending and self._pending[0][3].query():
            tokens, pairs, start, end = self._pending.popleft()
            done.append((tokens, pairs, start.elapsed_time(end) / 1e3))
        return done
