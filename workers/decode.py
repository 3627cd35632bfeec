"""The decode worker: claims ``KVReady`` events while it has free pages, pulls the KV
with one batched transfer, tells the prefill worker to release, and decodes.

A handle that is about to expire, a layout it cannot read, or a failed pull all end
the same way: the worker computes the prompt itself, and the stream goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from pdserve.broker import contract
from pdserve.broker.consumer import Delivery
from pdserve.engine.engine import Engine, RequestError, RequestOutput
from pdserve.engine.sequence import Sequence
from pdserve.schemas import KVReady, KVRelease
from pdserve.workers.config import WorkerConfig
from pdserve.workers.intake import Intake
from pdserve.workers.replies import Tracked
from pdserve.workers.runtime import WorkerRuntime
from pdserve.workers.transfer import TransferBackend, TransferError, plan_reads

log = logging.getLogger(__name__)

KV_READY_BATCH = 32


class DecodeWorker(WorkerRuntime):
    def __init__(self, config: WorkerConfig, engine: Engine) -> None:
        super().__init__(config, engine)
        self.transfer: TransferBackend | None = None
        self.backlog: deque[Delivery[KVReady]] = deque()
        self.importing: set[str] = set()
        self._transfer_threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")

    async def setup(self) -> None:
        self.transfer = self.start_transfer()
        assert self.nc is not None
        queue = contract.WorkQueue(self.nc, contract.KV_READY, self.config.model_name, self.worker_id)
        await queue.start()
        self.intake = Intake(queue, self._room, self._take, KV_READY_BATCH, self.config.fetch_timeout, idle_wait=0.02)

    def transfer_endpoint(self) -> str:
        return self.transfer.endpoint if self.transfer else ""

    def room(self) -> int:
        engine = self.engine
        if self.backlog or engine.pages.num_free_pages < engine.pages.num_pages // 10:
            return 0
        busy = engine.num_running + engine.num_waiting + len(self.importing)
        return max(engine.config.max_num_seqs - busy, 0)

    async def _room(self) -> int:
        """Claims what waits in the backlog first; then the room for new events."""
        await self._drain_backlog()
        return self.room()

    async def _take(self, deliveries: list[Delivery[KVReady]]) -> None:
        for d in deliveries:
            await self._claim(d)

    async def _drain_backlog(self) -> None:
        while self.backlog:
            d = self.backlog[0]
            if not await self._claim(d, from_backlog=True):
                return
            self.backlog.popleft()

    async def _claim(self, d: Delivery[KVReady], from_backlog: bool = False) -> bool:
        """Start importing ``d``; False if it must wait for pages (kept in the backlog)."""
        ready = d.message
        if ready.rid in self.tracked or ready.rid in self.importing:
            return True
        t = Tracked(ready.rid, ready.reply_to, d, ready.deadline, timings=dict(ready.timings or {}))
        if not from_backlog and ready.published_at:
            t.timings["kv_queue"] = max(d.received_at - ready.published_at, 0.0)
        if self.is_cancelled(ready.rid) or (ready.deadline and time.time() > ready.deadline):
            await self._release(ready, ok=False)
            await t.settle()
            return True
        if ready.model != self.config.model_name:
            await self._refuse(ready, t, f"model {ready.model!r} is not served here")
            return True
        if not self._can_pull(ready):
            return self._recompute(ready, t)
        try:
            seq = self.engine.reserve_import(ready.rid, list(ready.prompt_ids), list(ready.output_ids), ready.sampling)
        except RequestError as exc:
            await self._refuse(ready, t, str(exc))
            return True
        if seq is None:
            if not from_backlog:
                self.backlog.append(d)
            return False
        self.tracked[ready.rid] = t
        self.importing.add(ready.rid)
        self.spawn(self._pull(ready, seq, t))
        return True

    def _can_pull(self, ready: KVReady) -> bool:
        h = ready.handle
        pool = self.engine.runner.pool
        if self.transfer is None or h.backend != self.transfer.name or h.layout != pool.layout:
            log.warning("KV handle not readable here; recomputing", extra={"rid": ready.rid, "backend": h.backend})
            return False
        if h.expires_at - time.time() < self.config.kv_pull_margin:
            log.warning("KV handle (nearly) expired; recomputing", extra={"rid": ready.rid})
            return False
        return True

    def _recompute(self, ready: KVReady, t: Tracked) -> bool:
        try:
            self.engine.add_request(ready.rid, list(ready.prompt_ids), ready.sampling, list(ready.output_ids))
        except RequestError as exc:
            self.spawn(self._refuse(ready, t, str(exc)))
            return True
        self.tracked[ready.rid] = t
        t.timings["recomputed"] = 1.0
        self.spawn(self._release(ready, ok=False))
        self.wake()
        return True

    async def _refuse(self, ready: KVReady, t: Tracked, reason: str) -> None:
        await self.replies.error(ready.reply_to, ready.rid, len(ready.output_ids), reason, "invalid_request_error")
        await self._release(ready, ok=False)
        await t.settle(ok=False)

    def _read(self, ready: KVReady, reads: list[tuple[int, int, int]]) -> None:
        """In a transfer thread: once no queued step can write the reserved pages, pull."""
        assert self.transfer is not None
        self.engine.wait_for_pages(ready.rid)
        self.transfer.read(ready.handle.endpoint, reads)

    async def _pull(self, ready: KVReady, seq: Sequence, t: Tracked) -> None:
        assert self.transfer is not None
        pool = self.engine.runner.pool
        page = pool.layout.page_size
        started = time.perf_counter()
        ok = True
        try:
            reads = plan_reads(
                ready.handle.segments,
                pool.page_bytes,
                seq.page_table[: -(-ready.handle.num_tokens // page)],
                pool.data_ptr,
                skip_pages=seq.num_cached // page,
            )
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._transfer_threads, self._read, ready, reads)
        except TransferError as exc:
            ok = False
            log.warning("KV pull failed; recomputing", extra={"rid": ready.rid, "error": str(exc)})
        self.importing.discard(ready.rid)
        t.timings["kv_transfer"] = time.perf_counter() - started
        await self._release(ready, ok=ok)
        if self.is_cancelled(ready.rid) or ready.rid not in self.tracked:
            self.engine.abort(ready.rid)
            self.tracked.pop(ready.rid, None)
            await t.settle()
            return
        if ok:
            self.engine.commit_import(seq)
        else:
            self.engine.fail_import(seq)
        await t.settle()  # the KV event is consumed; the stream goes on from here
        self.wake()

    async def _release(self, ready: KVReady, ok: bool) -> None:
        assert self.nc is not None
        release = KVRelease(rid=ready.rid, prefill_id=ready.prefill_id, ok=ok)
        with contextlib.suppress(Exception):
            await contract.publish(self.nc, contract.KV_RELEASE, release, ready.prefill_id)

    async def cancel(self, rid: str, reason: str) -> None:
        if rid in self.importing:
            self.tracked.pop(rid, None)  # _pull sees it gone and frees the pages after the transfer
            return
        await super().cancel(rid, reason)

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            await self.stream_output(out)
        if self.backlog and self.intake is not None:
            self.intake.room_freed.set()

    def busy(self) -> bool:
        return self.engine.has_work() or bool(self.importing)

    async def hand_back(self) -> None:
        for d in self.backlog:
            with contextlib.suppress(Exception):
                await d.nak()
        self.backlog.clear()
        await super().hand_back()

    async def teardown(self) -> None:
        await super().teardown()
        self._transfer_threads.shutdown(wait=True)
        if self.transfer is not None:
            self.transfer.close()
