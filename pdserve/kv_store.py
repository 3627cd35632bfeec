"""Mooncake Store's master for the KV store tier: where its binary is, its command line,
and starting one (``pdserve up --kv-store``, the tests, the benchmark).

The master ships in the Mooncake wheel (``mooncake/mooncake_master``). pdserve runs it
with its embedded HTTP metadata server, both on loopback unless told otherwise, so one
process is the whole control plane; workers reach it as ``--kv-store-master HOST:PORT``
and ``--kv-store-metadata http://HOST:PORT/metadata``.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


class StoreMasterError(RuntimeError):
    pass


def master_binary() -> Path:
    """``mooncake_master`` from the installed Mooncake package (or ``PATH``)."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / "mooncake_master"
        if candidate.exists():
            return candidate
    found = shutil.which("mooncake_master")
    if found is None:
        raise StoreMasterError("mooncake_master not found: install the Mooncake wheel (pip install -e '.[cpu]')")
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
            str(master_binary()),
            f"-rpc_address={self.host}",
            f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={self.host}",
            f"-http_metadata_server_port={self.http_port}",
            f"-metrics_port={self.metrics_port}",
            "-minloglevel=2",  # errors only: quiet by default
        ]


def plan_master(host: str = "127.0.0.1") -> StoreMaster:
    """A master on three free ports of ``host``."""
    return StoreMaster(host, free_port(host), free_port(host), free_port(host))


def wait_until_listening(master: StoreMaster, process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StoreMasterError(f"mooncake_master exited at start with {process.returncode}")
        try:
            for port in (master.rpc_port, master.http_port):
                socket.create_connection((master.host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise StoreMasterError(f"mooncake_master did not listen on {master.address} within {timeout} s")


def start_master(master: StoreMaster, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``master`` and wait until it listens (the caller stops it)."""
    if log_path is None:
        process = subprocess.Popen(master.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    else:
        with open(log_path, "ab") as out:  # the child keeps its own descriptor
            process = subprocess.Popen(master.argv(), stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        wait_until_listening(master, process)
    except StoreMasterError:
        process.kill()
        process.wait()
        raise
    return process
