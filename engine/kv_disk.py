"""The disk tier: one file per page group in a directory, local or a shared mount.

Files live under ``<dir>/<identity hex>/<key hex>.kv`` (the identity names model and
KV layout, see :mod:`.kv_blob`), are written under a temporary name and renamed into
place (a reader never sees half a file, a crash leaves only a temporary to sweep), and
are reusable by any worker of the same model and layout, across restarts. The tier
keeps its directory within ``max_bytes``: it knows the files it found at start and
those it wrote, and removes the least recently used when a write passes the bound
(other workers sharing the directory bound their own writes the same way). Reads and
writes block: the tiers' writer thread writes, loads run when a prefix is attached.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.kv_buffers import ReadBuffer

TMP_SUFFIX = ".tmp"


class DiskTier:
    name = "disk"
    local = True

    def __init__(self, root: Path, ident: bytes, max_bytes: int) -> None:
        assert max_bytes > 0
        self.dir = Path(root) / ident.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._files: OrderedDict[str, int] = OrderedDict()  # name -> size, least recently used first
        self.num_bytes = 0
        self.num_evicted = 0
        self._lock = threading.Lock()  # the writer thread puts, the engine's loop reads
        self._prefix = os.path.join(str(self.dir), "")  # of a file's path (contains)
        self._scan()

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(TMP_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)  # a write cut short by a crash
            elif entry.name.endswith(".kv"):
                st = entry.stat()
                found.append((st.st_mtime, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self.num_bytes += size
        self._evict()

    def path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kv"

    def sample_keys(self, n: int) -> list[bytes]:
        """The keys of up to ``n`` groups held (the most recently used first): the tiers time
        reading them back at start (:meth:`KVTiers.calibrate`)."""
        with self._lock:
            names = list(itertools.islice(reversed(self._files), n))
        return [bytes.fromhex(name.removesuffix(".kv")) for name in names]

    def contains(self, key: bytes) -> bool:
        # (a stat of a joined string: through pathlib each took 3x as long, on the engine's
        # thread at every lookup)
        return os.path.exists(self._prefix + key.hex() + ".kv")

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def get(self, key: bytes) -> bytearray | None:
        """The file's bytes, or ``None`` if there is none (removed meanwhile included); read
        into a ``bytearray`` that :func:`kv_blob.decode` views in place (no second copy)."""
        data = self._read(key, None)
        assert not isinstance(data, memoryview)
        return data

    def get_into(self, key: bytes, buffer: ReadBuffer) -> memoryview | bytearray | None:
        """The file's bytes read into ``buffer`` (a view of its first bytes), or ``None`` if
        there is none; a file of another size than the buffer (not a blob of this layout's
        group: :func:`kv_blob.decode` calls it corrupt) is read as :meth:`get` reads."""
        return self._read(key, buffer.view())

    def _read(self, key: bytes, out: memoryview | None) -> memoryview | bytearray | None:
        """The file into ``out`` if it is exactly that size, else into a fresh ``bytearray``
        (shortened if the file was meanwhile: decode calls it corrupt); ``None``: no file."""
        try:
            with open(self.path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if out is not None and size == len(out):
                    data: memoryview | bytearray = out[: f.readinto(out)]
                else:
                    data = bytearray(size)
                    del data[f.readinto(data) :]
        except FileNotFoundError:
            return None
        with self._lock:
            if key.hex() + ".kv" in self._files:
                self._files.move_to_end(key.hex() + ".kv")
        return data

    def prepare(self, buffers: Sequence[ReadBuffer]) -> int:
        """Nothing to do before reading into ``buffers`` (a file reads into any memory): 0."""
        return 0

    def put(self, key: bytes, *parts: bytes | memoryview) -> None:
        """Write the blob ``parts`` make up under ``key`` (write, then rename), then evict down
        to the bound. Parts are written one after another (no copy joins them)."""
        size = sum(len(p) for p in parts)
        if size > self.max_bytes:
            return
        target = self.path(key)
        tmp = target.with_name(f"{target.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, target)
        with self._lock:
            old = self._files.pop(target.name, 0)
            self._files[target.name] = size
            self.num_bytes += size - old
            self._evict()

    def discard(self, key: bytes) -> None:
        """Remove a file found corrupt, so no one reads it again."""
        name = self.path(key).name
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))
        with self._lock:
            self.num_bytes -= self._files.pop(name, 0)

    def _evict(self) -> None:
        while self.num_bytes > self.max_bytes and self._files:
            name, size = self._files.popitem(last=False)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / name)
            self.num_bytes -= size
            self.num_evicted += 1
