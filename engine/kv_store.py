"""The Mooncake Store tier: page groups in Mooncake's distributed store, shared by every
worker that reaches its master (``pdserve up --kv-store`` starts one).

Each worker is a store client; by default it lends the store none of its memory
(``segment_bytes`` 0), so objects live in a store server's memory (``pdserve up
--kv-store`` starts one) and outlive any worker. The master places and evicts objects. Keys
are ``pdserve/<identity hex>/<key hex>``; values are :mod:`.kv_blob` blobs, checked on
every read like the disk tier's files. Puts run on the tiers' writer thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.kv_buffers import ReadBuffer

log = logging.getLogger(__name__)

PREFIX = "pdserve"
_NOT_FOUND = -704  # the client's get_into of a key it does not hold (OBJECT_NOT_FOUND)
WARM_CALLS = 3  # lookups a new client makes of the master at start (its connection's first calls are slow)


class StoreError(RuntimeError):
    pass


class StoreTier:
    name = "store"
    local = False  # its master is a round trip away
    shared = True  # other workers' groups may be here from the start: measured at start (kv_write)

    def __init__(
        self,
        master: str,
        metadata: str,
        ident: bytes,
        host: str = "127.0.0.1",
        segment_bytes: int = 0,
        buffer_bytes: int = 64 << 20,
    ) -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")  # the store client's glog INFO lines are noise
        from mooncake.store import MooncakeDistributedStore  # lazy: only workers with a store tier need it

        self._store: Any = MooncakeDistributedStore()
        rc = self._store.setup(host, metadata, segment_bytes, buffer_bytes, "tcp", "", master)
        if rc != 0:
            raise StoreError(f"Mooncake Store setup against master {master} (metadata {metadata}) failed: {rc}")
        self._prefix = f"{PREFIX}/{ident.hex()}/"
        # One client, called from the engine's thread (lookups), the writer (puts) and a load's
        # reader threads at once, as Mooncake's own asyncio wrapper calls it from a thread pool;
        # a read waited for the writer's puts under one lock before (a load's four groups read
        # one at a time). The lock guards buffer registration and closing.
        self._lock = threading.Lock()
        self._registered: set[int] = set()  # read buffers registered with the client (get_into)
        self._closed = False
        # The client's first calls to the master set up its connection (8 and 4 ms against 0.1
        # for later lookups on this CPU, 2026-12-06): made here, at start, not in a request's
        # time to first token, nor as the first readings of the tier's round trip.
        for _ in range(WARM_CALLS):
            self._store.batch_is_exist([self._prefix + "warm"])

    def _key(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def contains(self, key: bytes) -> bool:
        return bool(self._store.is_exist(self._key(key)) == 1)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is held, in one round trip to the master (a lookup of an
        8,192-token prefix asked 128 times, one at a time: 33 ms a turn on an H200's loopback)."""
        if not keys:
            return []
        found = self._store.batch_is_exist([self._key(k) for k in keys])
        return [r == 1 for r in found]

    def get(self, key: bytes) -> bytearray | None:
        data = self._store.get(self._key(key))
        return bytearray(data) if data else None  # writable: kv_blob.decode views it in place

    def get_into(self, key: bytes, buffer: ReadBuffer) -> memoryview | bytearray | None:
        """The object read straight into ``buffer`` (registered with the client at its first
        use; no copy through Python bytes), or ``None`` if the store does not hold it; an
        object that does not fit (not a group of this layout: ``kv_blob.decode`` calls it
        corrupt) or another failure of the read is fetched as :meth:`get` fetches."""
        out = buffer.view()
        ptr, size = buffer.address, buffer.size
        with self._lock:  # a buffer another thread is registering is waited for
            self._register([buffer])
        got = self._store.get_into(self._key(key), ptr, size)
        if got == _NOT_FOUND:
            return None
        if got < 0:
            return self._read_again(key, got)
        return out[:got]

    def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[ReadBuffer]
    ) -> list[memoryview | bytearray | None]:
        """:meth:`get_into` of each of ``keys`` into the buffer beside it, in one call to the
        client (its batch read: on loopback tcp 2.1-2.3 GB/s of 7 MB groups against 1.3 for
        four threads each reading one, 2026-12-05, bench/probes/tier_read_probe.py --store)."""
        with self._lock:
            self._register(buffers)
        got = self._store.batch_get_into(
            [self._key(k) for k in keys], [b.address for b in buffers], [b.size for b in buffers]
        )
        out: list[memoryview | bytearray | None] = []
        for key, buffer, n in zip(keys, buffers, got, strict=True):
            if n == _NOT_FOUND:
                out.append(None)
            elif n < 0:
                out.append(self._read_again(key, n))
            else:
                out.append(buffer.view()[:n])
        return out

    def _read_again(self, key: bytes, rc: int) -> bytearray | None:
        """A read into a buffer that failed with ``rc`` (an object that does not fit: not a group
        of this layout, which the blob's checks then call corrupt; or a transfer error), done
        again as :meth:`get` reads, and logged."""
        log.warning("Mooncake Store read into a buffer failed: read again", extra={"key": key.hex(), "rc": rc})
        return self.get(key)

    def prepare(self, buffers: Sequence[ReadBuffer]) -> int:
        """Register ``buffers`` with the client (once each: a read into one must not pay it);
        returns how many were new."""
        with self._lock:
            return self._register(buffers)

    def _register(self, buffers: Sequence[ReadBuffer]) -> int:
        new = 0  # (the lock held)
        for buffer in buffers:
            if buffer.address not in self._registered:
                self._registered.add(buffer.address)
                self._store.register_buffer(buffer.address, buffer.size)
                new += 1
        return new

    def put(self, key: bytes, *parts: bytes | memoryview) -> None:
        """Store the blob ``parts`` make up under ``key`` (several parts: one object, no copy
        joining them first)."""
        if len(parts) == 1:
            rc = self._store.put(self._key(key), parts[0])
        else:
            rc = self._store.put_parts(self._key(key), *parts)
        if rc != 0:  # the store is full of leased objects, or the master is away: the writer counts it
            raise StoreError(f"Mooncake Store put failed: {rc}")

    def discard(self, key: bytes) -> None:
        self._store.remove(self._key(key))

    def close(self) -> None:
        """Close the client and let go of it here: its transfer engine is torn down now, while
        the master is still there, not whenever the garbage collector reaches this object (a
        test run hung there for good, 2026-12-07: a closed tier's client collected in a later
        test, after its master had gone, its destructor joining a connection thread that spun)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                store, self._store = self._store, None
                store.close()
                del store
