"""A request inside the engine: its tokens, its pages, how far its KV is computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.schemas import PromptLogprobs, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # needs (more) prefill
    RUNNING = "running"  # decoding
    HELD = "held"  # prefill done, KV held for a decode worker (prefill role)
    FINISHED = "finished"


@dataclass
class Sequence:
    """Token state of one request. ``tokens`` = prompt + generated output.

    Invariant: the KV of ``tokens[:num_computed]`` is in ``page_table``'s pages.
    ``tokens`` holds the known tokens; a step in flight may have sampled one more
    (``num_pending``), which counts in ``num_tokens``.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    stop_regex_off: set[str] = field(default_factory=set)  # its stop_regex patterns given up (too slow)
    num_computed: int = 0
    num_cached: int = 0
    num_registered_pages: int = 0
    num_offered_pages: int = 0  # full pages the KV tiers were offered while the step computing them ran
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prefill_only: bool = False
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    num_preemptions: int = 0
    page_hashes: list[bytes] = field(default_factory=list)
    num_resumed: int = 0  # output tokens already streamed before this engine saw the request
    num_pending: int = 0  # tokens sampled on the device but not yet appended (0 or 1)
    # A sample of an ``n > 1`` request: ``group`` is the request's id, ``reply_rid`` the id its
    # outputs carry (``rid#i``); ``forks`` are the other samples, which branch off this one's
    # pages at the first token (``forked`` marks them).
    group: str = ""
    reply_rid: str = ""
    forks: list[Sequence] = field(default_factory=list)
    forked: bool = False
    matcher: Any = None  # structured output: the grammar matcher (engine.grammar.Matcher)
    spec: Any = None  # speculative decoding: its n-gram index and record (engine.speculative.SpecState)
    # A part of its cached prefix loading from a KV tier while the part before it is computed
    # (engine.page_manager.TailLoad): its prefill stops where that load begins until it is done.
    tail_load: Any = None
    # The prompt's own tokens scored as its prefill computes them (sampling.prompt_logprobs):
    # ``None`` when not asked for (or for a request resumed or imported with its KV).
    prompt_scores: PromptScores | None = None
    # An ``n > 1`` request's scores, one cell its samples share: the head scores the prompt and
    # puts them there at its first token, each sample's first output carries them.
    shared_scores: list[PromptLogprobs | None] | None = None

    @property
    def out_rid(self) -> str:
        """The request id this sequence's tokens go out under."""
        return self.reply_rid or self.rid

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def num_tokens(self) -> int:
        """Tokens including a pending one (its value is still on the device)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_outputs(self) -> int:
        return len(self.output_ids) + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def last_token(self) -> int:
        """The newest known token (a pending one is fed to the next step on the device)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]


@dataclass
class PromptScores:
    """A prompt's token log-probabilities so far: entry ``i`` is prompt token ``i + 1``'s
    (see :class:`~pdserve.schemas.PromptLogprobs`), in the order its prefill computes them."""

    k: int
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    @property
    def num(self) -> int:
        """Prompt positions scored: rows ``0 .. num - 1`` (row ``p`` scores token ``p + 1``)."""
        return len(self.logprobs)

    def wire(self) -> PromptLogprobs:
        return PromptLogprobs(
            tuple(self.logprobs), tuple(self.ranks), self.k, tuple(self.top_ids), tuple(self.top_logprobs)
        )


def scored_rows(prefills: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, int]]:
    """The prefill rows whose logits score their prompt's next token: ``(seq, first position,
    count)`` per chunk of a sequence that asks for prompt log-probabilities, past the rows
    it has scored already (a recompute after preemption) and short of the prompt's last row
    (that one draws the first output token)."""
    out = []
    for seq, n in prefills:
        scores = seq.prompt_scores
        if scores is None:
            continue
        start = max(seq.num_computed, scores.num)
        end = min(seq.num_computed + n, len(seq.prompt_ids) - 1)
        if end > start:
            out.append((seq, start, end - start))
    return out


@dataclass
class ScheduledBatch:
    """One step's work: decode sequences (1 token each), prefill chunks, and verifies:
    decoding sequences with a speculative draft, each computed as its last token and the
    draft (``len(draft) + 1`` tokens, logits at every one)."""

    decodes: list[Sequence]
    prefills: list[tuple[Sequence, int]]
    serial: int = 0  # the engine's count of scheduled steps (orders what a step may still write)
    verifies: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    held: bool = False  # left queued on the device while the next step was scheduled (overlap)
    # Prefill rows that score their prompt (:func:`scored_rows`): their logits come after every
    # other row's (``ModelRunner.execute``).
    scored: list[tuple[Sequence, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills) + sum(len(d) + 1 for _, d in self.verifies)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies

    @property
    def rids(self) -> set[str]:
        return {s.rid for s in self.decodes} | {s.rid for s, _ in self.prefills} | {s.rid for s, _ in self.verifies}
