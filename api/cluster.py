"""What the gateway reads and asks of the deployment for the API's admin routes, ``/metrics``
and the dashboard: the live workers, the work queues, a flush of every prefix cache. A part
of :class:`~pdserve.api.gateway.Gateway`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from nats.js.errors import NotFoundError

from pdserve.broker import contract, streams
from pdserve.broker.metrics import QueueReading
from pdserve.schemas import FlushCache, FlushCacheReply, WorkerInfo

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

    from pdserve.api.metrics import ApiMetrics
    from pdserve.api.placement import PlacementConfig
    from pdserve.broker.registry import WorkerRegistry


class ClusterQueries:
    """The gateway's reads of the registry and the queues (see the annotations for what it
    provides)."""

    nc: Client | None
    js: JetStreamContext | None
    registry: WorkerRegistry | None
    model: str
    broker: streams.BrokerConfig
    placement: PlacementConfig
    metrics: ApiMetrics

    async def flush_cache(self, timeout: float = 5.0) -> list[FlushCacheReply | str]:
        """Ask every registered worker of this model to forget its cached prefixes; each
        answer, or what went wrong with that worker (a string)."""
        nc = self.nc
        assert nc is not None
        workers = [w for w in await self.workers() if w.model == self.model]

        async def ask(worker: WorkerInfo) -> FlushCacheReply | str:
            try:
                return await contract.ask(nc, contract.FLUSH_CACHE, FlushCache(), worker.worker_id, timeout=timeout)
            except contract.Unanswered as exc:
                return f"{worker.worker_id}: {exc}"

        return list(await asyncio.gather(*(ask(w) for w in workers)))

    async def workers(self) -> list[WorkerInfo]:
        """The live workers; none while the registry bucket is missing (a restarted
        broker lost it: it is made again, and the workers' next heartbeats fill it)."""
        assert self.registry is not None and self.js is not None
        try:
            return await self.registry.list()
        except NotFoundError:
            await streams.worker_bucket(self.js, self.broker)
            return []

    async def queues(self) -> list[QueueReading]:
        """Each work queue of the model: waiting, in hand, and the age of its oldest message."""
        assert self.js is not None
        readings = []
        channels: list[tuple[str, contract.WorkChannel[Any]]] = [
            ("prefill", contract.REQUESTS),
            ("urgent", contract.URGENT_REQUESTS),
            ("decode", contract.KV_READY),
            ("urgent_decode", contract.URGENT_KV_READY),
        ]
        if self.placement.conditional_disagg:
            channels.append(("local", contract.LOCAL_REQUESTS))
        for stage, channel in channels:
            consumer = channel.consumer(self.model)
            depth = await streams.queue_depth(self.js, channel.stream, consumer)
            age = await streams.queue_age(self.js, channel.stream, channel.subject(self.model))
            readings.append(QueueReading(stage, consumer, depth.pending, depth.ack_pending, age))
        return readings

    async def refresh_view(self) -> None:
        """Read the workers and queues into ``metrics.view`` (for ``/metrics`` and the dashboard)."""
        self.metrics.view.workers = await self.workers()
        self.metrics.view.queues = await self.queues()
