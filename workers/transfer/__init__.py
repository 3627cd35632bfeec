"""KV transfer backends: a small registry and a factory that imports lazily."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.workers.transfer.base import (
    LinkRefused,
    ReadStuck,
    TransferBackend,
    TransferError,
    advertised_host,
    plan_reads,
)

if TYPE_CHECKING:
    from pdserve.engine.kv_pool import KVPool

# Each factory takes what it needs of a worker's transfer settings and ignores the rest.
_BACKENDS: dict[str, Callable[..., TransferBackend]] = {}


def _mooncake(host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "", **_: object) -> TransferBackend:
    from pdserve.workers.transfer.mooncake import MooncakeTransfer

    return MooncakeTransfer(host=host, protocol=protocol, device_name=device_name)


def _p2p(name: str) -> Callable[..., TransferBackend]:
    def create(
        pool: KVPool, worker_id: str, host: str = "127.0.0.1", timeout: float = 10.0, **_: object
    ) -> TransferBackend:
        from pdserve.workers.transfer.p2p import P2PTransfer

        return P2PTransfer(name, pool, worker_id, host=host, timeout=timeout)

    return create


def _local(pool: KVPool, worker_id: str, **_: object) -> TransferBackend:
    from pdserve.workers.transfer.local import LocalTransfer

    return LocalTransfer(pool, worker_id)


def _shm(pool: KVPool, worker_id: str, **_: object) -> TransferBackend:
    from pdserve.workers.transfer.shm import ShmTransfer

    return ShmTransfer(pool, worker_id)


def _ipc(pool: KVPool, worker_id: str, **_: object) -> TransferBackend:
    from pdserve.workers.transfer.ipc import IpcTransfer

    return IpcTransfer(pool, worker_id)


_BACKENDS["mooncake"] = _mooncake
_BACKENDS["shm"] = _shm  # CPU pools of one host, through /dev/shm
_BACKENDS["ipc"] = _ipc  # CUDA pools of one host (one GPU or peers), through CUDA IPC
_BACKENDS["local"] = _local  # the two workers of one `pdserve colocated` process
_BACKENDS["nccl"] = _p2p("nccl")  # CUDA pools, GPU to GPU
_BACKENDS["gloo"] = _p2p("gloo")  # CPU pools, over TCP: the same protocol as nccl


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_transfer(name: str, **kwargs: object) -> TransferBackend:
    """A started backend by name (``mooncake``, ``nccl``, ``gloo``, ``local``, ``shm``, ``ipc``); raises ``ValueError``
    for unknown names, :class:`TransferError` when it cannot start here."""
    try:
        factory = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown transfer backend {name!r}; available: {', '.join(available_backends())}") from None
    return factory(**kwargs)


__all__ = [
    "LinkRefused",
    "ReadStuck",
    "TransferBackend",
    "TransferError",
    "advertised_host",
    "available_backends",
    "create_transfer",
    "plan_reads",
]
