"""The ``local`` backend: KV handed over between the prefill and decode workers of one
process (``pdserve colocated``), device to device, never through host memory or a socket.

Each worker registers its whole page pool in a table of this process under its endpoint
(``local:<host>:<pid>:<worker id>``). A decode worker's read looks the prefill worker's
pool up there, checks that the two layouts and devices agree (a difference is refused,
saying which: the same check as the point-to-point backends' handshake), and copies the
planned runs with one device copy each, on a stream of its own that it then waits for, so
the copy neither queues behind nor stalls the decode engine's steps. On a GPU a request's
whole KV is usually one run: 235 MB of a 7B model's 4,096-token prompt is one copy at the
device's copy bandwidth (about 0.1 ms on an H200). On a CPU it is a ``memcpy``.

An endpoint of another process can never be read: that is a :class:`LinkRefused` (a
deployment mistake, answered with an error that says so), not a fallback.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.engine.kv_pool import KVPool, dtype_difference
from pdserve.workers.transfer.base import LinkRefused, TransferError, copy_runs

if TYPE_CHECKING:
    from nats.aio.client import Client

PROTOCOL = "local"
_POOLS: dict[str, KVPool] = {}
_LOCK = threading.Lock()


def local_endpoint(worker_id: str) -> str:
    return f"{PROTOCOL}:{socket.gethostname()}:{os.getpid()}:{worker_id}"


def _differences(mine: KVPool, theirs: KVPool) -> list[str]:
    here, there = mine.layout, theirs.layout
    fields = ("page_size", "num_layers", "num_kv_heads", "head_dim", "order")
    out = [
        f"{name}: prefill {getattr(there, name)}, decode {getattr(here, name)}"
        for name in fields
        if getattr(here, name) != getattr(there, name)
    ]
    dtype = dtype_difference(there, here)
    if dtype:
        out.append(dtype)
    if mine.device != theirs.device:
        out.append(f"device: prefill {theirs.device}, decode {mine.device}")
    return out


class LocalTransfer:
    """One worker's end; ``pool`` is its page pool (registered whole by :meth:`register`)."""

    name = "local"
    protocol = PROTOCOL

    def __init__(self, pool: KVPool, worker_id: str) -> None:
        self.pool = pool
        self.endpoint = local_endpoint(worker_id)
        self._bytes = pool.tensor.view(-1).view(torch.uint8)
        self._stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self._registered = False

    def register(self, address: int, nbytes: int) -> None:
        if address != self.pool.data_ptr or nbytes != self.pool.nbytes:
            raise TransferError("the local backend hands over whole page pools: register the worker's own pool")
        with _LOCK:
            _POOLS[self.endpoint] = self.pool
        self._registered = True

    async def attach(self, nc: Client, serve: bool, crash: Callable[[str, BaseException], None]) -> None:
        """Nothing to attach: peers find the pool in this process's table."""

    def read(self, endpoint: str, reads: Sequence[tuple[int, int, int]]) -> int:
        if not endpoint.startswith(local_endpoint("")):
            raise LinkRefused(
                f"{endpoint} is not a page pool of this process: the local backend hands KV over only between the "
                "prefill and decode workers of one `pdserve colocated` process"
            )
        with _LOCK:
            remote = _POOLS.get(endpoint)
        if remote is None:  # its worker has stopped: the caller recomputes
            raise TransferError(f"{endpoint}: that worker's page pool is gone")
        differences = _differences(self.pool, remote)
        if differences:
            raise LinkRefused("KV layouts differ: " + "; ".join(differences))
        src = remote.tensor.view(-1).view(torch.uint8)
        if self._stream is None:
            copies = copy_runs(self._bytes, self.pool.data_ptr, src, remote.data_ptr, reads)
        else:
            with torch.cuda.stream(self._stream):
                copies = copy_runs(self._bytes, self.pool.data_ptr, src, remote.data_ptr, reads)
            self._stream.synchronize()
        return copies

    def retain(self, live: set[str]) -> None:
        """Nothing is kept per peer."""

    def counts(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        if self._registered:
            with _LOCK:
                _POOLS.pop(self.endpoint, None)
            self._registered = False
