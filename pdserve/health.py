"""A worker's tiny HTTP endpoint (for ``--port``): ``GET /health`` for Kubernetes probes,
``GET /metrics`` for Prometheus."""

from __future__ import annotations

import asyncio

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.workers.runtime import WorkerRuntime


def _health(worker: WorkerRuntime) -> tuple[bytes, bytes, bytes]:
    ok = not worker.stopping.is_set()
    pages = worker.engine.pages
    body = orjson.dumps(
        {
            "status": "ok" if ok else "stopping",
            "worker_id": worker.worker_id,
            "role": worker.config.role,
            "pages_total": pages.num_pages,
            "pages_used": pages.num_used_pages,
            "requests_in_flight": len(worker.tracked),
        }
    )
    return (b"200 OK" if ok else b"503 Service Unavailable"), b"application/json", body


async def serve_health(worker: WorkerRuntime, host: str, port: int) -> asyncio.AbstractServer:
    """``GET /health``: 200 with the worker's load while it serves, 503 while stopping;
    ``GET /metrics``: the worker's Prometheus metrics."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        parts = head.split(b" ", 2)
        path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b"/"
        if path == b"/metrics":
            status, kind, body = b"200 OK", CONTENT_TYPE_LATEST.encode(), worker.metrics.exposition()
        else:
            status, kind, body = _health(worker)
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
