"""What a transfer backend does, and the read plan shared by all of them."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from nats.aio.client import Client

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")
# The backends bound to one device type, and that type (the point-to-point ones, shm, ipc).
P2P_DEVICES = {"nccl": "cuda", "gloo": "cpu", "shm": "cpu", "ipc": "cuda"}


class TransferError(RuntimeError):
    """A pull failed; the caller falls back to recomputing the prefill."""


class ReadStuck(TransferError):
    """A read that may still be writing into the destination pages after its caller stopped
    waiting (stuck in the transfer engine, or a tensor-parallel rank's part past its time):
    those pages must never be used or reused, so the worker stops."""


class LinkRefused(TransferError):
    """The peer will not pair with this worker: its KV layout, backend or device differs.
    A deployment mistake, not a passing failure: the request gets an error saying what
    differs (recomputing would hide it)."""


class TransferBackend(Protocol):
    """``endpoint`` is what peers connect to (Mooncake: ``host:port``; ``nccl``/``gloo``:
    the worker id, reached over NATS); ``protocol`` the transport (Mooncake: ``tcp`` or
    ``rdma``; else the backend's name), which both ends of a transfer must share."""

    name: str
    endpoint: str
    protocol: str

    def register(self, address: int, nbytes: int) -> None:
        """Make ``[address, address + nbytes)`` readable by peers (and writable locally)."""

    async def attach(self, nc: Client, serve: bool, crash: Callable[[str, BaseException], None]) -> None:
        """Connect the backend's control plane, if it has one, to NATS. ``serve``: answer
        peers that read from this worker (a prefill worker). ``crash`` ends the worker
        (a background job of the backend that failed in a way it does not expect)."""

    def read(self, endpoint: str, reads: Sequence[tuple[int, int, int]]) -> int:
        """Copy ``(local_address, remote_address, nbytes)`` ranges from the peer, in one batch.

        Blocks until done; returns the number of transport operations it took; raises
        :class:`TransferError` on failure (:class:`LinkRefused` when it never can work).
        """

    def retain(self, live: set[str]) -> None:
        """Drop what is kept per peer (communicators) for peers not in ``live`` (worker ids)."""

    def counts(self) -> dict[str, int]:
        """The backend's own :class:`~pdserve.schemas.WorkerCounters` fields, so far."""

    def close(self) -> None: ...


def backend_device_error(backend: str, device_type: str) -> str | None:
    """Why ``backend`` cannot move a pool on ``device_type`` (naming one that can), or ``None``."""
    wanted = P2P_DEVICES.get(backend)
    if wanted is None or wanted == device_type:
        return None
    fits = [b for b, d in P2P_DEVICES.items() if d == device_type]
    hint = f" (a {device_type} pool moves over {fits[0]} or mooncake)" if fits else ""
    return f"the {backend} backend moves {wanted} pools, not {device_type} ones{hint}"


def plan_reads(
    remote_segments: Sequence[Sequence[int]],
    page_bytes: int,
    local_pages: Sequence[int],
    local_base: int,
    skip_pages: int = 0,
) -> list[tuple[int, int, int]]:
    """Reads that copy remote pages ``skip_pages..`` into ``local_pages[skip_pages..]``.

    ``remote_segments`` are ``(address, nbytes)`` runs of whole pages in page order.
    Adjacent pages contiguous on both sides merge into one read, so a request costs
    as many reads as there are breaks in either side's page runs.
    """
    remote_pages: list[int] = []
    for address, nbytes in remote_segments:
        if nbytes % page_bytes:
            raise TransferError(f"segment of {nbytes} bytes is not whole pages of {page_bytes}")
        remote_pages.extend(address + i * page_bytes for i in range(nbytes // page_bytes))
    if len(remote_pages) != len(local_pages):
        raise TransferError(f"remote has {len(remote_pages)} pages, local reserved {len(local_pages)}")
    reads: list[tuple[int, int, int]] = []
    for i in range(skip_pages, len(local_pages)):
        local = local_base + local_pages[i] * page_bytes
        remote = remote_pages[i]
        if reads and reads[-1][0] + reads[-1][2] == local and reads[-1][1] + reads[-1][2] == remote:
            last = reads[-1]
            reads[-1] = (last[0], last[1], last[2] + page_bytes)
        else:
            reads.append((local, remote, page_bytes))
    return reads


def pages_of(base: int, page_bytes: int, runs: Sequence[tuple[int, int]], num_pages: int) -> list[int]:
    """The page ids that ``(address, nbytes)`` runs of a pool at ``base`` cover, in order.

    Raises :class:`TransferError` for a run that is not whole pages inside the pool."""
    pages: list[int] = []
    for address, nbytes in runs:
        offset = address - base
        if offset < 0 or offset % page_bytes or nbytes <= 0 or nbytes % page_bytes:
            raise TransferError(f"({address:#x}, {nbytes}) is not a run of whole pages of this pool")
        first = offset // page_bytes
        count = nbytes // page_bytes
        if first + count > num_pages:
            raise TransferError(f"pages {first}..{first + count - 1} are outside a pool of {num_pages}")
        pages.extend(range(first, first + count))
    return pages


def advertised_host(host: str) -> str:
    """The address peers should use for ``host``: a wildcard (``0.0.0.0``, ``::``) names
    no machine, so it becomes this machine's outward address (the interface the default
    route leaves by; no packet is sent), else its hostname's address, else loopback."""
    if host not in WILDCARD_HOSTS:
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = str(probe.getsockname()[0])
        except OSError:
            address = ""
    if address and address != "0.0.0.0":
        return address
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def copy_runs(
    dst: torch.Tensor, dst_base: int, src: torch.Tensor, src_base: int, reads: Sequence[tuple[int, int, int]]
) -> int:
    """Copy ``(local_address, remote_address, nbytes)`` runs between two pools this process
    can address, given as flat byte tensors based at ``dst_base`` and ``src_base`` (queued on
    the current stream); every run is checked to lie inside both first. Returns the copies."""
    spans = [(local - dst_base, address - src_base, nbytes) for local, address, nbytes in reads]
    for (lo, ro, nbytes), (_, address, _) in zip(spans, reads, strict=True):
        if lo < 0 or ro < 0 or lo + nbytes > dst.numel() or ro + nbytes > src.numel():
            raise TransferError(f"read of {nbytes} bytes at {address:#x} lies outside the pools")
    for lo, ro, nbytes in spans:
        dst[lo : lo + nbytes].copy_(src[ro : ro + nbytes], non_blocking=True)
    return len(spans)
