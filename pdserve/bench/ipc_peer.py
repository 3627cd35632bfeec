"""A prefill-like peer process holding a CUDA page pool exported over the ``ipc`` backend,
for ``tests/workers/test_ipc_transfer.py`` and ``bench/probes/ipc_probe.py``.

The peer is started with multiprocessing's ``spawn`` (CUDA cannot be used in a forked
child), fills its pool with :func:`pattern` and sends back its endpoint; the caller then
reads the pool through its own ``ipc`` backend and compares what it read with
:func:`pattern`, byte for byte. Every wait is bounded: a peer that does not answer in
time is killed and the caller gets a :class:`PeerError` saying which step it missed.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.schemas import KVLayout

START_TIMEOUT = 120.0  # spawn, import torch, create a CUDA context, allocate and fill the pool
STOP_TIMEOUT = 30.0
_CHUNK_WORDS = 1 << 24


class PeerError(RuntimeError):
    """The peer process failed, or did not answer in time."""


def pattern(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` bytes (a multiple of 4) that depend on their index and ``seed`` alone: 32-bit
    words ``(i * 2654435761 + seed) mod 2**32``, the same on every device and in every process."""
    assert nbytes % 4 == 0, nbytes
    words = torch.empty(nbytes // 4, dtype=torch.int32, device=device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        end = min(start + _CHUNK_WORDS, words.numel())
        value = (torch.arange(start, end, dtype=torch.int64, device=device) * 2654435761 + seed) & 0xFFFFFFFF
        words[start:end] = torch.where(value >= 1 << 31, value - (1 << 32), value).to(torch.int32)
    return words.view(torch.uint8)


def _serve(conn: Connection, layout: dict[str, Any], num_pages: int, device: str, seed: int) -> None:
    """The peer's whole life: pool, pattern, export; then wait for ``stop`` (or the caller's end)."""
    try:
        from pdserve.engine.kv_pool import KVPool
        from pdserve.workers.transfer import create_transfer

        where = torch.device(device)
        torch.cuda.set_device(where)
        pool = KVPool(KVLayout(**layout), num_pages, where)
        pool.tensor.view(-1).view(torch.uint8).copy_(pattern(pool.nbytes, seed, where))
        transfer = create_transfer("ipc", pool=pool, worker_id="peer")
        transfer.register(pool.data_ptr, pool.nbytes)
        torch.cuda.synchronize(where)
        conn.send(("ready", transfer.endpoint, pool.data_ptr, pool.page_bytes))
    except BaseException:  # everything goes back to the caller, who raises it
        conn.send(("error", traceback.format_exc()))
        return
    try:
        conn.recv()  # "stop", or EOFError when the caller is gone
    except EOFError:
        pass
    transfer.close()


@dataclass
class Peer:
    """A running peer: its process, endpoint and pool (address and page bytes)."""

    process: Any
    conn: Connection
    endpoint: str
    address: int
    page_bytes: int

    def segments(self, pages: list[int]) -> list[tuple[int, int]]:
        """``(address, nbytes)`` runs of the peer's ``pages``, as a KV handle names them."""
        from pdserve.engine.kv_pool import page_runs

        return [(self.address + first * self.page_bytes, n * self.page_bytes) for first, n in page_runs(pages)]

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Ask the peer to end; killed if it has not within ``timeout``."""
        try:
            self.conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


def start_peer(
    layout: KVLayout, num_pages: int, device: str = "cuda:0", seed: int = 1, timeout: float = START_TIMEOUT
) -> Peer:
    """A peer process with a pool of ``num_pages`` on ``device`` filled with ``pattern(..., seed)``,
    exported; raises :class:`PeerError` if it fails or is not ready within ``timeout``."""
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    process = context.Process(
        target=_serve, args=(theirs, dataclasses.asdict(layout), num_pages, device, seed), daemon=True
    )
    process.start()
    theirs.close()
    try:
        if not mine.poll(timeout):
            raise PeerError(f"the peer process on {device} was not ready within {timeout:g}s")
        reply = mine.recv()
    except EOFError:
        reply = ("error", f"the peer process ended (exit code {process.exitcode}) before it was ready")
    except PeerError:
        process.kill()
        process.join(5)
        raise
    if reply[0] != "ready":
        process.join(STOP_TIMEOUT)
        if process.is_alive():
            process.kill()
        raise PeerError(f"the peer process on {device} failed:\n{reply[1]}")
    _, endpoint, address, page_bytes = reply
    return Peer(process, mine, endpoint, address, page_bytes)
