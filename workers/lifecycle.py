"""A worker's life: connect, report ready, serve, and on SIGTERM stop taking work, finish
or hand back what is in flight, leave the registry and drain the connection.

It owns the NATS connection, the registry entry with its heartbeat, the watch on the
event loop, and the worker's background tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext

from pdserve.broker import streams
from pdserve.broker.connection import connect
from pdserve.broker.registry import WorkerRegistry
from pdserve.schemas import WorkerInfo
from pdserve.workers.config import WorkerConfig

log = logging.getLogger(__name__)

Step = tuple[str, Callable[[], Awaitable[object]]]


class Lifecycle:
    """``info()`` is the worker's registry entry as of now, put at start and every heartbeat."""

    def __init__(self, config: WorkerConfig, info: Callable[[], WorkerInfo]) -> None:
        self.config = config
        self.stopping = asyncio.Event()
        self.stopped = asyncio.Event()
        self.max_loop_lag = 0.0
        self._info = info
        self._nc: Client | None = None
        self._registry: WorkerRegistry | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def connect(self) -> tuple[Client, JetStreamContext]:
        """Connect, create the model's streams and consumers if missing, open the registry."""
        cfg = self.config
        self._nc = await connect(cfg.nats_url, cfg.worker_id)
        js = self._nc.jetstream()
        await streams.ensure_model(js, cfg.model_name, cfg.broker)
        self._registry = WorkerRegistry(await streams.worker_bucket(js, cfg.broker), js)
        return self._nc, js

    async def report_ready(self, *work: Coroutine[Any, Any, None]) -> None:
        """Register, then run ``work`` and the heartbeat and loop watch as background tasks."""
        await self.heartbeat()
        for coro in (*work, self._heartbeat_loop(), self._lag_loop()):
            self._tasks.append(asyncio.create_task(coro))
        cfg = self.config
        log.info("worker ready", extra={"worker": cfg.worker_id, "role": cfg.role, "model": cfg.model_name})

    async def serve(self, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
        """``start``, run until SIGTERM/SIGINT, then ``stop``."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self.stopping.set)
        await start()
        await self.stopping.wait()
        await stop()

    async def stop(self, busy: Callable[[], bool], steps: Sequence[Step]) -> None:
        """Stop taking work, let in-flight requests finish (while ``busy()``, up to
        ``drain_seconds``), cancel the background tasks, run the worker's ``steps`` (hand
        back, free KV...), leave the registry, drain the connection. Each step after the
        wait is bounded, so a broker in trouble cannot hold a worker forever."""
        self.stopping.set()
        deadline = time.monotonic() + self.config.drain_seconds
        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        log.debug("shutdown: stopping tasks", extra={"worker": self.config.worker_id})
        for task in self._tasks:
            task.cancel()
        await self._bounded("tasks", asyncio.gather(*self._tasks, return_exceptions=True))
        for name, step in steps:
            await self._bounded(name, step())
        if self._registry is not None:
            await self._bounded("registry", self._registry.remove(self.config.worker_id))
        if self._nc is not None and self._nc.is_connected:
            await self._bounded("drain", self._nc.drain())
        self.stopped.set()
        log.info("worker stopped", extra={"worker": self.config.worker_id})

    async def _bounded(self, step: str, work: Awaitable[object], seconds: float = 10.0) -> None:
        try:
            await asyncio.wait_for(work, seconds)
        except TimeoutError:
            log.warning("shutdown step timed out", extra={"step": step, "seconds": seconds})
        except Exception as exc:
            log.warning("shutdown step failed", extra={"step": step, "error": str(exc)})
        log.debug("shutdown step done", extra={"step": step, "worker": self.config.worker_id})

    async def heartbeat(self) -> None:
        assert self._registry is not None, "connect() first"
        await self._registry.put(self._info())

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_seconds)
            try:
                await self.heartbeat()
            except Exception as exc:
                log.warning("heartbeat failed", extra={"error": str(exc)})

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
