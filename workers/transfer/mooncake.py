"""Mooncake ``TransferEngine`` backend: peer-to-peer handshake, ``tcp`` or ``rdma``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pdserve.workers.transfer.base import TransferError, advertised_host

if TYPE_CHECKING:
    from mooncake.engine import TransferEngine
    from nats.aio.client import Client

log = logging.getLogger(__name__)


class MooncakeTransfer:
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> None:
        """``host`` is advertised to peers in ``endpoint``; a wildcard becomes this machine's
        address (Mooncake's tcp transport listens on every interface whatever it is given)."""
        host = advertised_host(host)
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's glog INFO lines are noise
        # With its tcp connection pool, a failed read costs about a second and may hold up the
        # next read from that peer for as long; without it both take milliseconds, and a
        # successful read is as fast (measured: 64 x 1 MiB at 2 GB/s either way).
        os.environ.setdefault("MC_TCP_ENABLE_CONNECTION_POOL", "0")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError(
                "Mooncake is not installed or cannot load: install pdserve[cpu] (needs Debian's libibverbs1) "
                f"or pdserve[gpu]: {exc}"
            ) from None
        self._engine: TransferEngine | None = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host}, {protocol}, {device_name!r}) returned {rc}")
        self.protocol = protocol
        self.endpoint = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[tuple[int, int]] = []

    def _live(self) -> TransferEngine:
        if self._engine is None:
            raise TransferError("this Mooncake transfer engine is closed")
        return self._engine

    def register(self, address: int, nbytes: int) -> None:
        rc = self._live().register_memory(address, nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory returned {rc}")
        self._registered.append((address, nbytes))

    async def attach(self, nc: Client, serve: bool, crash: Callable[[str, BaseException], None]) -> None:
        """Nothing to do: Mooncake's own RPC port is its control plane."""

    def read(self, endpoint: str, reads: Sequence[tuple[int, int, int]]) -> int:
        if not reads:
            return 0
        local = [r[0] for r in reads]
        remote = [r[1] for r in reads]
        lengths = [r[2] for r in reads]
        rc = self._live().batch_transfer_sync_read(endpoint, local, remote, lengths)
        if rc != 0:
            raise TransferError(f"Mooncake read of {len(reads)} segments from {endpoint} returned {rc}")
        return len(reads)

    def retain(self, live: set[str]) -> None:
        """Nothing is kept per peer."""

    def counts(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """Unregisters the memory and lets go of the engine, so that it is torn down here, while its
        peers may still be up, rather than whenever the garbage collector reaches it (a closed store
        client's engine torn down by the collector after its master had gone hung a test run for good
        in its connection threads' shutdown; see ``StoreTier.close``). A second close does nothing."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        for address, _ in self._registered:
            engine.unregister_memory(address)
        self._registered.clear()
