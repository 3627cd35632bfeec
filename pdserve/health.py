"""A worker's tiny HTTP health endpoint (for ``--port``, Kubernetes probes)."""

from __future__ import annotations

import asyncio

import orjson

from pdserve.workers.runtime import WorkerRuntime


async def serve_health(worker: WorkerRuntime, host: str, port: int) -> asyncio.AbstractServer:
    """``GET /health``: 200 with the worker's load while it serves, 503 while stopping."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
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
        status = b"200 OK" if ok else b"503 Service Unavailable"
        writer.write(
            b"HTTP/1.1 "
            + status
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + body
        )
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, host, port)
