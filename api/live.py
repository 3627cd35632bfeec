"""The gateway's record of a request in flight, and its totals (shared by the gateway's
parts: :mod:`.gateway`, :mod:`.placing`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry import context as otel_context

from pdserve.api.token_stream import TokenStream
from pdserve.schemas import GenerateRequest


@dataclass
class GatewayStats:
    """Totals since the API started (``/health`` shows them)."""

    requests: int = 0
    migrations: int = 0
    migration_failures: int = 0
    duplicate_chunks: int = 0
    stale_chunks: int = 0
    dead_letters: int = 0
    placement_fallbacks: int = 0
    chunk_messages: int = 0  # token chunks that came one per message (reply_to)
    batches: int = 0  # TokenBatch messages (batch_to), and the chunks they carried
    batched_chunks: int = 0


@dataclass
class Live:
    """A request in flight: what to resubmit it with, and its stream of chunks."""

    request: GenerateRequest
    stream: TokenStream
    trace: otel_context.Context | None = None  # the request's span, for its resubmissions
    migrating: bool = False
    recancelled_at: float = 0.0
    deadline: float = float("inf")  # monotonic; the watch ends the stream past it
    timed_out: bool = False
    reasons: list[str] = field(default_factory=list)
    taken: bool = False  # a worker sent a chunk of it
    placed_seq: int = 0  # its placed copy in the request stream (prefix-aware placement)
    caller: int = -1  # the API key it came with (access.CALLER; -1: no keys configured)
    group: str = ""  # a sample of an n > 1 request: the request's id
