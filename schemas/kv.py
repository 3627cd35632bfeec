"""KV hand-off between prefill and decode: ``KVReady`` and ``KVRelease``.

Only handles travel over NATS; the bytes move over the transfer backend.
"""

from __future__ import annotations

import dataclasses

from pdserve.schemas.codec import Message
from pdserve.schemas.sampling import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one page in the pool; ``order`` names its dimensions, outermost first."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    order: str = "layer,kv,head,token,dim"

    @property
    def page_numel(self) -> int:
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim

    def describe(self) -> str:
        return (
            f"page size {self.page_size}, {self.dtype}, {self.num_layers} layers, "
            f"{self.num_kv_heads} KV heads of {self.head_dim}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class KVHandle:
    """Where a request's KV lives: contiguous runs of pages in a registered pool.

    ``segments`` are ``(address, nbytes)`` pairs in page order; together they hold
    ``num_tokens`` tokens, ``page_size`` per page. ``expires_at`` is the Unix time after
    which the owner may reuse the pages. ``protocol`` is the backend's transport (Mooncake:
    ``tcp`` or ``rdma``); both ends must use the same. ``generation`` names this one hold
    of the pages: a reader leases it (:class:`KVLease`) before reading, and a handle whose
    hold has ended (released, cancelled, expired) is refused, so a stale handle never
    reads pages that were freed and reused.
    """

    backend: str
    endpoint: str
    layout: KVLayout
    segments: tuple[tuple[int, ...], ...]
    num_tokens: int
    expires_at: float
    protocol: str = ""
    generation: int = 0

    def __post_init__(self) -> None:
        if any(len(s) != 2 or s[1] <= 0 for s in self.segments):
            raise ValueError("segments must be (address, nbytes) pairs")


@dataclasses.dataclass(frozen=True, slots=True)
class KVReady(Message):
    """Prefill is done: the first token is out, the KV waits at ``handle``. ``attempt`` and
    ``batch_to`` are the request's (see :class:`GenerateRequest`).

    For a request of ``sampling.n > 1`` the handle holds the prompt's KV once, and the
    samples still going after their first token are ``samples`` (their indices) with
    ``first_ids`` (each one's first token); ``output_ids`` is then empty. The decode
    worker pulls the KV once and decodes every sample on shared pages."""

    rid: str
    model: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    reply_to: str
    sampling: SamplingParams
    prefill_id: str
    handle: KVHandle
    cached_tokens: int = 0
    deadline: float = 0.0
    published_at: float = 0.0
    request_published_at: float = 0.0
    timings: dict[str, float] | None = None
    attempt: int = 0
    batch_to: str = ""
    samples: tuple[int, ...] = ()
    first_ids: tuple[int, ...] = ()
    v: int = 1

    def __post_init__(self) -> None:
        if len(self.samples) != len(self.first_ids):
            raise ValueError("samples and first_ids must have the same length")
        if self.samples and self.output_ids:
            raise ValueError("a request of several samples carries no output_ids")

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV the handle must hold: every known token but the last."""
        return len(self.prompt_ids) + (len(self.output_ids) - 1 if not self.samples else 0)


@dataclasses.dataclass(frozen=True, slots=True)
class KVRelease(Message):
    """Decode tells the prefill worker that it may free the request's pages: those of hold
    ``generation`` (0: whichever hold it has)."""

    rid: str
    prefill_id: str
    ok: bool = True
    generation: int = 0
    v: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class KVLease(Message):
    """Decode asks the prefill worker to keep hold ``generation`` of ``rid`` for at least
    ``seconds`` while it reads; answered with :class:`KVLeaseReply`."""

    rid: str
    prefill_id: str
    generation: int
    seconds: float
    v: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class KVLeaseReply(Message):
    """``granted``: the pages stay held for the lease; else ``reason`` says why not."""

    rid: str
    granted: bool
    reason: str = ""
    v: int = 1
