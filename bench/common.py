"""Starting and stopping `pdserve up` for the benchmark scripts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_pdserve(
    mode: str, data_dir: Path, extra: list[str] | None = None, timeout: float = 180.0
) -> tuple[subprocess.Popen[bytes], str]:
    """`pdserve up --mode MODE` on a free port in its own process group; returns once healthy."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--mode",
        mode,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--data-dir",
        str(data_dir),
        "--log-level",
        "WARNING",
        *(extra or []),
    ]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            stop_pdserve(proc)
            raise SystemExit("pdserve did not come up")
        time.sleep(0.5)


def stop_pdserve(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to `pdserve up` alone: it stops its workers, then its broker."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
