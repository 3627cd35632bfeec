"""A worker's tiny HTTP endpoint (for ``--port``): ``GET /health`` for Kubernetes probes,
``GET /metrics`` for Prometheus. A co-located process (``pdserve colocated``) serves both
of its workers on one port: healthy while both are, their metrics in one exposition (each
sample labelled with its worker's role)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pdserve.workers.runtime import WorkerRuntime


def _load(worker: WorkerRuntime) -> dict[str, object]:
    pages = worker.engine.pages
    return {
        "status": "stopping" if worker.stopping.is_set() else "ok",
        "worker_id": worker.worker_id,
        "role": worker.config.role,
        "pages_total": pages.num_pages,
        "pages_used": pages.num_used_pages,
        "requests_in_flight": len(worker.tracked),
    }


def _health(workers: Sequence[WorkerRuntime]) -> tuple[bytes, bytes, bytes]:
    ok = not any(w.stopping.is_set() for w in workers)
    if len(workers) == 1:
        body = orjson.dumps(_load(workers[0]))
    else:
        body = orjson.dumps({"status": "ok" if ok else "stopping", "workers": [_load(w) for w in workers]})
    return (b"200 OK" if ok else b"503 Service Unavailable"), b"application/json", body


class _Merged(Collector):
    """Several workers' registries as one: a family per name, every sample labelled with its
    worker's role where it is not already (the registry entries' families are)."""

    def __init__(self, workers: Sequence[WorkerRuntime]) -> None:
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for worker in self.workers:
            for metric in worker.metrics.registry.collect():
                merged = families.get(metric.name)
                if merged is None:
                    merged = families[metric.name] = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                for sample in metric.samples:
                    labels = sample.labels if "role" in sample.labels else {**sample.labels, "role": worker.config.role}
                    merged.samples.append(sample._replace(labels=labels))
        return iter(families.values())


def exposition(workers: Sequence[WorkerRuntime]) -> bytes:
    """The Prometheus text of one worker, or of several merged (:class:`_Merged`)."""
    if len(workers) == 1:
        return workers[0].metrics.exposition()
    registry = CollectorRegistry()
    registry.register(_Merged(workers))
    return generate_latest(registry)


async def serve_health(worker: WorkerRuntime | Sequence[WorkerRuntime], host: str, port: int) -> asyncio.AbstractServer:
    """``GET /health``: 200 with the worker's load while it serves, 503 while stopping;
    ``GET /metrics``: the worker's Prometheus metrics. Given several workers (one process's),
    both cover all of them."""
    workers = [worker] if isinstance(worker, WorkerRuntime) else list(worker)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        parts = head.split(b" ", 2)
        path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b"/"
        if path == b"/metrics":
            status, kind, body = b"200 OK", CONTENT_TYPE_LATEST.encode(), exposition(workers)
        else:
            status, kind, body = _health(workers)
        writer.write(
            b"HTTP/1.1 "
            + status
            + b"\r\nContent-Type: "
            + kind
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + body
        )
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, host, port)
