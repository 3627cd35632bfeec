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

    Tensor parallelism: a prefill worker of ``tp_size`` ranks holds each page once per
    rank, rank ``r`` with KV heads ``[r * h, (r + 1) * h)`` where ``h`` is
    ``layout.num_kv_heads`` (the heads per rank). ``rank_endpoints[r]`` is rank ``r``'s
    transfer endpoint and ``rank_bases[r]`` the address of its pool's first page; the
    ``segments`` are rank 0's, and rank ``r``'s lie ``rank_bases[r] - rank_bases[0]`` bytes
    further. Both are empty for one rank (``endpoint`` is rank 0's).
    """

    backend: str
    endpoint: str
    layout: KVLayout
    segments: tuple[tuple[int, ...], ...]
    num_tokens: int
    expires_at: float
    protocol: str = ""
    generation: int = 0
    tp_size: int = 1
    rank_endpoints: tuple[str, ...] = ()
    rank_bases: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(len(s) != 2 or s[1] <= 0 for s in self.segments):
            raise ValueError("segments must be (address, nbytes) pairs")
        if self.tp_size < 1:
            raise ValueError("tp_size must be at least 1")
        if self.tp_size > 1 and not (len(self.rank_endpoints) == len(self.rank_bases) == self.tp_size):
            raise ValueError("a handle of several ranks names each rank's endpoint and pool base")

    @property
    def kv_heads_per_rank(self) -> int:
        return self.layout.num_kv_heads

    def rank_endpoint(self, rank: int) -> str:
        return self.rank_endpoints[rank] if self.rank_endpoints else self.endpoint

    def rank_offset(self, rank: int) -> int:
        """How far rank ``rank``'s copy of a page lies from rank 0's, in bytes."""
        return self.rank_bases[rank] - self.rank_bases[0] if self.rank_bases else 0


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
