"""``TokenChunk``: tokens streamed back to whoever asked, on the request's reply subject."""

from __future__ import annotations

import dataclasses
import math

from pdserve.schemas.codec import Message


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An OpenAI-style error: ``type`` is e.g. ``invalid_request_error`` or ``server_error``."""

    message: str
    type: str = "server_error"
    code: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Finite values only (JSON has no infinity): impossible tokens get -9999.0."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.logprob) or not all(math.isfinite(v) for v in self.top_logprobs):
            raise ValueError("logprobs must be finite")


@dataclasses.dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The log-probabilities of a prompt's tokens from its second on (the first has nothing
    before it): ``logprobs[i]`` of prompt token ``i + 1`` given the tokens before it, and its
    ``ranks[i]`` among the vocabulary (1: the most likely). With ``k`` alternatives,
    ``top_ids`` and ``top_logprobs`` hold ``k`` entries per token, one token's after another's
    (flat: a long prompt's stay a small message). Finite values only, as :class:`TokenLogprob`."""

    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    k: int = 0
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.logprobs)
        if len(self.ranks) != n or len(self.top_ids) != n * self.k or len(self.top_logprobs) != n * self.k:
            raise ValueError("prompt logprobs: ranks and k alternatives per token expected")
        if not all(math.isfinite(v) for v in self.logprobs) or not all(math.isfinite(v) for v in self.top_logprobs):
            raise ValueError("logprobs must be finite")

    def top(self, i: int) -> list[tuple[int, float]]:
        """Token ``i``'s alternatives, most likely first."""
        k = self.k
        return list(zip(self.top_ids[i * k : (i + 1) * k], self.top_logprobs[i * k : (i + 1) * k], strict=True))


def prompt_logprobs_bytes(num_prompt: int, k: int) -> int:
    """At most the bytes a chunk with a ``num_prompt``-token prompt's log-probabilities takes
    (``k`` alternatives each; orjson's floats, 17 significant digits): it must fit one message."""
    return 4096 + (num_prompt - 1) * (32 + 34 * k)


# TokenChunk.state: what the sender says about the request besides its tokens.
ALIVE = "alive"  # no tokens: the sender holds the request and works on it
QUEUED = "queued"  # after this chunk the request waits in a queue (prefill's hand-off)
HANDED_BACK = "handed_back"  # no tokens: the sender gave the request back unfinished
STATES = ("", ALIVE, QUEUED, HANDED_BACK)
# ErrorInfo.code of a failure that says nothing about the request itself (an engine step
# failed for its whole batch): its API may resume the request elsewhere.
RETRYABLE = "retryable"


@dataclasses.dataclass(frozen=True, slots=True)
class TokenChunk(Message):
    """Consecutive tokens of one request. ``seq`` is the index of ``token_ids[0]`` in
    the output (for a chunk without tokens, of the next token), so a receiver sees
    duplicates and gaps. The last chunk has a ``finish_reason`` (``stop``, ``length``,
    ``abort``, ``error``) and ``usage``. ``timings`` carries named durations in seconds
    (queueing, transfer) for benchmarks. ``attempt`` is the request's; ``state`` one of
    :data:`STATES`: a worker holding a request sends an ``alive`` chunk at least every
    second while it has no tokens to send, so silence means trouble.
    """

    rid: str
    seq: int
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    error: ErrorInfo | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    worker_id: str = ""
    timings: dict[str, float] | None = None
    attempt: int = 0
    state: str = ""
    v: int = 1

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}")


@dataclasses.dataclass(frozen=True, slots=True)
class TokenBatch(Message):
    """Chunks of several requests for one receiver in one message: what an engine step
    produced for the requests that named the same ``batch_to`` subject (see
    :class:`GenerateRequest`). Each chunk means what it would mean alone."""

    chunks: tuple[TokenChunk, ...]
    v: int = 1
