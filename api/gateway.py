"""The API's side of NATS: publish requests, route token chunks back, cancel.

One wildcard subscription (``pd.tokens.<api-id>.*``) carries every reply; chunks are
routed by request id into per-request streams that put them back in ``seq`` order and
drop duplicates.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.js import JetStreamContext

from pdserve.broker import contract, streams
from pdserve.broker.connection import QueueFullError, connect
from pdserve.broker.registry import WorkerRegistry
from pdserve.schemas import Cancel, GenerateRequest, SamplingParams, TokenChunk, WorkerInfo

log = logging.getLogger(__name__)


class StreamError(RuntimeError):
    """The request failed in a worker or timed out; ``kind`` is an OpenAI error type."""

    def __init__(self, message: str, kind: str = "server_error") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class TokenStream:
    """Chunks of one request, in ``seq`` order, without duplicates."""

    rid: str
    next_seq: int = 0
    queue: asyncio.Queue[TokenChunk] = field(default_factory=asyncio.Queue)
    early: dict[int, TokenChunk] = field(default_factory=dict)
    duplicates: int = 0

    def deliver(self, chunk: TokenChunk) -> None:
        if chunk.error is not None:
            self.queue.put_nowait(chunk)
            return
        if chunk.seq < self.next_seq:
            self.duplicates += 1
            return
        if chunk.seq > self.next_seq:
            self.early[chunk.seq] = chunk
            return
        self._push(chunk)
        while self.next_seq in self.early:
            self._push(self.early.pop(self.next_seq))

    def _push(self, chunk: TokenChunk) -> None:
        self.queue.put_nowait(chunk)
        self.next_seq = chunk.seq + max(len(chunk.token_ids), 1 if chunk.finish_reason else 0)


class Gateway:
    def __init__(self, nats_url: str, model: str, broker: streams.BrokerConfig, api_id: str | None = None) -> None:
        self.nats_url = nats_url
        self.model = model
        self.broker = broker
        self.api_id = api_id or f"api-{uuid.uuid4().hex[:8]}"
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.registry: WorkerRegistry | None = None
        self.streams: dict[str, TokenStream] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.nc = await connect(self.nats_url, self.api_id)
        self.js = self.nc.jetstream()
        await streams.ensure_model(self.js, self.model, self.broker)
        self.registry = WorkerRegistry(await streams.worker_bucket(self.js, self.broker), self.js)
        await contract.subscribe(self.nc, contract.TOKENS, self._on_chunk, self.api_id)

    async def stop(self) -> None:
        for rid in list(self.streams):
            await self.cancel(rid, "server shutting down")
        if self.nc is not None and self.nc.is_connected:
            await self.nc.drain()

    async def _on_chunk(self, chunk: TokenChunk) -> None:
        stream = self.streams.get(chunk.rid)
        if stream is not None:
            stream.deliver(chunk)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        rid: str | None = None,
        timeout: float = 600.0,
        stall_timeout: float = 120.0,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Publish a request and yield its chunks until the one with a finish reason.

        Raises :class:`QueueFullError` before anything is published if the queue is
        full, :class:`StreamError` on a worker error or a timeout. Leaving early (the
        client went away) publishes ``Cancel``.
        """
        assert self.js is not None
        rid = rid or uuid.uuid4().hex
        if rid in self.streams:
            raise StreamError(f"request id {rid!r} is in use", "invalid_request_error")
        stream = TokenStream(rid)
        self.streams[rid] = stream
        now = time.time()
        request = GenerateRequest(
            rid=rid,
            model=self.model,
            prompt_ids=tuple(prompt_ids),
            reply_to=contract.TOKENS.subject(self.api_id, rid),
            sampling=sampling,
            deadline=now + timeout,
            published_at=now,
        )
        finished = False
        try:
            if not await contract.submit(self.js, contract.REQUESTS, request, self.model, rid):
                raise StreamError(f"request id {rid!r} was already submitted", "invalid_request_error")
            deadline = time.monotonic() + timeout
            while True:
                wait = min(stall_timeout, deadline - time.monotonic())
                if wait <= 0:
                    raise StreamError("request timed out", "timeout")
                try:
                    chunk = await asyncio.wait_for(stream.queue.get(), wait)
                except TimeoutError:
                    raise StreamError("no tokens arrived in time (workers busy or down)", "timeout") from None
                if chunk.error is not None:
                    finished = True
                    raise StreamError(chunk.error.message, chunk.error.type)
                if chunk.finish_reason is not None:
                    finished = True
                    self.streams.pop(rid, None)  # done before the caller stops iterating
                yield chunk
                if finished:
                    return
        finally:
            self.streams.pop(rid, None)
            if not finished:
                # A task of its own: this generator may be closing inside a cancelled
                # scope (client disconnect), where any await here would be cancelled too.
                task = asyncio.get_running_loop().create_task(self.cancel(rid, "client went away"))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def cancel(self, rid: str, reason: str) -> None:
        if self.nc is None or not self.nc.is_connected:
            return
        try:
            await contract.publish(self.nc, contract.CANCEL, Cancel(rid=rid, reason=reason))
        except Exception as exc:
            log.warning("could not publish cancel", extra={"rid": rid, "error": str(exc)})

    async def workers(self) -> list[WorkerInfo]:
        assert self.registry is not None
        return await self.registry.list()

    async def queue_depths(self) -> dict[str, streams.QueueDepth]:
        assert self.js is not None
        depths: dict[str, streams.QueueDepth] = {}
        for role, channel in (("prefill", contract.REQUESTS), ("decode", contract.KV_READY)):
            depths[role] = await streams.queue_depth(self.js, channel.stream, channel.consumer(self.model))
        return depths


__all__ = ["Gateway", "QueueFullError", "StreamError", "TokenStream"]
