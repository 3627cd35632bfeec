"""The whole system as users run it: ``pdserve up`` against a real nats-server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


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


def start_system(tmp: Path, model_dir: Path, nats_url: str, *extra: str) -> System:
    port = free_port()
    log_path = tmp / "pdserve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--data-dir",
        str(tmp / "data"),
        "--model-path",
        str(model_dir),
        "--nats-url",
        nats_url,
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
    system = System(f"http://127.0.0.1:{port}", nats_url, model_dir, model_dir.name, process, log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pdserve up exited early:\n{system.log()}")
        try:
            if httpx.get(system.url + "/health", timeout=2).status_code == 200:
                return system
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"pdserve up did not become healthy:\n{system.log()}")


def stop_system(system: System) -> None:
    system.process.terminate()
    try:
        system.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        system.process.kill()


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
