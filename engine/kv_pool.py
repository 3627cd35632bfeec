"""The KV page pool: one tensor per worker, registered whole with the transfer engine.

Layout ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``: a page holds
all layers' K and V for ``page_size`` tokens, so a request's KV is a few contiguous
runs of pages — few, large transfer segments (Mooncake over tcp costs about 16 µs a segment).
Inside a page each (layer, K|V, head) is one ``[page_size, head_dim]`` row block, so
attention gathers a sequence's pages straight into ``[batch, heads, tokens, head_dim]``.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from pdserve.schemas import KVLayout

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}") from None


SHARED_PREFIX = "pdserve-kv-"


class KVPool:
    """Owns the pool tensor; knows page addresses. No allocation policy here.

    ``shared_dir`` (CPU pools): the pool lives in a file of its own there (``/dev/shm``: shared
    memory), readable and writable by this user only, that other processes of this host map
    (the ``shm`` transfer backend); :meth:`close` removes it, and a pool removes the files of
    processes that died without closing theirs."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device, shared_dir: str = "") -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        shape = (num_pages, layout.num_layers, 2, layout.num_kv_heads, layout.page_size, layout.head_dim)
        dtype = dtype_from_name(layout.dtype)
        self.shared_path = ""
        if shared_dir:
            if device.type != "cpu":
                raise ValueError("a shared-memory page pool is a CPU pool")
            self.shared_path = _shared_file(Path(shared_dir), math.prod(shape) * dtype.itemsize)
            self.tensor = torch.from_file(self.shared_path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
            return
        pin = device.type == "cpu" and torch.cuda.is_available()
        self.tensor = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

    def close(self) -> None:
        """Remove the pool's shared file (its mapping stays valid for whoever holds it)."""
        if self.shared_path:
            Path(self.shared_path).unlink(missing_ok=True)

    @property
    def page_bytes(self) -> int:
        return self.layout.page_numel * self.tensor.element_size()

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def page_address(self, page: int) -> int:
        return self.data_ptr + page * self.page_bytes

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page ``src``'s KV (every layer) into page ``dst`` (queued on the device's stream)."""
        self.tensor[dst].copy_(self.tensor[src], non_blocking=True)

    def segments(self, pages: Sequence[int]) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each maximal run of consecutive page ids, in order."""
        return [(self.page_address(start), n * self.page_bytes) for start, n in page_runs(pages)]


def page_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first_page, count), ...]`` of consecutive ids, preserving order."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def bytes_per_token(layout: KVLayout, element_size: int) -> int:
    return layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * element_size


def _shared_file(directory: Path, nbytes: int) -> str:
    """A new file of ``nbytes`` (zeros, not yet backed) in ``directory``, mode 0600; first
    the files of pools whose processes are gone are removed."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{SHARED_PREFIX}*"):
        pid = stale.name.removeprefix(SHARED_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            stale.unlink(missing_ok=True)
    free = os.statvfs(directory)
    if free.f_bavail * free.f_frsize < nbytes:
        raise OSError(
            f"{directory} has {free.f_bavail * free.f_frsize >> 20} MiB free, the KV pool needs {nbytes >> 20} MiB "
            "(a container's /dev/shm is often 64 MiB: give it more, or lower --max-total-tokens)"
        )
    path = directory / f"{SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return str(path)
