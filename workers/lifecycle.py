"""A worker's life: connect, report ready, serve, and on SIGTERM stop taking work, finish
or hand back what is in flight, leave the registry and drain the connection.

It owns the NATS connection, the registry entry with its heartbeat, the watch on the
event loop, and the worker's background tasks. Every task is supervised: one that raises
(or a long-lived loop that returns while the worker serves) is logged, the heartbeat stops
at once, what is in flight is handed back, and :meth:`Lifecycle.serve` raises
:class:`WorkerCrashed` so the process exits non-zero and its supervisor restarts it. A
worker never lives on with a dead loop behind a live heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from nats import errors as nats_errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from pdserve.broker import streams
from pdserve.broker.connection import connect, end_tasks
from pdserve.broker.registry import WorkerRegistry
from pdserve.schemas import WorkerInfo
from pdserve.workers.config import WorkerConfig

log = logging.getLogger(__name__)

Step = tuple[str, Callable[[], Awaitable[object]]]

# After a crash the shutdown steps get this long in all before the process is ended anyway.
CRASH_EXIT_SECONDS = 15.0


class WorkerCrashed(RuntimeError):
    """A supervised task failed; the worker stopped and its process should exit non-zero."""


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
        self._heartbeat: asyncio.Task[None] | None = None
        self.crashed: str | None = None  # what failed, once a supervised task has

    async def connect(self) -> tuple[Client, JetStreamContext]:
        """Connect, create the model's streams and consumers if missing, open the registry."""
        cfg = self.config
        self._nc = await connect(cfg.nats_url, cfg.worker_id, cfg.nats_auth)
        js = self._nc.jetstream()
        await streams.ensure_model(js, cfg.model_name, cfg.broker)
        self._registry = WorkerRegistry(await streams.worker_bucket(js, cfg.broker), js)
        return self._nc, js

    async def report_ready(self, *work: Coroutine[Any, Any, None]) -> None:
        """Register, then run ``work`` and the heartbeat and loop watch as supervised tasks:
        each is meant to run until the worker stops."""
        await self.heartbeat()
        for coro in work:
            self._tasks.append(self.supervise(coro, loop=True))
        self._heartbeat = self.supervise(self._heartbeat_loop(), loop=True)
        self._tasks += [self._heartbeat, self.supervise(self._lag_loop(), loop=True)]
        cfg = self.config
        log.info("worker ready", extra={"worker": cfg.worker_id, "role": cfg.role, "model": cfg.model_name})

    def supervise(self, coro: Coroutine[Any, Any, None], loop: bool = False) -> asyncio.Task[None]:
        """Run ``coro`` as a task whose failure stops the worker (see :meth:`crash`).
        ``loop``: it should run until the worker stops, so returning early is a failure too."""
        name = getattr(coro, "__qualname__", "task")
        task = asyncio.create_task(coro, name=name)

        def done(task: asyncio.Task[None]) -> None:
            if task.cancelled():
                return
            exc = task.exception()
            if exc is not None:
                self.crash(name, exc)
            elif loop and not self.stopping.is_set():
                self.crash(name, RuntimeError("a worker loop returned while the worker was serving"))

        task.add_done_callback(done)
        return task

    def crash(self, where: str, exc: BaseException) -> None:
        """A supervised task failed: log it, stop heartbeating now, and stop the worker."""
        if self.crashed is not None:
            return
        self.crashed = f"{where}: {exc!r}"
        log.critical(
            "worker task failed; the worker stops and exits",
            exc_info=exc,
            extra={"task": where, "worker": self.config.worker_id},
        )
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        self.stopping.set()

    async def serve(self, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
        """``start``, run until SIGTERM/SIGINT or a crash, then ``stop``.

        Raises :class:`WorkerCrashed` after stopping if a supervised task failed."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self.stopping.set)
        await start()
        await self.stopping.wait()
        if self.crashed is None:
            await stop()
            return
        try:
            async with asyncio.timeout(CRASH_EXIT_SECONDS):
                await stop()
        except Exception as exc:  # ending anyway: the supervisor restarts us
            log.error("shutdown after a crash did not complete", extra={"error": repr(exc)})
        raise WorkerCrashed(self.crashed)

    async def stop(self, busy: Callable[[], bool], steps: Sequence[Step]) -> None:
        """Stop taking work, let in-flight requests finish (while ``busy()``, up to
        ``drain_seconds``), cancel the background tasks, run the worker's ``steps`` (hand
        back, free KV...), leave the registry, drain the connection. Each step after the
        wait is bounded, so a broker in trouble cannot hold a worker forever."""
        self.stopping.set()
        drain = 0.0 if self.crashed is not None else self.config.drain_seconds  # a crashed worker hands back at once
        deadline = time.monotonic() + drain
        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        log.debug("shutdown: stopping tasks", extra={"worker": self.config.worker_id})
        running = await end_tasks(self._tasks, 10.0)
        if running:
            log.warning("shutdown step timed out", extra={"step": "tasks", "running": [t.get_name() for t in running]})
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
            async with asyncio.timeout(seconds):
                await work
        except TimeoutError:
            log.warning("shutdown step timed out", extra={"step": step, "seconds": seconds})
        except Exception as exc:
            log.warning("shutdown step failed", extra={"step": step, "error": str(exc)})
        log.debug("shutdown step done", extra={"step": step, "worker": self.config.worker_id})

    async def workers(self) -> list[WorkerInfo]:
        """The live workers of the registry (every model)."""
        assert self._registry is not None, "connect() first"
        return await self._registry.list()

    async def heartbeat(self) -> None:
        assert self._registry is not None, "connect() first"
        await self._registry.put(self._info())

    async def _heartbeat_loop(self) -> None:
        """Put the registry entry every ``heartbeat_seconds``. The broker being away is
        expected (it comes back); an error building the entry is a bug and ends the worker."""
        assert self._registry is not None and self._nc is not None, "connect() first"
        while True:
            await asyncio.sleep(self.config.heartbeat_seconds)
            info = self._info()
            try:
                await self._registry.put(info)
            except (nats_errors.Error, TimeoutError) as exc:
                log.warning("heartbeat failed", extra={"error": str(exc) or type(exc).__name__})
                # A restarted broker has lost the in-memory registry bucket: make it again.
                with contextlib.suppress(nats_errors.Error, TimeoutError):
                    await streams.worker_bucket(self._nc.jetstream(), self.config.broker)

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
