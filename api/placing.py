"""The gateway's placement (conditional disaggregation and prefix-aware placement): the
load it decides on, read every ``refresh_seconds``; the prefix index fed by the workers'
KV events; a request's first channel or worker; the fall-back to the shared queue when a
placed request is not taken in time. A part of :class:`~pdserve.api.gateway.Gateway`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from pdserve.api.cluster import ClusterQueries
from pdserve.api.live import GatewayStats, Live
from pdserve.api.placement import LOCAL, PLACED, Load, choose
from pdserve.api.prefix_index import PrefixIndex, Target, best_worker, coldest_worker
from pdserve.broker import contract, queues, streams
from pdserve.schemas import GenerateRequest, KVEvents

if TYPE_CHECKING:
    from pdserve.broker.claims import Claims

log = logging.getLogger("pdserve.api.gateway")

RESUBMIT_RETRY_SECONDS = 0.5


class Placing(ClusterQueries):
    """Placement's state and methods; the gateway provides the rest (see the annotations)."""

    api_id: str
    load: Load
    index: PrefixIndex
    claims: Claims | None
    placeable: set[str]
    decoders: set[str]
    busy: dict[str, int]
    cold_pages: dict[str, int]
    live: dict[str, Live]
    stats: GatewayStats

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        raise NotImplementedError

    async def _resubmit(self, live: Live, request: GenerateRequest) -> None:
        raise NotImplementedError

    async def _read_load(self) -> None:
        """The load placement decides on, every ``refresh_seconds``; a failed reading is
        logged and the last one kept (the broker may be away for a while)."""
        assert self.js is not None
        while True:
            try:
                workers = await self.workers()
                prefill = await streams.queue_depth(
                    self.js, contract.REQUESTS.stream, contract.REQUESTS.consumer(self.model)
                )
                local = await streams.queue_depth(
                    self.js, contract.LOCAL_REQUESTS.stream, contract.LOCAL_REQUESTS.consumer(self.model)
                )
                self.load = Load.read(workers, self.model, prefill.pending, local.pending)
                mine = [w for w in workers if w.model == self.model]
                self.placeable = {w.worker_id for w in mine if w.role in ("prefill", "unified")}
                self.decoders = {w.worker_id for w in mine if w.role == "decode"}
                self.busy = {w.worker_id: w.requests_in_flight for w in mine}
                self.index.forget(self.index.workers() - self.placeable - self.decoders)
            except Exception as exc:
                log.warning("load reading failed; placement keeps the last one", extra={"error": str(exc)})
            await asyncio.sleep(self.placement.refresh_seconds)

    async def _on_kv_events(self, events: KVEvents) -> None:
        self.index.apply(events)
        pending = self.cold_pages.get(events.worker_id, 0)
        if pending:
            self.cold_pages[events.worker_id] = max(pending - len(events.stored), 0)

    def cached_estimate(self, request: GenerateRequest) -> int:
        """Prompt tokens a decode worker is believed to cache of ``request``'s prompt (0:
        unknown, or prefix-aware placement off: no index)."""
        if not self.placement.prefix_aware or not self.decoders:
            return 0
        matches = self.index.matches(request.prompt_ids, request.sampling.page_root)
        return max((matches.get(w, 0) for w in self.decoders), default=0)

    def _prefix_target(self, request: GenerateRequest) -> Target | None:
        """The prefill or unified worker believed to cache most of ``request``'s prompt (none
        for an urgent one, ``priority`` below 0: its own queue reaches a worker even when full)."""
        if not self.placement.prefix_aware or request.sampling.n > 1 or request.sampling.priority < 0:
            return None
        if len(self.placeable) < self.placement.prefix_min_workers:  # none, or one the shared queue reaches
            return None
        matches = self.index.matches(request.prompt_ids, request.sampling.page_root)
        target = best_worker(matches, self.placeable, self.placement.prefix_min_tokens, self.busy)
        if target is not None or len(request.prompt_ids) < self.placement.prefix_min_tokens:
            return target
        if self.load.prefill_queued > 0:  # a backlog: the shared queue serves it soonest
            return None
        # A long prefix nobody caches: to the worker caching least, so tenants spread.
        pages = {w: self.index.pages.get(w, 0) + self.cold_pages.get(w, 0) for w in self.placeable}
        worker = coldest_worker(self.placeable, pages)
        if worker is None:
            return None
        page_size = self.index.page_sizes.get(worker, 16)
        self.cold_pages[worker] = self.cold_pages.get(worker, 0) + len(request.prompt_ids) // page_size
        return Target(worker, 0)

    async def _place(self, live: Live, target: Target) -> bool:
        """Store ``live``'s request on ``target``'s own subject and watch that it is taken
        in time; False for a duplicate."""
        assert self.nc is not None
        request = live.request
        seq = await queues.place(self.nc, request, self.model, target.worker_id, trace=live.trace)
        if seq is None:
            return False
        live.placed_seq = seq
        self.metrics.placed(PLACED)
        self._spawn(self._fall_back(live, target.worker_id))
        return True

    async def _fall_back(self, live: Live, worker_id: str) -> None:
        """After ``placed_deadline``: unless its worker took it, claim the request for the
        shared queue (the worker, finding the claim taken, drops its copy), withdraw the
        placed copy and submit it to the request stream. If the worker claimed it first,
        it runs there (and moves on like any request if that worker dies)."""
        assert self.claims is not None and self.js is not None
        await asyncio.sleep(self.placement.placed_deadline)
        rid = live.request.rid
        while self.live.get(rid) is live and not live.taken:
            try:
                owner = await self.claims.claim(rid, 0, self.api_id)
            except Exception as exc:  # the broker is away: try again (the worker cannot claim either)
                log.warning("placement claim failed; retrying", extra={"rid": rid, "error": str(exc)})
                await asyncio.sleep(RESUBMIT_RETRY_SECONDS)
                continue
            if owner != self.api_id:
                return
            self.stats.placement_fallbacks += 1
            log.info("placed request not taken in time; to the shared queue", extra={"rid": rid, "worker": worker_id})
            await self._withdraw(live)
            await self._resubmit(live, live.request)
            return

    async def _withdraw(self, live: Live) -> None:
        """Delete ``live``'s placed copy from the request stream (gone already is fine)."""
        if not live.placed_seq or self.js is None:
            return
        seq, live.placed_seq = live.placed_seq, 0
        try:
            await self.js.delete_msg(contract.PLACED.stream, seq)
        except Exception as exc:
            log.debug("placed copy not deleted", extra={"rid": live.request.rid, "error": str(exc)})

    def _channel(self, request: GenerateRequest) -> contract.WorkChannel[GenerateRequest]:
        """The work channel of ``request``'s first attempt, counted by path."""
        prompt = request.prompt_ids
        decision = choose(len(prompt), self.cached_estimate(request), self.load, self.placement)
        self.metrics.placed(decision.path)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("placed", extra={"rid": request.rid, "path": decision.path, "reason": decision.reason})
        return contract.LOCAL_REQUESTS if decision.path == LOCAL else contract.request_channel(request)
