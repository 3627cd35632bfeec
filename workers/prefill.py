"""The prefill worker: prompt in, first token out, KV held for a decode worker.

Fetches ``GenerateRequest`` only while the engine has room and no more than two forward
passes' worth of prompt tokens wait in it (the pull is the back-pressure; a backlog stays
in the stream, visible and open to every prefill worker), streams the first token to the reply subject (time to first token),
publishes ``KVReady`` with the transfer handle, then acks the request. Held pages are
freed on ``KVRelease``, on ``Cancel`` or when the hold expires, never while a decode
worker holds a lease on them for a read (:mod:`.holds`); a handle names its hold's
generation, and a lease on any other generation is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve.broker import contract, queues
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput
from pdserve.schemas import GenerateRequest, KVHandle, KVLease, KVLeaseReply, KVReady, KVRelease, WorkerInfo
from pdserve.schemas.sampling import sample_rid
from pdserve.workers.config import WorkerConfig
from pdserve.workers.holds import Holds
from pdserve.workers.replies import Tracked
from pdserve.workers.runtime import WorkerRuntime
from pdserve.workers.transfer.shards import shard_mismatch

log = logging.getLogger(__name__)

# A prefill worker takes no more prompts while this many forward passes' worth of prompt
# tokens wait in its engine: the rest stay in the stream, where any prefill worker (one
# just started by the autoscaler included) can take them, and where the backlog shows.
QUEUED_PREFILL_STEPS = 2


class PrefillWorker(WorkerRuntime):
    def __init__(self, config: WorkerConfig, engine: Engine, engine_thread: ThreadPoolExecutor | None = None) -> None:
        super().__init__(config, engine, engine_thread)
        self.holds = Holds()
        self._peers_seen: set[str] = set()

    async def setup(self) -> None:
        assert self.nc is not None
        self.transfer = await self.start_transfer(serve=True)
        await contract.subscribe(self.nc, contract.KV_RELEASE, self._on_release, self.worker_id)
        await contract.answer(self.nc, contract.KV_LEASE, self._on_lease, self.worker_id)
        self.intake = await self.request_intake(prefill_only=True)
        self.side_intakes.append(await self.urgent_intake(prefill_only=True))
        if self.config.prefix_placement:
            self.side_intakes.append(await self.placed_intake(prefill_only=True))

    def room_for_requests(self) -> int:
        """The runtime's room, and none while :data:`QUEUED_PREFILL_STEPS` forward passes'
        worth of prompt tokens wait here."""
        engine = self.engine
        if engine.num_prefill_tokens_waiting >= QUEUED_PREFILL_STEPS * engine.config.chunked_prefill_size:
            return 0
        return super().room_for_requests()

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        groups: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            if out.group:
                groups.setdefault(out.group, []).append(out)
        singles = [self._on_output(out) for out in outputs if not out.group]
        await asyncio.gather(*singles, *(self._on_samples(rid, outs) for rid, outs in groups.items()))

    async def _on_output(self, out: RequestOutput) -> None:
        t = self.tracked.get(out.rid)
        req = self.requests.get(out.rid)
        if t is None or req is None:
            return
        self.prefill_done(t, out)
        await self.replies.send(t.reply_to, self.replies.chunk(out, t), t)
        if self.tracked.get(out.rid) is not t:  # cancelled or superseded meanwhile: the cancel freed it
            return
        if not out.held:  # finished at the first token (stop token or max_new_tokens=1)
            self._forget(t)
            await t.settle()
            return
        await self._hand_off(t, req, out.cached_tokens, req.output_ids + tuple(out.token_ids))

    async def _on_samples(self, rid: str, outs: list[RequestOutput]) -> None:
        """Every sample's first token of an ``n > 1`` request (one step draws them all): each
        goes to the client; the prompt's KV is handed off once for those that go on."""
        t = self.tracked.get(rid)
        req = self.requests.get(rid)
        if t is None or req is None:
            return
        self.prefill_done(t, outs[0])
        for out in outs:
            await self.replies.send(t.reply_to, self.replies.chunk(out, t), t)
        if self.tracked.get(rid) is not t:  # cancelled or superseded meanwhile: the cancel freed it
            return
        index = {sample_rid(rid, i): i for i in range(req.sampling.n)}
        going = [(index[o.rid], o.token_ids[0]) for o in outs if o.finish_reason is None]
        if not going:
            self._free(rid)
            self._forget(t)
            await t.settle()
            return
        samples, firsts = zip(*sorted(going), strict=True)
        await self._hand_off(t, req, outs[0].cached_tokens, (), samples, firsts)

    async def _hand_off(
        self,
        t: Tracked,
        req: GenerateRequest,
        cached_tokens: int,
        output_ids: tuple[int, ...],
        samples: tuple[int, ...] = (),
        first_ids: tuple[int, ...] = (),
    ) -> None:
        """Publish ``KVReady`` for ``req``'s held KV, then ack the request."""
        held = self.engine.held_pages(req.rid)
        assert held is not None
        pages, num_tokens = held
        pool = self.engine.runner.pool
        expires = time.time() + self.config.kv_hold_seconds
        assert self.transfer is not None and self.nc is not None
        hold_for = self.config.kv_hold_seconds + self.config.kv_hold_grace_seconds
        generation = self.holds.hold(req.rid, req.attempt, req.published_at, hold_for, time.monotonic())
        ready = KVReady(
            rid=req.rid,
            model=req.model,
            prompt_ids=req.prompt_ids,
            output_ids=output_ids,
            reply_to=req.reply_to,
            sampling=req.sampling,
            prefill_id=self.worker_id,
            handle=KVHandle(
                backend=self.transfer.name,
                endpoint=self.transfer.endpoint,
                layout=pool.layout,
                segments=tuple(pool.segments(pages[: -(-num_tokens // pool.layout.page_size)])),
                num_tokens=num_tokens,
                expires_at=expires,
                protocol=self.transfer.protocol,
                generation=generation,
                tp_size=self.tp_size,
                rank_endpoints=(self.transfer.endpoint, *(e for e, _ in self.rank_transfers))
                if self.rank_transfers
                else (),
                rank_bases=(pool.data_ptr, *(b for _, b in self.rank_transfers)) if self.rank_transfers else (),
            ),
            cached_tokens=cached_tokens,
            deadline=req.deadline,
            published_at=time.time(),
            request_published_at=req.published_at,
            timings=dict(t.timings),
            attempt=req.attempt,
            batch_to=req.batch_to,
            samples=samples,
            first_ids=first_ids,
        )
        try:
            fresh = await queues.submit(
                self.nc, contract.kv_ready_channel(ready), ready, req.model, req.rid, req.attempt, trace=t.trace
            )
        except Exception as exc:  # the stream is full or the broker is away
            log.error("could not publish KVReady", extra={"rid": req.rid, "error": str(exc)})
            if self.tracked.get(req.rid) is not t:  # cancelled or superseded meanwhile: nothing to retry
                await t.settle()
                return
            self._free(req.rid)
            await t.hand_back(delay=1.0)  # try again later, here or elsewhere
            self._forget(t)
            return
        if self.tracked.get(req.rid) is not t:
            # Cancelled or superseded while publishing: the cancel ended this hold, and the
            # rid (its pages, holds and table entries) may be a newer attempt's now.
            await t.settle()
            return
        if not fresh:  # this attempt's KVReady was published before (a redelivered request)
            log.info("KVReady already published; dropping the duplicate's KV", extra={"rid": req.rid})
            self._free(req.rid)
        await t.settle()
        self._forget(t)

    def _forget(self, t: Tracked) -> None:
        """Drop ``t`` from the tables, unless a newer attempt of its rid took its place."""
        if self.tracked.get(t.rid) is t:
            del self.tracked[t.rid]
            self.requests.pop(t.rid, None)

    def _free(self, rid: str) -> None:
        self.holds.release(rid, 0)
        self.engine.release(rid)

    async def _on_release(self, release: KVRelease) -> None:
        if self.holds.release(release.rid, release.generation):
            self.engine.release(release.rid)

    async def _on_lease(self, lease: KVLease) -> KVLeaseReply:
        refused = self.holds.lease(lease.rid, lease.generation, lease.seconds, time.monotonic())
        if refused is not None:
            log.info("KV lease refused", extra={"rid": lease.rid, "reason": refused})
        return KVLeaseReply(rid=lease.rid, granted=refused is None, reason=refused or "")

    async def apply_cancel(self, rid: str, reason: str) -> None:
        hold = self.holds.get(rid)
        if hold is not None and self.is_cancelled(rid, hold.attempt, hold.published_at):
            await self.cancel(rid, reason)
        await super().apply_cancel(rid, reason)

    async def cancel(self, rid: str, reason: str) -> None:
        if rid in self.holds:  # handed off: only its held pages are here
            if self.holds.end(rid, time.monotonic()):
                self.engine.release(rid)
            else:
                log.info("cancelled KV is being read; freed when the read ends", extra={"rid": rid})
            log.info("request cancelled", extra={"rid": rid, "reason": reason})
            return
        await super().cancel(rid, reason)

    async def make_room(self, t: Tracked) -> bool:
        """A newer attempt (or a new submission) of a request whose KV is still held here
        ends that hold first, or waits while a decode worker reads it; the same attempt
        again (its ack was lost) is done already."""
        hold = self.holds.get(t.rid)
        if hold is None:
            return True
        newer = (t.attempt, t.published_at) > (hold.attempt, hold.published_at)
        if not newer:
            await t.settle()
            return False
        if self.holds.end(t.rid, time.monotonic()):
            self.engine.release(t.rid)
            return True
        await t.hand_back(delay=0.5)
        return False

    async def on_tick(self) -> None:
        for rid, expired in self.holds.due(time.monotonic()):
            if expired:
                log.warning("held KV expired unclaimed", extra={"rid": rid})
            self.engine.release(rid)

    def busy(self) -> bool:
        return self.engine.has_work() or len(self.holds) > 0

    async def on_peers(self, peers: list[WorkerInfo]) -> None:
        """Log, once per worker, each decode worker of this model that cannot read this
        worker's KV (another layout, or KV heads that do not map between the TP sizes)."""
        await super().on_peers(peers)
        layout = self.engine.runner.pool.layout
        for w in peers:
            if w.role != "decode" or w.model != self.config.model_name or w.kv_layout is None:
                continue
            if w.worker_id in self._peers_seen:
                continue
            self._peers_seen.add(w.worker_id)
            problem = shard_mismatch(layout, self.tp_size, w.kv_layout, w.tp_size)
            if problem is not None:
                log.error(
                    "a decode worker cannot read this prefill worker's KV; its pulls will fail",
                    extra={"decode": w.worker_id, "differs": problem},
                )

    async def teardown(self) -> None:
        """Free every hold, once no decode worker's lease on one runs (at most a lease long)."""
        deadline = time.monotonic() + self.config.kv_lease_seconds
        while time.monotonic() < deadline and self.holds.is_leased(time.monotonic()):
            await asyncio.sleep(0.05)
        for rid in self.holds.rids():
            self._free(rid)
        await super().teardown()
        if self.transfer is not None:
            self.transfer.close()
