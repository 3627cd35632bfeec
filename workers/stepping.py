"""A worker's engine loop: schedule, launch, and publish the step before while this one runs
on the device; a failed step fails its requests. A part of
:class:`~pdserve.workers.runtime.WorkerRuntime` (the roles override ``on_outputs``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve.broker import tracing
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import Launched, RequestOutput
from pdserve.engine.sequence import ScheduledBatch
from pdserve.schemas import (
    GenerateRequest,
)
from pdserve.schemas.tokens import RETRYABLE
from pdserve.workers.cancels import Cancels
from pdserve.workers.config import WorkerConfig
from pdserve.workers.lifecycle import Lifecycle
from pdserve.workers.metrics import WorkerMetrics
from pdserve.workers.replies import Replies, Tracked
from pdserve.workers.transfer import TransferBackend

log = logging.getLogger("pdserve.workers.runtime")


class EngineLoop:
    """The engine loop's methods; the runtime provides the state (see the annotations)."""

    engine: Engine
    config: WorkerConfig
    tracked: dict[str, Tracked]
    requests: dict[str, GenerateRequest]
    replies: Replies
    metrics: WorkerMetrics
    transfer: TransferBackend | None
    cancels: Cancels
    lifecycle: Lifecycle
    _wake: asyncio.Event
    _engine_thread: ThreadPoolExecutor

    async def fail(self, t: Tracked, message: str, kind: str = "server_error", code: str | None = None) -> None:
        raise NotImplementedError

    async def publish_kv_events(self) -> None:
        raise NotImplementedError

    def span(self, name: str, t: Tracked, start: float, end: float, **attributes: int | str | bool) -> None:
        raise NotImplementedError

    async def _engine_loop(self) -> None:
        """Schedule, launch, and publish the step before while this one runs on the device
        (when the engine overlaps; otherwise each step is waited for at once)."""
        loop = asyncio.get_running_loop()
        engine = self.engine
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = engine.schedule()
            if batch.is_empty:
                if engine.pending is not None:
                    await self._complete(engine.pending)
                    continue
                self._wake.clear()  # work waits for pages or imports: poll gently
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result
                # and drops a cancel that lands as the wait completes, and this loop would
                # then outlive the worker's stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await self._wake.wait()
                continue
            try:
                launched = await loop.run_in_executor(self._engine_thread, engine.launch, batch)
            except Exception:
                log.exception("engine step failed; failing the batch's requests")
                if engine.pending is not None:
                    await self._complete(engine.pending)
                await self._fail_batch(batch)
                continue
            if engine.pending is not None:
                await self._complete(engine.pending)
            if not engine.hold(launched):
                await self._complete(launched)
            await asyncio.sleep(0)  # let fetches, cancels and releases in between steps

    async def _complete(self, launched: Launched) -> None:
        """Wait for a launched step's tokens (in the engine thread) and publish them."""
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._engine_thread, self.engine.collect, launched
            )
        except Exception:
            log.exception("engine step failed; failing the batch's requests")
            await self._fail_batch(launched.batch)
            return
        outputs = self.engine.complete(launched, result)
        self.metrics.batch_size.observe(len(launched.seqs))
        if log.isEnabledFor(logging.DEBUG):  # a step timeline (``--log-level DEBUG``)
            batch = launched.batch
            log.debug(
                "step",
                extra={
                    "decodes": len(batch.decodes),
                    "prefill_tokens": sum(n for _, n in batch.prefills),
                    "launched_at": round(launched.started, 4),
                    "seconds": round(result.seconds, 4),
                    "gpu_ms": None if result.gpu_seconds is None else round(result.gpu_seconds * 1e3, 3),
                    "period_ms": None if result.gpu_period is None else round(result.gpu_period * 1e3, 3),
                    "done_at": round(time.perf_counter(), 4),
                },
            )
        await self.on_outputs(outputs)  # raising here is a bug: the worker ends (supervised)
        await self.publish_kv_events()

    async def _fail_batch(self, batch: ScheduledBatch) -> None:
        for seq in self.engine.fail(batch):
            self.engine.abort(seq.group or seq.rid)  # the other samples of its request go with it
            t = self.tracked.pop(seq.group or seq.rid, None)
            self.requests.pop(seq.group or seq.rid, None)
            if t is not None:
                t.next_seq = len(seq.output_ids)
                await self.fail(t, "engine step failed", code=RETRYABLE)

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Publish one step's outputs (in order for each request)."""
        raise NotImplementedError

    def prefill_done(self, t: Tracked, out: RequestOutput) -> None:
        """``out`` holds ``t``'s first token: time its prefill (``timings``, span); decoding starts now."""
        now = time.time()
        t.decode_from = now
        if not t.received_at:
            return
        t.timings["prefill"] = now - t.received_at
        self.span(
            tracing.PREFILL,
            t,
            t.received_at,
            now,
            tokens_in=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
        )

    async def stream_outputs(self, outputs: list[RequestOutput]) -> None:
        """Publish decoding requests' new tokens (one message per receiver that takes
        batches, see ``GenerateRequest.batch_to``); then settle those that finished."""
        sent = []
        for out in outputs:
            t = self.tracked.get(out.group or out.rid)
            if t is None:
                continue
            if not t.decode_from:  # a unified worker's first token: its prefill is done
                self.prefill_done(t, out)
            if out.finish_reason is not None:
                self.span(tracing.DECODE, t, t.decode_from, time.time(), tokens_out=out.completion_tokens)
            sent.append((t, self.replies.chunk(out, t)))
        await self.replies.send_step(sent)
        for t, chunk in sent:
            if chunk.finish_reason is not None:
                await self.sample_done(t, chunk.rid)

    async def sample_done(self, t: Tracked, rid: str) -> None:
        """``rid`` of ``t`` (``t`` itself, or one of its samples) ended; once all have, ``t``
        is settled."""
        if rid in t.samples:
            t.samples.remove(rid)
            if t.samples:
                return
        if self.tracked.get(t.rid) is t:
            self.tracked.pop(t.rid, None)
            self.requests.pop(t.rid, None)
        await t.settle()
