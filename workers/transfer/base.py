"""What a transfer backend does, and the read plan shared by all of them."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Protocol

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")


class TransferError(RuntimeError):
    """A pull failed; the caller falls back to recomputing the prefill."""


class TransferBackend(Protocol):
    """``endpoint`` is what peers connect to (``host:port``); ``protocol`` the transport
    (Mooncake: ``tcp`` or ``rdma``), which both ends of a transfer must share."""

    name: str
    endpoint: str
    protocol: str

    def register(self, address: int, nbytes: int) -> None:
        """Make ``[address, address + nbytes)`` readable by peers (and writable locally)."""

    def read(self, endpoint: str, reads: Sequence[tuple[int, int, int]]) -> None:
        """Copy ``(local_address, remote_address, nbytes)`` ranges from the peer, in one batch.

        Blocks until done; raises :class:`TransferError` on failure.
        """

    def close(self) -> None: ...


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
