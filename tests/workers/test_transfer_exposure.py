"""What the pinned Mooncake wheel exposes, as docs/security.md states it: its tcp transport
listens on every interface whatever host it is given; anyone who connects to its data port
reads and writes registered memory (the KV page pool) without credentials; an address outside
the registered memory is refused, by a raw connection and by a peer engine alike.

If a newer wheel changes any of this, these tests fail: update docs/security.md with them."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from pdserve.workers.transfer import create_transfer
from pdserve.workers.transfer.base import TransferError, advertised_host
from pdserve.workers.transfer.mooncake import MooncakeTransfer
from tests.workers.listening import listening_ports

READ, WRITE = 0, 1  # the opcode of the tcp transport's 24-byte request header


def _header(nbytes: int, address: int, opcode: int) -> bytes:
    return struct.pack("<QQB7x", nbytes, address, opcode)


def _talk(port: int, request: bytes, want: int, host: str = "127.0.0.1") -> bytes:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(request)
        s.settimeout(2)
        data = b""
        try:
            while len(data) < want:
                part = s.recv(want - len(data))
                if not part:
                    break
                data += part
        except TimeoutError:
            pass
        return data


@pytest.fixture
def engine() -> Iterator[tuple[MooncakeTransfer, int, ctypes.Array[ctypes.c_char]]]:
    """A Mooncake engine told to use 127.0.0.1, its tcp data port, and a registered 4 KiB page."""
    before = listening_ports(os.getpid())
    transfer = create_transfer("mooncake", host="127.0.0.1", protocol="tcp")
    assert isinstance(transfer, MooncakeTransfer)
    page = ctypes.create_string_buffer(b"KV-PAGE-" * 512, 4096)
    transfer.register(ctypes.addressof(page), len(page))
    rpc_port = int(transfer.endpoint.rsplit(":", 1)[1])
    new = {p: a for p, a in listening_ports(os.getpid()).items() if p not in before}
    (data_port,) = [p for p in new if p != rpc_port]
    yield transfer, data_port, page
    transfer.close()


def test_mooncake_listens_on_every_interface_whatever_host_it_is_given(engine) -> None:  # type: ignore[no-untyped-def]
    transfer, data_port, _ = engine
    rpc_port = int(transfer.endpoint.rsplit(":", 1)[1])
    listening = listening_ports(os.getpid())
    assert transfer.endpoint.startswith("127.0.0.1:")
    assert listening[data_port] == "any" and listening[rpc_port] == "any"
    outward = advertised_host("0.0.0.0")
    if outward.startswith("127."):
        pytest.skip("this machine has no address besides loopback")
    # Reachable on the machine's outward address, though it was told 127.0.0.1.
    with socket.create_connection((outward, data_port), timeout=5):
        pass


def test_anyone_who_connects_reads_and_writes_registered_memory(engine) -> None:  # type: ignore[no-untyped-def]
    _, data_port, page = engine
    address = ctypes.addressof(page)
    assert _talk(data_port, _header(64, address, READ), 64) == b"KV-PAGE-" * 8
    _talk(data_port, _header(16, address, WRITE) + b"WRITTEN-BY-ANY1-", 1)
    deadline = time.monotonic() + 5
    while page.raw[:16] != b"WRITTEN-BY-ANY1-" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert page.raw[:16] == b"WRITTEN-BY-ANY1-"


def test_an_unregistered_address_is_refused(engine) -> None:  # type: ignore[no-untyped-def]
    transfer, data_port, _ = engine
    secret = ctypes.create_string_buffer(b"NOT-REGISTERED-" * 8)
    assert _talk(data_port, _header(64, ctypes.addressof(secret), READ), 64) == b""
    # A peer engine's read of it fails too.
    peer = create_transfer("mooncake", host="127.0.0.1", protocol="tcp")
    landing = ctypes.create_string_buffer(4096)
    peer.register(ctypes.addressof(landing), len(landing))
    try:
        with pytest.raises(Exception, match="returned"):
            peer.read(transfer.endpoint, [(ctypes.addressof(landing), ctypes.addressof(secret), 64)])
    finally:
        peer.close()
    assert b"NOT-REGISTERED" not in landing.raw


def test_close_tears_the_engine_down_then_and_there() -> None:
    """Closing lets go of the engine, so its ports close at once rather than whenever the garbage
    collector reaches it (a collected store client's engine, its master gone, hung a test run);
    a closed engine refuses work clearly and a second close does nothing."""
    before = listening_ports(os.getpid())
    transfer = create_transfer("mooncake", host="127.0.0.1", protocol="tcp")
    page = ctypes.create_string_buffer(4096)
    transfer.register(ctypes.addressof(page), len(page))
    opened = set(listening_ports(os.getpid())) - set(before)
    assert len(opened) == 2  # its rpc and data ports
    transfer.close()
    deadline = time.monotonic() + 5
    while opened & set(listening_ports(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not opened & set(listening_ports(os.getpid()))
    with pytest.raises(TransferError, match="closed"):
        transfer.read("127.0.0.1:1", [(ctypes.addressof(page), 0, 64)])
    transfer.close()
