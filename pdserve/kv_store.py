"""Mooncake Store for the KV store tier: its master and a store server, where their
binaries are, their command lines, and starting them (``pdserve up --kv-store``, the
tests, the benchmark).

Both ship in the Mooncake wheel. ``mooncake_master`` places objects and runs the embedded
HTTP metadata server, so one process is the whole control plane; workers reach it as
``--kv-store-master HOST:PORT`` and ``--kv-store-metadata http://HOST:PORT/metadata``. An
object lives in memory some store client lent (a *segment*), and goes when that client
stops: ``mooncake_client`` is a client that does nothing but lend ``--kv-store-bytes``,
so what the workers put outlives any of them (the workers lend nothing by default).
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class StoreMasterError(RuntimeError):
    pass


def binary(name: str = "mooncake_master") -> Path:
    """``name`` (``mooncake_master``, ``mooncake_client``) from the installed Mooncake
    package (or ``PATH``)."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / name
        if candidate.exists():
            return candidate
    found = shutil.which(name)
    if found is None:
        raise StoreMasterError(f"{name} not found: install the Mooncake wheel (pip install -e '.[cpu]')")
    return Path(found)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class StoreMaster:
    """Where a master listens: its RPC ``host:port`` and its metadata server's URL."""

    host: str
    rpc_port: int
    http_port: int
    metrics_port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def argv(self) -> list[str]:
        return [
            str(binary("mooncake_master")),
            f"-rpc_address={self.host}",
            f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={self.host}",
            f"-http_metadata_server_port={self.http_port}",
            f"-metrics_port={self.metrics_port}",
            "-minloglevel=2",  # errors only: quiet by default
        ]

    def ports(self) -> tuple[int, ...]:
        return (self.rpc_port, self.http_port)


@dataclass(frozen=True)
class StoreServer:
    """A ``mooncake_client`` lending ``nbytes`` of its memory to the store of ``master``."""

    master: StoreMaster
    port: int
    nbytes: int

    @property
    def host(self) -> str:
        return self.master.host

    def argv(self) -> list[str]:
        return [
            str(binary("mooncake_client")),
            f"-host={self.host}",
            f"-port={self.port}",
            f"-global_segment_size={self.nbytes}",
            f"-master_server_address={self.master.address}",
            f"-metadata_server={self.master.metadata_url}",
            "-protocol=tcp",
            "-minloglevel=2",
        ]

    def ports(self) -> tuple[int, ...]:
        return (self.port,)


def plan_master(host: str = "127.0.0.1") -> StoreMaster:
    """A master on three free ports of ``host``."""
    return StoreMaster(host, free_port(host), free_port(host), free_port(host))


def plan_server(master: StoreMaster, nbytes: int) -> StoreServer:
    return StoreServer(master, free_port(master.host), nbytes)


def wait_until_listening(
    part: StoreMaster | StoreServer, process: subprocess.Popen[bytes], timeout: float = 20.0
) -> None:
    """Until ``process`` (``part``) accepts connections on its ports; :class:`StoreMasterError`
    if it exits or does not listen within ``timeout`` seconds."""
    name = Path(part.argv()[0]).name
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StoreMasterError(f"{name} exited at start with {process.returncode}")
        try:
            for port in part.ports():
                socket.create_connection((part.host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise StoreMasterError(f"{name} did not listen on {part.host}:{part.ports()} within {timeout} s")


def start(part: StoreMaster | StoreServer, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``part`` and wait until it listens (the caller stops it)."""
    if log_path is None:
        process = subprocess.Popen(part.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    else:
        with open(log_path, "ab") as out:  # the child keeps its own descriptor
            process = subprocess.Popen(part.argv(), stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        wait_until_listening(part, process)
    except StoreMasterError:
        process.kill()
        process.wait()
        raise
    return process


@contextlib.contextmanager
def running_store(nbytes: int, log_dir: Path | None = None, host: str = "127.0.0.1") -> Iterator[StoreMaster]:
    """A master and a store server of ``nbytes`` on ``host`` while the block runs (tests,
    benchmarks); stopped (server first) when it ends."""
    master = plan_master(host)
    processes = [start(master, log_dir / "master.log" if log_dir else None)]
    try:
        processes.append(start(plan_server(master, nbytes), log_dir / "server.log" if log_dir else None))
        yield master
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(10)
