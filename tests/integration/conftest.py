"""The whole system as users run it (``pdserve up`` against a real nats-server), and
workers started in the test's own process against a real nats-server and real Mooncake."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.broker.connection import end_tasks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class System:
    url: str
    nats_url: str
    model_dir: Path
    model_name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_system(
    tmp: Path, model_dir: Path | None, nats_url: str | None, *extra: str, env: dict[str, str] | None = None
) -> System:
    """`pdserve up` on ``nats_url``, or with its own embedded broker (users and permissions
    on) when ``nats_url`` is ``None``; returns once ``/health`` says it can serve. Without
    ``model_dir``, no ``--model-path``: the default model of ``tmp / "data"``."""
    port = free_port()
    log_path = tmp / "pdserve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--data-dir",
        str(tmp / "data"),
        *(["--model-path", str(model_dir)] if model_dir is not None else []),
        *(["--nats-url", nats_url] if nats_url else []),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--heartbeat-seconds",
        "0.5",
        *extra,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    name = model_dir.name if model_dir is not None else ""
    system = System(f"http://127.0.0.1:{port}", nats_url or "", model_dir or tmp / "data", name, process, log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pdserve up exited early:\n{system.log()}")
        try:
            if httpx.get(system.url + "/health", timeout=2).status_code == 200:
                if not nats_url:
                    system.nats_url = _embedded_url(tmp / "data" / "nats")
                return system
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"pdserve up did not become healthy:\n{system.log()}")


def _embedded_url(nats_dir: Path) -> str:
    import json

    (ports,) = (nats_dir / "ports").glob("*.ports")
    return str(json.loads(ports.read_text())["nats"][0])


def stop_system(system: System) -> None:
    system.process.terminate()
    try:
        system.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        system.process.kill()


@pytest.fixture(scope="session")
def system_control() -> tuple[Any, Any]:
    """``(start_system, stop_system)``, for modules that start a system of their own."""
    return start_system, stop_system


@pytest.fixture(scope="module")
def nats_for_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from pdserve.broker.server import start_nats_server

    server = start_nats_server(tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pd_system(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, nats_for_module) -> Iterator[System]:
    """1 prefill + 1 decode worker and the API, as `pdserve up` runs them."""
    system = start_system(tmp_path_factory.mktemp("pd"), tiny_model_dir, nats_for_module.url)  # type: ignore[attr-defined]
    yield system
    stop_system(system)


@pytest.fixture
def up(tmp_path: Path, tiny_model_dir: Path, nats_for_module: Any) -> Iterator[Any]:
    """``up(*flags)`` starts `pdserve up` with extra flags on the module's nats-server; each
    is stopped at the end."""
    started: list[System] = []

    def start(*extra: str) -> System:
        home = tmp_path / f"up-{len(started)}"
        home.mkdir()
        system = start_system(home, tiny_model_dir, nats_for_module.url, *extra)
        started.append(system)
        return system

    yield start
    for system in started:
        stop_system(system)


@pytest.fixture
async def workers(nats_server, tiny_model_dir: Path) -> AsyncIterator[Any]:
    """``await workers(role, **WorkerConfig overrides)`` starts a worker in this process;
    each is shut down at the end unless it stopped (or vanished) already."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.loader import build_engine
    from pdserve.workers.config import WorkerConfig
    from pdserve.workers.decode import DecodeWorker
    from pdserve.workers.prefill import PrefillWorker
    from pdserve.workers.runtime import WorkerRuntime
    from pdserve.workers.unified import UnifiedWorker

    roles = {"prefill": PrefillWorker, "decode": DecodeWorker, "unified": UnifiedWorker}
    started: list[WorkerRuntime] = []

    async def start(role: str, **overrides: Any) -> WorkerRuntime:
        config = WorkerConfig(
            role=role,
            model_path=tiny_model_dir,
            model_name=tiny_model_dir.name,
            nats_url=nats_server.url,
            **{"engine": EngineConfig(max_total_tokens=16 * 512), "heartbeat_seconds": 0.5, **overrides},
        )
        worker = roles[role](config, build_engine(tiny_model_dir, config.engine))
        await worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if not worker.stopped.is_set():
            await worker.shutdown()


async def vanish(worker: Any) -> None:
    """What kill -9 does to a worker, in this process: its tasks stop mid-flight and its
    connection drops, with nothing acked, handed back or said to anyone."""
    tasks = [*worker.lifecycle._tasks, *worker._background]
    # Bounded: a test must fail, not hang, if something of the worker will not stop; the
    # failure names what would not stop and where it waits.
    pending = await end_tasks(tasks, 10)
    if pending:
        where = [_awaiting(t) for t in pending]
        raise AssertionError("worker tasks did not end 10 s after cancel:\n" + "\n".join(where))
    await asyncio.wait_for(worker.nc.close(), 10)
    worker.stopped.set()
    if worker.transfer is not None:
        worker.transfer.close()


def _awaiting(task: asyncio.Task[Any]) -> str:
    """Where a suspended task waits: each coroutine of its await chain, outermost first."""
    where, coro = [], task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            where.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return " -> ".join(where) or repr(task)


@pytest.fixture
def kill() -> Any:
    return vanish
