"""What every worker role shares: NATS connection, registry heartbeat, cancel
fan-out, the engine loop, token publishing and graceful shutdown.

Threading: the asyncio loop owns the engine's state (adds, aborts, releases,
scheduling, postprocessing); only :meth:`Engine.execute` runs in the engine thread,
so no lock is needed. Transfers run in their own threads on reserved pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from pdserve.broker import streams, subjects
from pdserve.broker.connection import connect
from pdserve.broker.consumer import Delivery, PullConsumer, Rejected, decode_deliveries
from pdserve.broker.registry import WorkerRegistry
from pdserve.engine.engine import Engine, RequestError, RequestOutput
from pdserve.engine.sequence import ScheduledBatch
from pdserve.schemas import Cancel, ErrorInfo, GenerateRequest, MessageError, TokenChunk, Usage, WorkerInfo
from pdserve.workers.config import WorkerConfig
from pdserve.workers.transfer import TransferBackend, create_transfer

log = logging.getLogger(__name__)

CANCEL_MEMORY_SECONDS = 600.0


@dataclass
class Tracked:
    """A request this worker is working on, and where its tokens go."""

    rid: str
    reply_to: str
    delivery: Delivery | None
    deadline: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    acked: bool = False
    progress_at: float = field(default_factory=time.monotonic)


class WorkerRuntime:
    """Base of the prefill, decode and unified workers. Subclasses implement
    :meth:`fetch_loop` and :meth:`on_output`."""

    def __init__(self, config: WorkerConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.worker_id = config.worker_id
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.registry: WorkerRegistry | None = None
        self.tracked: dict[str, Tracked] = {}
        self.requests: dict[str, GenerateRequest] = {}
        self.cancelled: dict[str, float] = {}
        self.stopping = asyncio.Event()
        self.stopped = asyncio.Event()
        self._wake = asyncio.Event()
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._started_at = time.time()
        self.max_loop_lag = 0.0

    # ---- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        self.nc = await connect(self.config.nats_url, self.worker_id)
        self.js = self.nc.jetstream()
        await streams.ensure_model(self.js, self.config.model_name, self.config.broker)
        self.registry = WorkerRegistry(await streams.worker_bucket(self.js, self.config.broker), self.js)
        await self.nc.subscribe(subjects.CANCEL, cb=self._on_cancel)
        await self.setup()
        await self.heartbeat()
        for coro in (
            self._engine_loop(),
            self.fetch_loop(),
            self._heartbeat_loop(),
            self._deadline_loop(),
            self._lag_loop(),
        ):
            self._tasks.append(asyncio.create_task(coro))
        log.info(
            "worker ready", extra={"worker": self.worker_id, "role": self.config.role, "model": self.config.model_name}
        )

    async def setup(self) -> None:
        """Role-specific start-up (transfer engine, extra subscriptions)."""

    def start_transfer(self) -> TransferBackend:
        """The configured KV transfer backend, with this worker's whole page pool registered."""
        cfg = self.config
        transfer = create_transfer(
            cfg.transfer_backend, host=cfg.host, protocol=cfg.transfer_protocol, device_name=cfg.ib_device
        )
        pool = self.engine.runner.pool
        transfer.register(pool.data_ptr, pool.nbytes)
        return transfer

    async def serve(self) -> None:
        """Start, run until SIGTERM/SIGINT, then shut down gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self.stopping.set)
        await self.start()
        await self.stopping.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop taking work, let in-flight requests finish (up to ``drain_seconds``),
        hand back the rest, free KV, leave the registry, drain the connection. Each step
        after the drain is bounded, so a broker in trouble cannot hold a worker forever."""
        self.stopping.set()
        self._wake.set()
        deadline = time.monotonic() + self.config.drain_seconds
        while self.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        log.debug("shutdown: stopping tasks", extra={"worker": self.worker_id})
        for task in self._tasks:
            task.cancel()
        await self._bounded("tasks", asyncio.gather(*self._tasks, return_exceptions=True))
        await self._bounded("hand back", self.hand_back())
        await self._bounded("teardown", self.teardown())
        if self.registry is not None:
            await self._bounded("registry", self.registry.remove(self.worker_id))
        if self.nc is not None and self.nc.is_connected:
            await self._bounded("drain", self.nc.drain())
        self._engine_thread.shutdown(wait=True)
        self.stopped.set()
        log.info("worker stopped", extra={"worker": self.worker_id})

    async def _bounded(self, step: str, work: Awaitable[object], seconds: float = 10.0) -> None:
        try:
            await asyncio.wait_for(work, seconds)
        except TimeoutError:
            log.warning("shutdown step timed out", extra={"step": step, "seconds": seconds})
        except Exception as exc:
            log.warning("shutdown step failed", extra={"step": step, "error": str(exc)})
        log.debug("shutdown step done", extra={"step": step, "worker": self.worker_id})

    def busy(self) -> bool:
        return self.engine.has_work()

    async def hand_back(self) -> None:
        """Unfinished requests go back to the stream for another worker."""
        for rid, t in list(self.tracked.items()):
            self.engine.abort(rid)
            if t.delivery is not None and not t.acked:
                with contextlib.suppress(Exception):
                    await t.delivery.nak()
            self.tracked.pop(rid, None)

    async def teardown(self) -> None:
        """Role-specific clean-up."""

    # ---- work intake -------------------------------------------------------
    async def fetch_loop(self) -> None:
        raise NotImplementedError

    def room_for_requests(self) -> int:
        """How many more requests to take: bounded by the batch size and free pages."""
        engine = self.engine
        if engine.pages.num_free_pages < engine.pages.num_pages // 10:
            return 0
        return max(engine.config.max_num_seqs - engine.num_waiting - engine.num_running, 0)

    async def pull_requests(self, consumer: PullConsumer, prefill_only: bool) -> None:
        """Fetch ``GenerateRequest``s while there is room, and hand them to the engine."""
        while not self.stopping.is_set():
            room = self.room_for_requests()
            if room == 0:
                await asyncio.sleep(0.01)
                continue
            msgs = await consumer.fetch(min(room, 64), self.config.fetch_timeout)
            if not msgs:
                continue
            deliveries, rejected = await decode_deliveries(msgs, GenerateRequest)
            await self.reject(rejected)
            for d in deliveries:
                await self.admit(d, prefill_only)
            self.wake()

    async def admit(self, d: Delivery[GenerateRequest], prefill_only: bool) -> None:
        req = d.message
        t = Tracked(req.rid, req.reply_to, d, req.deadline)
        if req.published_at:
            t.timings["request_queue"] = max(d.received_at - req.published_at, 0.0)
        if self.is_cancelled(req.rid) or (req.deadline and time.time() > req.deadline):
            await self.settle(t, ok=True)
            return
        if req.rid in self.tracked:
            return  # a redelivery of something in hand: the ack will settle both
        if req.model != self.config.model_name:
            await self.send_error(
                req.reply_to,
                req.rid,
                len(req.output_ids),
                f"model {req.model!r} is not served here",
                "invalid_request_error",
            )
            await self.settle(t, ok=False)
            return
        try:
            self.engine.add_request(
                req.rid, list(req.prompt_ids), req.sampling, list(req.output_ids), prefill_only=prefill_only
            )
        except RequestError as exc:
            await self.send_error(req.reply_to, req.rid, len(req.output_ids), str(exc), "invalid_request_error")
            await self.settle(t, ok=False)
            return
        self.tracked[req.rid] = t
        self.requests[req.rid] = req

    def wake(self) -> None:
        self._wake.set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def is_cancelled(self, rid: str) -> bool:
        return rid in self.cancelled

    async def reject(self, rejected: list[Rejected]) -> None:
        """Malformed messages were terminated; tell the sender if we can tell who."""
        for r in rejected:
            if r.reply_to and r.rid:
                await self.send_error(r.reply_to, r.rid, 0, f"malformed message: {r.error}", "invalid_request_error")

    async def send_error(self, reply_to: str, rid: str, seq: int, message: str, kind: str = "server_error") -> None:
        chunk = TokenChunk(
            rid=rid, seq=seq, finish_reason="error", error=ErrorInfo(message, kind), worker_id=self.worker_id
        )
        await self.publish_chunk(reply_to, chunk)

    async def publish_chunk(self, reply_to: str, chunk: TokenChunk) -> None:
        assert self.nc is not None
        try:
            await self.nc.publish(reply_to, chunk.encode())
        except Exception as exc:  # a bad reply subject must not take the worker down
            log.warning("could not publish tokens", extra={"rid": chunk.rid, "error": str(exc)})

    def chunk_of(self, out: RequestOutput, tracked: Tracked | None) -> TokenChunk:
        usage = None
        timings = None
        if out.finish_reason is not None or out.held:
            usage = Usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
            timings = tracked.timings if tracked else None
        return TokenChunk(
            rid=out.rid,
            seq=out.index,
            token_ids=tuple(out.token_ids),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            usage=usage if out.finish_reason is not None else None,
            logprobs=tuple(out.logprobs) if out.logprobs else None,
            worker_id=self.worker_id,
            timings=timings,
        )

    # ---- the engine loop ---------------------------------------------------
    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self.engine.schedule()
            if batch.is_empty:  # work waits for pages or imports: poll gently
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.05)
                continue
            try:
                result = await loop.run_in_executor(self._engine_thread, self.engine.execute, batch)
            except Exception:
                log.exception("engine step failed; failing the batch's requests")
                await self._fail_batch(batch)
                continue
            outputs = self.engine.postprocess(batch, result)
            try:
                await self.on_outputs(outputs)
            except Exception:
                log.exception("handling outputs failed")
            await asyncio.sleep(0)  # let fetches, cancels and releases in between steps

    async def _fail_batch(self, batch: ScheduledBatch) -> None:
        for seq in self.engine.fail(batch):
            t = self.tracked.pop(seq.rid, None)
            if t is not None:
                await self.send_error(t.reply_to, seq.rid, len(seq.output_ids), "engine step failed")
                await self.settle(t, ok=False)

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Publish one step's outputs (in order for each request)."""
        raise NotImplementedError

    async def stream_output(self, out: RequestOutput) -> None:
        """Publish a decoding request's new tokens; settle it when it finishes."""
        t = self.tracked.get(out.rid)
        if t is None:
            return
        await self.publish_chunk(t.reply_to, self.chunk_of(out, t))
        if out.finish_reason is not None:
            self.tracked.pop(out.rid, None)
            self.requests.pop(out.rid, None)
            await self.settle(t)

    async def settle(self, t: Tracked, ok: bool = True) -> None:
        """Ack (done) or terminate (failed for good) the request's JetStream message."""
        if t.delivery is None or t.acked:
            return
        t.acked = True
        try:
            if ok:
                await t.delivery.ack()
            else:
                await t.delivery.term()
        except Exception as exc:
            log.warning("ack failed", extra={"rid": t.rid, "error": str(exc)})

    # ---- cancel, deadlines, heartbeat -------------------------------------
    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = Cancel.decode(msg.data)
        except MessageError as exc:
            log.warning("bad cancel message", extra={"error": str(exc)})
            return
        self.cancelled[cancel.rid] = time.monotonic()
        await self.cancel(cancel.rid, cancel.reason)

    async def cancel(self, rid: str, reason: str) -> None:
        """Drop ``rid`` everywhere in this worker and free its pages."""
        found = self.engine.abort(rid)
        self.engine.release(rid)
        t = self.tracked.pop(rid, None)
        self.requests.pop(rid, None)
        if t is not None:
            await self.settle(t, ok=True)  # done with it: do not redeliver a cancelled request
        if found or t is not None:
            log.info("request cancelled", extra={"rid": rid, "reason": reason})
        self.wake()

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now_wall = time.time()
            for rid, t in list(self.tracked.items()):
                if t.deadline and now_wall > t.deadline:
                    await self.send_error(t.reply_to, rid, 0, "deadline exceeded", "timeout")
                    await self.cancel(rid, "deadline exceeded")
            cutoff = time.monotonic() - CANCEL_MEMORY_SECONDS
            for rid, at in list(self.cancelled.items()):
                if at < cutoff:
                    del self.cancelled[rid]
            await self.on_tick()
            # keep long-running un-acked deliveries from being redelivered
            now = time.monotonic()
            for t in list(self.tracked.values()):
                if t.delivery is not None and not t.acked and now - t.progress_at > self.config.broker.ack_wait / 3:
                    t.progress_at = now
                    with contextlib.suppress(Exception):
                        await t.delivery.in_progress()

    async def on_tick(self) -> None:
        """Called about once a second (expiry of held KV and the like)."""

    async def _lag_loop(self, interval: float = 0.05, report: float = 0.1) -> None:
        """Watch the event loop: a late wake-up means fetches, cancels and token publishing
        waited too (the engine thread holding the GIL, or a starved CPU)."""
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + interval
            await asyncio.sleep(interval)
            lag = loop.time() - expected
            self.max_loop_lag = max(self.max_loop_lag, lag)
            if lag > report:
                log.warning("event loop stalled", extra={"ms": round(lag * 1e3)})

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_seconds)
            try:
                await self.heartbeat()
            except Exception as exc:
                log.warning("heartbeat failed", extra={"error": str(exc)})

    async def heartbeat(self) -> None:
        assert self.registry is not None
        pages = self.engine.pages
        await self.registry.put(
            WorkerInfo(
                worker_id=self.worker_id,
                role=self.config.role,
                model=self.config.model_name,
                host=socket.gethostname(),
                pid=os.getpid(),
                capacity=self.engine.config.max_num_seqs,
                pages_total=pages.num_pages,
                pages_used=pages.num_used_pages,
                page_size=pages.page_size,
                requests_in_flight=len(self.tracked),
                transfer_endpoint=self.transfer_endpoint(),
                model_path=str(self.config.model_path),
                started_at=self._started_at,
                updated_at=time.time(),
            )
        )

    def transfer_endpoint(self) -> str:
        return ""
