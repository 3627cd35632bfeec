"""The ``shm`` backend: KV between CPU worker processes of one host through shared memory.

Each worker's page pool lives in a file of its own under ``/dev/shm`` (``--kv-shm-dir``),
mode 0600 (:class:`~pdserve.engine.kv_pool.KVPool`). A prefill worker's endpoint names its
host, its worker id, that file and the pool's address in its own process
(``shm:<host>:<worker id>:<file>@<address>``); a decode worker maps the file once (kept per
peer until the peer leaves the registry) and copies the planned runs out of it: one
``memcpy`` per run, no socket, no port. The layouts were checked against the handle before
(``DecodeWorker.unreadable``).

A pool of another host can never be read: :class:`LinkRefused` (a deployment mistake,
answered with an error that says so). A file that is gone (its worker stopped) is a
:class:`TransferError`: the decode worker computes the prompt itself, counted.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.engine.kv_pool import KVPool
from pdserve.workers.transfer.base import LinkRefused, TransferError, copy_runs

if TYPE_CHECKING:
    from nats.aio.client import Client

PROTOCOL = "shm"


def shm_endpoint(host: str, worker_id: str, path: str, address: int) -> str:
    return f"{PROTOCOL}:{host}:{worker_id}:{path}@{address}"


def parse_endpoint(endpoint: str) -> tuple[str, str, str, int]:
    """``(host, worker id, file, address)`` of an endpoint; :class:`LinkRefused` if malformed."""
    try:
        kind, host, worker_id, rest = endpoint.split(":", 3)
        path, address = rest.rsplit("@", 1)
        if kind != PROTOCOL:
            raise ValueError(kind)
        return host, worker_id, path, int(address)
    except ValueError:
        raise LinkRefused(f"{endpoint!r} is not an shm endpoint") from None


class ShmTransfer:
    """One worker's end over its shared page pool."""

    name = "shm"
    protocol = PROTOCOL

    def __init__(self, pool: KVPool, worker_id: str) -> None:
        if not pool.shared_path:
            raise TransferError("the shm backend needs the page pool in shared memory (EngineConfig.kv_shared_dir)")
        self.pool = pool
        self.host = socket.gethostname()
        self.endpoint = shm_endpoint(self.host, worker_id, pool.shared_path, pool.data_ptr)
        self._bytes = pool.tensor.view(-1).view(torch.uint8)
        self._peers: dict[str, tuple[str, torch.Tensor]] = {}  # endpoint -> (worker id, mapped bytes)
        self._lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> None:
        if address != self.pool.data_ptr or nbytes != self.pool.nbytes:
            raise TransferError("the shm backend shares whole page pools: register the worker's own pool")

    async def attach(self, nc: Client, serve: bool, crash: Callable[[str, BaseException], None]) -> None:
        """Nothing to attach: peers map the pool's file."""

    def _mapped(self, endpoint: str) -> torch.Tensor:
        with self._lock:
            known = self._peers.get(endpoint)
        if known is not None:
            return known[1]
        host, worker_id, path, _ = parse_endpoint(endpoint)
        if host != self.host:
            raise LinkRefused(
                f"{endpoint}: a pool of host {host}, this is {self.host}: the shm backend moves KV between the "
                "processes of one host (use mooncake across hosts)"
            )
        try:
            nbytes = os.path.getsize(path)
            mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except OSError as exc:
            raise TransferError(f"{endpoint}: that worker's page pool is gone ({exc.strerror})") from None
        with self._lock:
            self._peers[endpoint] = (worker_id, mapped)
        return mapped

    def read(self, endpoint: str, reads: Sequence[tuple[int, int, int]]) -> int:
        src = self._mapped(endpoint)
        return copy_runs(self._bytes, self.pool.data_ptr, src, parse_endpoint(endpoint)[3], reads)

    def retain(self, live: set[str]) -> None:
        """Unmap the pools of peers that left the registry."""
        with self._lock:
            for endpoint in [e for e, (w, _) in self._peers.items() if w not in live]:
                del self._peers[endpoint]

    def counts(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        with self._lock:
            self._peers.clear()
