"""Sending results: token chunks and errors to a request's reply subject, and the
acknowledgement that settles the request's JetStream delivery."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

from nats.aio.client import Client
from opentelemetry.context import Context

from pdserve.broker import contract
from pdserve.broker.consumer import Delivery
from pdserve.engine.outputs import RequestOutput
from pdserve.schemas import ErrorInfo, TokenBatch, TokenChunk, Usage
from pdserve.schemas.tokens import QUEUED

log = logging.getLogger(__name__)

BATCH_CHUNKS = 256  # chunks per TokenBatch: well under NATS's 1 MB payload even with logprobs


@dataclass
class Tracked:
    """A request this worker is working on, where its tokens go, and the delivery to settle.

    ``attempt`` and ``published_at`` identify which submission of ``rid`` this is (see
    ``Cancel``); ``next_seq`` is the output index of the next token this worker sends and
    ``sent_at`` when it last sent anything, for the keep-alive chunks. ``trace`` is the
    trace context the work message carried (``None`` with tracing off); ``received_at``
    and ``decode_from`` (Unix times) start its ``prefill`` and ``decode`` spans."""

    rid: str
    reply_to: str
    delivery: Delivery | None
    deadline: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    acked: bool = False
    progress_at: float = field(default_factory=time.monotonic)
    attempt: int = 0
    published_at: float = 0.0
    next_seq: int = 0
    sent_at: float = 0.0
    batch_to: str = ""
    trace: Context | None = None
    received_at: float = 0.0
    decode_from: float = 0.0
    # The prompt tokens the prefill worker found in its prefix cache, once its KV was pulled:
    # what the request's usage reports as cached (the decode worker's own reuse of pages it
    # holds saves a transfer, not a computation). ``None``: the engine's own count.
    prompt_cached: int | None = None
    # A request of n > 1 samples: the samples still open (``rid#i``), and the next index of
    # each (its chunks number its own tokens). Empty for a request of one sample.
    samples: list[str] = field(default_factory=list)
    sample_seq: dict[str, int] = field(default_factory=dict)

    @property
    def rids(self) -> list[str]:
        """The ids this request's chunks go out under: its samples', or its own."""
        return list(self.samples) or [self.rid]

    def seq_of(self, rid: str) -> int:
        return self.sample_seq.get(rid, 0) if self.samples else self.next_seq

    async def settle(self, ok: bool = True) -> None:
        """Ack (done) or terminate (failed for good) the delivery; once."""
        if self.delivery is None or self.acked:
            return
        self.acked = True
        try:
            if ok:
                await self.delivery.ack()
            else:
                await self.delivery.term()
        except Exception as exc:
            log.warning("ack failed", extra={"rid": self.rid, "error": str(exc)})

    async def hand_back(self, delay: float | None = None) -> None:
        """Nak an unsettled delivery: the stream redelivers it, here or to another worker."""
        if self.delivery is None or self.acked:
            return
        self.acked = True
        with contextlib.suppress(Exception):
            await self.delivery.nak(delay=delay)

    async def keep_alive(self, now: float, every: float) -> None:
        """Tell the stream an unsettled delivery is still being worked on, at most once per ``every``."""
        if self.delivery is None or self.acked or now - self.progress_at <= every:
            return
        self.progress_at = now
        with contextlib.suppress(Exception):
            await self.delivery.in_progress()


class Replies:
    """Publishes ``TokenChunk``s for one worker. A reply that cannot be published is
    logged: a bad reply subject must not take the worker down."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._nc: Client | None = None

    def connect(self, nc: Client) -> None:
        self._nc = nc

    async def send(self, reply_to: str, chunk: TokenChunk, tracked: Tracked | None = None) -> None:
        """Publish ``chunk``; with ``tracked``, note what was sent (for keep-alives)."""
        assert self._nc is not None, "connect() first"
        if tracked is not None:
            _note_sent(tracked, chunk, time.monotonic())
        try:
            await contract.publish(self._nc, contract.TOKENS, chunk, to=reply_to)
        except Exception as exc:
            log.warning("could not publish tokens", extra={"rid": chunk.rid, "error": str(exc)})

    async def send_step(self, sent: list[tuple[Tracked, TokenChunk]]) -> None:
        """One step's chunks: those whose request names a ``batch_to`` go there in one
        ``TokenBatch`` per subject (at most ``BATCH_CHUNKS`` chunks each), the rest (and a chunk
        with a prompt's log-probabilities, which can be large) one message each to their
        ``reply_to``."""
        assert self._nc is not None, "connect() first"
        batches: dict[str, list[TokenChunk]] = {}
        now = time.monotonic()
        for t, chunk in sent:
            if not t.batch_to or chunk.prompt_logprobs is not None:  # a prompt's scores: a message of its own
                await self.send(t.reply_to, chunk, t)
                continue
            _note_sent(t, chunk, now)
            batches.setdefault(t.batch_to, []).append(chunk)
        for to, chunks in batches.items():
            for start in range(0, len(chunks), BATCH_CHUNKS):
                batch = TokenBatch(tuple(chunks[start : start + BATCH_CHUNKS]))
                try:
                    await contract.publish(self._nc, contract.TOKEN_BATCHES, batch, to=to)
                except Exception as exc:
                    log.warning("could not publish tokens", extra={"to": to, "error": str(exc)})

    async def error(
        self,
        reply_to: str,
        rid: str,
        seq: int,
        message: str,
        kind: str = "server_error",
        attempt: int = 0,
        code: str | None = None,
    ) -> None:
        """The last chunk of a failed request: ``finish_reason="error"`` and why."""
        chunk = TokenChunk(
            rid=rid,
            seq=seq,
            finish_reason="error",
            error=ErrorInfo(message, kind, code),
            worker_id=self.worker_id,
            attempt=attempt,
        )
        await self.send(reply_to, chunk)

    async def state(self, t: Tracked, state: str) -> None:
        """A chunk without tokens saying ``state`` (``alive``, ``handed_back``) about ``t``
        (about each of its open samples)."""
        for rid in t.rids:
            chunk = TokenChunk(rid=rid, seq=t.seq_of(rid), worker_id=self.worker_id, attempt=t.attempt, state=state)
            await self.send(t.reply_to, chunk, t)

    async def fail(self, t: Tracked, message: str, kind: str = "server_error", code: str | None = None) -> None:
        """The last chunk of ``t`` (of each of its open samples): an error."""
        for rid in t.rids:
            await self.error(t.reply_to, rid, t.seq_of(rid), message, kind, t.attempt, code)

    def chunk(self, out: RequestOutput, tracked: Tracked | None) -> TokenChunk:
        """One engine step's output for a request; usage and timings ride on its last chunk
        (and timings on a prefill worker's hand-off chunk, which says the request now waits
        in the KV queue)."""
        usage = None
        timings = None
        if out.finish_reason is not None or out.held:
            cached = tracked.prompt_cached if tracked and tracked.prompt_cached is not None else out.cached_tokens
            usage = Usage(out.prompt_tokens, out.completion_tokens, cached)
            timings = tracked.timings if tracked else None
        return TokenChunk(
            rid=out.rid,
            seq=out.index,
            token_ids=tuple(out.token_ids),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            usage=usage if out.finish_reason is not None else None,
            logprobs=tuple(out.logprobs) if out.logprobs else None,
            prompt_logprobs=out.prompt_logprobs,
            worker_id=self.worker_id,
            timings=timings,
            attempt=tracked.attempt if tracked else 0,
            state=QUEUED if out.held else "",
        )


def _note_sent(t: Tracked, chunk: TokenChunk, now: float) -> None:
    """What ``t``'s keep-alives need: when something last went out, and the next index."""
    t.sent_at = now
    if chunk.rid != t.rid:  # a sample's
        t.sample_seq[chunk.rid] = max(t.sample_seq.get(chunk.rid, 0), chunk.seq + len(chunk.token_ids))
    else:
        t.next_seq = max(t.next_seq, chunk.seq + len(chunk.token_ids))
