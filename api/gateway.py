"""The API's side of NATS: publish requests, route token chunks back, move a request to
another worker when its worker is lost, cancel.

One wildcard subscription (``pd.tokens.<api-id>.*``) carries every reply; chunks are
routed by request id into per-request :class:`TokenStream`\\ s that put them back in
``seq`` order, drop duplicates, and say when a request must migrate (see
:mod:`.token_stream` for the rule). A watch task notices gaps and silent workers. A
migration cancels the earlier attempts and publishes attempt ``n + 1`` with the tokens
the client already has; after ``max_migrations`` the client gets an error instead.
While the connection to NATS is down nothing is judged silent, and every stream gets a
fresh ``stall_timeout`` once it is back. Placement (a request's first attempt; migrations
always take the request stream) is :mod:`.placing`'s part, registry and queue reads :mod:`.cluster`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from opentelemetry import context as otel_context
from opentelemetry import trace

from pdserve.api import access
from pdserve.api.live import GatewayStats, Live
from pdserve.api.metrics import ApiMetrics
from pdserve.api.placement import Load, PlacementConfig
from pdserve.api.placing import RESUBMIT_RETRY_SECONDS, Placing
from pdserve.api.prefix_index import PrefixIndex
from pdserve.api.token_stream import TokenStream
from pdserve.broker import contract, queues, streams, tracing
from pdserve.broker.auth import NatsAuth
from pdserve.broker.claims import Claims
from pdserve.broker.connection import QueueFullError, connect, end_tasks
from pdserve.broker.deadletter import watch_dead_letters
from pdserve.broker.registry import WorkerRegistry
from pdserve.schemas import (
    Cancel,
    ErrorInfo,
    GenerateRequest,
    SamplingParams,
    TokenBatch,
    TokenChunk,
    Usage,
)
from pdserve.schemas.sampling import sample_rid

log = logging.getLogger(__name__)

WATCH_SECONDS = 0.2
RECANCEL_SECONDS = 1.0


class StreamError(RuntimeError):
    """The request failed in a worker or timed out; ``kind`` is an OpenAI error type."""

    def __init__(self, message: str, kind: str = "server_error") -> None:
        super().__init__(message)
        self.kind = kind


class DuplicateRequestError(StreamError):
    """The request id is in use, or was submitted within the broker's dedup window (409)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "conflict")


class Gateway(Placing):
    def __init__(
        self,
        nats_url: str,
        model: str,
        broker: streams.BrokerConfig,
        api_id: str | None = None,
        stall_timeout: float = 10.0,
        gap_timeout: float = 1.0,
        max_migrations: int = 3,
        nats_auth: NatsAuth | None = None,
        placement: PlacementConfig | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.nats_auth = nats_auth
        self.model = model
        self.broker = broker
        self.api_id = api_id or f"api-{uuid.uuid4().hex[:8]}"
        self.stall_timeout = stall_timeout
        self.gap_timeout = gap_timeout
        self.max_migrations = max_migrations
        self.placement = placement or PlacementConfig()
        self.load = Load()  # read every placement.refresh_seconds while placement decides
        self.index = PrefixIndex(self.placement.index_max_hashes)
        self.claims: Claims | None = None
        self.placeable: set[str] = set()  # live prefill and unified workers of the model
        self.decoders: set[str] = set()
        self.busy: dict[str, int] = {}  # requests each worker holds, at its last heartbeat
        self.cold_pages: dict[str, int] = {}  # pages of prefixes sent to a worker, not yet announced
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.registry: WorkerRegistry | None = None
        self.live: dict[str, Live] = {}
        self.stats = GatewayStats()
        self.metrics = ApiMetrics(lambda: dataclasses.asdict(self.stats), self.in_flight)
        self._background: set[asyncio.Task[None]] = set()
        self._was_connected = True
        self._tokens: Subscription | None = None
        self._batches: Subscription | None = None

    async def start(self) -> None:
        self.nc = await connect(self.nats_url, self.api_id, self.nats_auth)
        self.js = self.nc.jetstream()
        await streams.ensure_model(self.js, self.model, self.broker)
        self.registry = WorkerRegistry(await streams.worker_bucket(self.js, self.broker), self.js)
        self._tokens = await contract.subscribe(self.nc, contract.TOKENS, self._on_chunk_message, self.api_id)
        self._batches = await contract.subscribe(self.nc, contract.TOKEN_BATCHES, self._on_batch, self.api_id)
        await watch_dead_letters(self.nc, self.js, self.model, self._on_dead_letter)
        self._spawn(self._watch())
        if self.placement.prefix_aware:
            self.claims = Claims(await streams.claim_bucket(self.js, self.broker))
            await contract.subscribe(self.nc, contract.KV_EVENTS, self._on_kv_events, self.model)
        if self.placement.conditional_disagg or self.placement.prefix_aware:
            self._spawn(self._read_load())

    async def _on_dead_letter(self, rid: str) -> None:
        self.stats.dead_letters += 1

    async def stop(self) -> None:
        for rid in list(self.live):
            await self.cancel(rid, "server shutting down")
        await end_tasks(list(self._background), 5.0)
        if self.nc is not None and self.nc.is_connected:
            await self.nc.drain()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- chunks in -------------------------------------------------------------------
    async def _on_chunk(self, chunk: TokenChunk) -> None:
        live = self.live.get(chunk.rid)
        if live is None:
            return
        live.taken = True
        stream = live.stream
        duplicates = stream.duplicates
        reason = stream.deliver(chunk, time.monotonic())
        self.stats.duplicate_chunks += stream.duplicates - duplicates
        if chunk.attempt != stream.attempt:
            self.stats.stale_chunks += 1
            await self._recancel(live)
        if reason is not None:
            self.migrate(live, reason)

    async def _on_chunk_message(self, chunk: TokenChunk) -> None:
        self.stats.chunk_messages += 1
        await self._on_chunk(chunk)

    async def _on_batch(self, batch: TokenBatch) -> None:
        self.stats.batches += 1
        self.stats.batched_chunks += len(batch.chunks)
        for chunk in batch.chunks:
            await self._on_chunk(chunk)

    async def _recancel(self, live: Live) -> None:
        """A worker still runs an earlier attempt (it missed the cancel): tell it again."""
        now = time.monotonic()
        if now - live.recancelled_at < RECANCEL_SECONDS:
            return
        live.recancelled_at = now
        rid, attempt = live.request.rid, live.stream.attempt
        await self._publish_cancel(Cancel(rid=rid, reason="superseded", attempt=attempt, issued_at=time.time()))

    async def _watch(self) -> None:
        """Gaps and silent workers, every ``WATCH_SECONDS``; a failed round is logged and
        the watch goes on (a dead watch would leave every stream to wait for its deadline)."""
        expected = time.monotonic() + WATCH_SECONDS
        while True:
            await asyncio.sleep(max(expected - time.monotonic(), 0.0))
            now = time.monotonic()
            late = now - expected > WATCH_SECONDS
            expected = now + WATCH_SECONDS
            try:
                self._judge(now, late)
            except Exception:
                log.exception("stream watch failed; it goes on")

    def _judge(self, now: float, late: bool) -> None:
        """No judgement while the broker is away, nor while this API is behind (its watch
        woke late, or chunks wait unhandled): the silence would be its own. Then every
        stream gets a fresh ``stall_timeout``."""
        for live in self.live.values():
            if now > live.deadline and not live.timed_out:
                live.timed_out = True
                live.stream.queue.put_nowait(self._error(live, "request timed out", "timeout"))
        connected = self.nc is not None and self.nc.is_connected
        behind = late or any(sub is not None and sub.pending_msgs > 0 for sub in (self._tokens, self._batches))
        if not connected or not self._was_connected or behind:
            for live in self.live.values():
                live.stream.heard_at = max(live.stream.heard_at, now - WATCH_SECONDS)
                if live.stream.gap_since is not None:
                    live.stream.gap_since = max(live.stream.gap_since, now - WATCH_SECONDS)
            self._was_connected = connected
            return
        for live in list(self.live.values()):
            if live.migrating:
                continue
            reason = live.stream.expired(now, self.stall_timeout, self.gap_timeout)
            if reason is not None:
                self.migrate(live, reason)

    # ---- migration -------------------------------------------------------------------
    def migrate(self, live: Live, reason: str) -> None:
        """Start the next attempt of ``live`` from the tokens its client has (in the
        background), or fail it once it has migrated ``max_migrations`` times."""
        if live.migrating or self.live.get(live.request.rid) is not live:
            return
        live.reasons.append(reason)
        live.migrating = True  # until the next attempt is out (for good, once it cannot be)
        stream = live.stream
        if stream.attempt >= self.max_migrations:
            message = f"request lost its worker {stream.attempt + 1} times; giving up (last: {reason})"
            log.error("request not migrated again", extra={"rid": live.request.rid, "reason": reason})
            self.stats.migration_failures += 1
            stream.queue.put_nowait(self._error(live, message))
            return
        self._spawn(self._migrate(live, reason))

    async def _migrate(self, live: Live, reason: str) -> None:
        stream = live.stream
        rid = live.request.rid
        attempt = stream.attempt + 1
        stream.restart(attempt, time.monotonic())
        self.stats.migrations += 1
        output = tuple(stream.output_ids)
        log.warning("request migrates", extra={"rid": rid, "attempt": attempt, "tokens": len(output), "reason": reason})
        try:
            if len(output) >= live.request.sampling.max_new_tokens:  # only its last chunk was lost
                stream.queue.put_nowait(self._finished(live, output))
                return
            now = time.time()
            await self._publish_cancel(Cancel(rid=rid, reason="superseded", attempt=attempt, issued_at=now))
            request = GenerateRequest(
                rid=rid,
                model=live.request.model,
                prompt_ids=live.request.prompt_ids,
                reply_to=live.request.reply_to,
                sampling=live.request.sampling,
                output_ids=output,
                deadline=live.request.deadline,
                published_at=now,
                attempt=attempt,
            )
            await self._resubmit(live, request)
        finally:
            live.migrating = False

    async def _resubmit(self, live: Live, request: GenerateRequest) -> None:
        """Publish ``request`` until the broker takes it (it may be away or full for a
        while), or the request's deadline passes, or its client leaves."""
        assert self.nc is not None
        while self.live.get(request.rid) is live:
            try:
                channel = contract.request_channel(request)
                await queues.submit(
                    self.nc, channel, request, self.model, request.rid, request.attempt, trace=live.trace
                )
                return
            except Exception as exc:
                if time.time() > request.deadline:
                    live.stream.queue.put_nowait(self._error(live, f"could not resubmit the request: {exc}"))
                    return
                log.warning("resubmission failed; retrying", extra={"rid": request.rid, "error": str(exc)})
                await asyncio.sleep(RESUBMIT_RETRY_SECONDS)

    def _error(self, live: Live, message: str, kind: str = "server_error") -> TokenChunk:
        stream = live.stream
        return TokenChunk(
            rid=live.request.rid,
            seq=stream.next_seq,
            finish_reason="error",
            error=ErrorInfo(message, kind),
            attempt=stream.attempt,
        )

    def _finished(self, live: Live, output: tuple[int, ...]) -> TokenChunk:
        usage = Usage(len(live.request.prompt_ids), len(output))
        return TokenChunk(
            rid=live.request.rid,
            seq=live.stream.next_seq,
            finish_reason="length",
            usage=usage,
            attempt=live.stream.attempt,
        )

    # ---- requests out ----------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, rid: str | None = None, timeout: float = 600.0
    ) -> AsyncGenerator[TokenChunk, None]:
        """Publish a request and yield its chunks until the one with a finish reason.

        Raises :class:`QueueFullError` before anything is published if the queue is
        full, :class:`DuplicateRequestError` for a request id in use or seen within the
        dedup window, :class:`StreamError` on a worker error, a timeout, or too many
        migrations. Leaving early (the client went away) publishes ``Cancel``.
        """
        rid = rid or uuid.uuid4().hex
        request = self._request(rid, prompt_ids, sampling, timeout)
        live = self._register([request])[0]
        published = await self._submit(request, [live])
        async for chunk in self._follow(live, published, timeout):
            yield chunk

    async def generate_samples(
        self, prompt_ids: list[int], sampling: SamplingParams, rid: str, timeout: float = 600.0
    ) -> list[AsyncGenerator[TokenChunk, None]]:
        """Publish one request of ``sampling.n`` samples (one prefill, its KV shared) and
        return each sample's chunks (``rid#i``). Each sample is followed, migrated and
        cancelled on its own, as the request of one sample it stands for (``n`` 1, ``seed
        + i``). Raises as :meth:`generate` before anything is published."""
        group = self._request(rid, prompt_ids, sampling, timeout)
        singles = [
            dataclasses.replace(
                group,
                rid=sample_rid(rid, i),
                reply_to=contract.TOKENS.subject(self.api_id, sample_rid(rid, i)),
                sampling=sampling.for_sample(i),
            )
            for i in range(sampling.n)
        ]
        lives = self._register(singles, rid)
        published = await self._submit(group, lives)
        return [self._follow(live, published, timeout) for live in lives]

    def _request(self, rid: str, prompt_ids: list[int], sampling: SamplingParams, timeout: float) -> GenerateRequest:
        now = time.time()
        return GenerateRequest(
            rid=rid,
            model=self.model,
            prompt_ids=tuple(prompt_ids),
            reply_to=contract.TOKENS.subject(self.api_id, rid),
            batch_to=contract.TOKEN_BATCHES.subject(self.api_id),
            sampling=sampling,
            deadline=now + timeout,
            published_at=now,
        )

    def _register(self, requests: list[GenerateRequest], group: str = "") -> list[Live]:
        """A stream per request id, or :class:`DuplicateRequestError` if one is in use
        (``group``: the request id of samples)."""
        for request in requests:
            if request.rid in self.live:
                raise DuplicateRequestError(f"request id {request.rid!r} is in use")
        caller = access.CALLER.get()
        lives = [
            Live(request, TokenStream(request.rid, heard_at=time.monotonic()), caller=caller, group=group)
            for request in requests
        ]
        for live in lives:
            if tracing.is_on():
                live.trace = otel_context.get_current()
            self.live[live.request.rid] = live
        self.stats.requests += 1
        return lives

    async def _submit(self, request: GenerateRequest, lives: list[Live]) -> float:
        """Publish ``request`` for the streams ``lives``; when it fails nothing of it runs:
        the streams are dropped and the error raised."""
        assert self.nc is not None
        try:
            target = self._prefix_target(request) if len(lives) == 1 else None
            if target is not None:
                fresh = await self._place(lives[0], target)
            else:
                channel = self._channel(request)
                fresh = await queues.submit(self.nc, channel, request, self.model, request.rid, trace=lives[0].trace)
        except BaseException:
            self._unregister(lives, "rejected")
            raise
        if not fresh:
            self._unregister(lives, "rejected")
            raise DuplicateRequestError(
                f"request id {request.rid!r} was submitted within the last {self.broker.dedup_window:.0f}s"
            )
        return time.monotonic()

    def _unregister(self, lives: list[Live], outcome: str) -> None:
        for live in lives:
            if self.live.get(live.request.rid) is live:
                del self.live[live.request.rid]
            self.metrics.finished(outcome, None)

    async def _follow(self, live: Live, published: float, timeout: float) -> AsyncGenerator[TokenChunk, None]:
        """The chunks of a submitted request, in order, until its last."""
        rid = live.request.rid
        finished = False
        outcome, last = "cancelled", 0.0
        live.deadline = published + timeout
        try:
            while True:
                # Everything queued, merged (no wait while behind). No timer per wait: the
                # watch puts a timeout error in the queue once the deadline has passed.
                chunk = live.stream.take() or live.stream.take(await live.stream.queue.get())
                assert chunk is not None
                if chunk.token_ids:
                    now = time.monotonic()
                    self.metrics.tokens(now - (last or published), len(chunk.token_ids), first=not last)
                    last = now
                if chunk.error is not None:
                    finished = True
                    outcome = "timeout" if chunk.error.type == "timeout" else "error"
                    raise StreamError(chunk.error.message, chunk.error.type)
                if chunk.finish_reason is not None:
                    finished = True
                    outcome = chunk.finish_reason if chunk.finish_reason in ("stop", "length") else "cancelled"
                    self.live.pop(rid, None)  # done before the caller stops iterating
                    if live.trace is not None:
                        _annotate(live, chunk)
                yield chunk
                if finished:
                    return
        finally:
            self.metrics.finished(outcome, time.monotonic() - published if outcome in ("stop", "length") else None)
            if self.live.get(rid) is live:
                del self.live[rid]
            if live.placed_seq:
                self._spawn(self._withdraw(live))
            if not finished:
                # A task of its own: this generator may be closing inside a cancelled
                # scope (client disconnect), where any await here would be cancelled too.
                self._spawn(self.cancel(rid, "client went away"))

    async def abort(self, rid: str | None, caller: int) -> list[str]:
        """End the streams of request ``rid`` (its samples too; ``None``: every request)
        that ``caller`` published (-1: no keys configured, any): each ends with a chunk of
        finish reason ``abort``, and its workers are told to cancel it. Returns their ids."""
        ended = []
        for live in list(self.live.values()):
            if rid is not None and rid not in (live.request.rid, live.group):
                continue
            if caller != -1 and live.caller != caller:
                continue
            stream = live.stream
            usage = Usage(len(live.request.prompt_ids), len(stream.output_ids))
            stream.queue.put_nowait(
                TokenChunk(
                    rid=live.request.rid,
                    seq=stream.next_seq,
                    finish_reason="abort",
                    usage=usage,
                    attempt=stream.attempt,
                )
            )
            ended.append(live.request.rid)
            await self.cancel(live.request.rid, "aborted by /abort_request")
        return ended

    async def cancel(self, rid: str, reason: str) -> None:
        """Cancel every attempt of ``rid`` published until now."""
        await self._publish_cancel(Cancel(rid=rid, reason=reason, issued_at=time.time()))

    async def _publish_cancel(self, cancel: Cancel) -> None:
        if self.nc is None or not self.nc.is_connected:
            return
        try:
            await contract.publish(self.nc, contract.CANCEL, cancel)
        except Exception as exc:
            log.warning("could not publish cancel", extra={"rid": cancel.rid, "error": str(exc)})

    def in_flight(self) -> tuple[int, int]:
        """Requests streaming now, and the prompt tokens of those with no token back yet."""
        waiting = sum(
            len(live.request.prompt_ids) + len(live.stream.output_ids)
            for live in self.live.values()
            if not live.stream.output_ids
        )
        return len(self.live), waiting


def _annotate(live: Live, last: TokenChunk) -> None:
    """Tokens in and out on the request's ``http request`` span."""
    span = trace.get_current_span(live.trace)
    span.set_attribute("pdserve.rid", live.request.rid)
    span.set_attribute("pdserve.attempts", live.stream.attempt + 1)
    if last.usage is not None:
        span.set_attribute("pdserve.tokens_in", last.usage.prompt_tokens)
        span.set_attribute("pdserve.tokens_out", last.usage.completion_tokens)
        span.set_attribute("pdserve.cached_tokens", last.usage.cached_tokens)


__all__ = ["DuplicateRequestError", "Gateway", "QueueFullError", "StreamError", "TokenStream"]
