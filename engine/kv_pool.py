"""The KV page pool: one tensor per worker, registered whole with the transfer engine.

Layout ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``: a page holds
all layers' K and V for ``page_size`` tokens, so a request's KV is a few contiguous
runs of pages — few, large transfer segments (Mooncake over tcp costs about 16 µs a segment).
Inside a page each (layer, K|V, head) is one ``[page_size, head_dim]`` row block, so
attention gathers a sequence's pages straight into ``[batch, heads, tokens, head_dim]``.

FP8 pages (``--kv-cache-dtype fp8_e4m3``, layout dtype :data:`KV_FP8`): the same blocks in the
same order, each ``[page_size, head_dim]`` float8_e4m3fn values (a token's ``head_dim`` bytes, as
in 16 bits) followed at once by the block's one float32 scale, a power of two
(:func:`pdserve.engine.quant.quantize_kv_fp8`: ``x ~= q * scale``; a store that brings a larger
token re-encodes the block's earlier ones, :func:`pdserve.engine.quant.store_kv_fp8_blocks`). A
block is ``page_size * head_dim + 4`` bytes, the scale ``page_size * head_dim`` bytes in
(4-aligned); a page is still one contiguous byte range holding everything its tokens need, so
every mover of whole pages (segments, copies, the transfer backends, the host, disk and store
tiers) moves FP8 pages unchanged, and a head's block with its scale is one run (tensor-parallel
shard reads). :attr:`KVPool.tensor` is then the raw bytes (uint8 ``[num_pages, num_layers, 2,
num_kv_heads, block bytes]``); :attr:`KVPool.kv` views the values as
``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]`` (block stride
``page_size * head_dim + 4``) and :attr:`KVPool.kv_scales` the scales as float32
``[num_pages, num_layers, 2, num_kv_heads]``. At head_dim 128 and 16-token pages a block is
2,052 bytes against bf16's 4,096: 1.996x the pages per byte (1.992x at head_dim 64).
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from pdserve.engine.models.batch import to_device
from pdserve.engine.quant import FP8, KV_SCALE_DTYPE, dequantize_kv_fp8, quantize_kv_fp8, store_kv_fp8_blocks
from pdserve.schemas import KVLayout

# The layout dtype of FP8 pages (values and a scale per block, above). It names the scheme, not
# only the values' dtype: pools of another FP8 layout (a scale per token, before 2026-12-06) are
# refused at the transfer handshake and their tier blobs are not read (kv_blob.identity).
KV_FP8 = "float8_e4m3fn/block"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, KV_FP8: FP8}


def page_index(pages: Sequence[int], device: torch.device) -> torch.Tensor:
    """``pages`` as an int64 tensor on ``device``, copied as a step's inputs are
    (:func:`~pdserve.engine.models.batch.to_device`: from pinned memory, the host not waiting):
    built with ``torch.tensor(..., device=...)`` the copy came from pageable memory, which waits
    until all the work queued before it has run (a tier write's snapshot then held a chunk's
    step until its whole prefill was done)."""
    return to_device(torch.tensor(list(pages), dtype=torch.long), device)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}") from None


def kv_dtype_name(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """The layout dtype of a pool for ``--kv-cache-dtype`` (``auto``: the model's dtype)."""
    if kv_cache_dtype == "auto":
        return dtype_name(model_dtype)
    if kv_cache_dtype == "bf16":
        return "bfloat16"
    if kv_cache_dtype == "fp8_e4m3":
        return KV_FP8
    raise ValueError(f"kv cache dtype is auto, bf16 or fp8_e4m3, not {kv_cache_dtype!r}")


def is_fp8(layout: KVLayout) -> bool:
    return layout.dtype == KV_FP8


def dtype_difference(prefill: KVLayout, decode: KVLayout) -> str | None:
    """``"dtype: prefill A, decode B"`` when two pools' dtypes differ (a pair of one FP8 pool and
    one 16-bit pool said as such: their pages hold other bytes), else ``None``."""
    if prefill.dtype == decode.dtype:
        return None
    line = f"dtype: prefill {prefill.dtype}, decode {decode.dtype}"
    if is_fp8(prefill) != is_fp8(decode):
        fp8_side = "prefill" if is_fp8(prefill) else "decode"
        line += (
            f" (the {fp8_side} pool holds FP8 KV pages, --kv-cache-dtype fp8_e4m3, the other 16-bit ones: "
            "run both with the same --kv-cache-dtype)"
        )
    return line


def block_bytes(layout: KVLayout) -> int:
    """Bytes of one (layer, K|V, head) block of a page: its values (and, FP8, their scales)."""
    if is_fp8(layout):
        return layout.page_size * layout.head_dim + KV_SCALE_DTYPE.itemsize
    return layout.page_size * layout.head_dim * dtype_from_name(layout.dtype).itemsize


def page_bytes(layout: KVLayout) -> int:
    return layout.num_layers * 2 * layout.num_kv_heads * block_bytes(layout)


def bytes_per_token(layout: KVLayout) -> float:
    """Bytes of the pool one token takes, all layers' K and V (FP8: with its share of the
    blocks' scales); a page's are :func:`pdserve.engine.quant.kv_bytes_per_page`'s."""
    return page_bytes(layout) / layout.page_size


def page_shape(layout: KVLayout) -> tuple[int, ...]:
    """The shape of one page in :attr:`KVPool.tensor` (and in the tiers' copies of pages)."""
    if is_fp8(layout):
        return (layout.num_layers, 2, layout.num_kv_heads, block_bytes(layout))
    return (layout.num_layers, 2, layout.num_kv_heads, layout.page_size, layout.head_dim)


def storage_dtype(layout: KVLayout) -> torch.dtype:
    """The dtype of :attr:`KVPool.tensor`: the values', or bytes for FP8 pages."""
    return torch.uint8 if is_fp8(layout) else dtype_from_name(layout.dtype)


def kv_views(tensor: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, scales)`` of pages ``tensor`` (shaped ``[n, *page_shape(layout)]``): the values
    ``[n, layers, 2, heads, page_size, head_dim]`` and, FP8, the float32 scales
    ``[n, layers, 2, heads]``, one per block (views of the same bytes); 16 bits: ``(tensor, None)``."""
    if not is_fp8(layout):
        return tensor, None
    page, dim = layout.page_size, layout.head_dim
    values = tensor[..., : page * dim].view(FP8).unflatten(-1, (page, dim))
    scales = tensor.view(KV_SCALE_DTYPE)[..., page * dim // KV_SCALE_DTYPE.itemsize]
    return values, scales


def store_fp8(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Vectors ``x [N, head_dim]`` quantized into an FP8 pool's ``values`` and ``scales``
    (:func:`kv_views`) at ``rows [N]``, numbered as a 16-bit pool's ``view(-1, head_dim)`` numbers
    them: ``block * page_size + offset`` (:func:`~pdserve.engine.quant.store_kv_fp8_blocks`: a
    block's rows are consecutive offsets, the tokens before them the block's own). The torch
    passes' store (the Triton kernels store in :mod:`pdserve.engine.kernels.rope` and
    :mod:`pdserve.engine.kernels.paged`, the same bytes)."""
    page, dim = values.shape[4], values.shape[5]
    store_kv_fp8_blocks(values.view(torch.uint8).view(-1, page, dim), scales.view(-1), rows // page, rows % page, x)


def round_fp8(x: torch.Tensor, page_size: int, dim: int = 0) -> torch.Tensor:
    """K or V vectors ``x [..., head_dim]`` of one prompt from its first token (along dimension
    ``dim``), as an FP8 pool holds them once stored at once into empty pages (quantized per
    ``page_size`` tokens of a head, then back in ``x``'s dtype): what a fresh prompt attends over
    when it uses its own K/V, not the pool's."""
    moved = x.movedim(dim, -2)
    n = moved.shape[-2]
    pages = -(-n // page_size)
    padded = torch.nn.functional.pad(moved, (0, 0, 0, pages * page_size - n))
    blocks = padded.unflatten(-2, (pages, page_size))
    rounded = dequantize_kv_fp8(*quantize_kv_fp8(blocks), dtype=x.dtype).flatten(-3, -2)[..., :n, :]
    return rounded.movedim(-2, dim)


def gather_fp8(values: torch.Tensor, scales: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``blocks [N]`` of an FP8 pool (numbered as a 16-bit pool's ``view(-1, page_size *
    head_dim)`` rows) dequantized into ``[N, page_size * head_dim]`` of ``dtype``: the torch
    passes' read (the Triton kernels read in place)."""
    page, dim = values.shape[4], values.shape[5]
    q = values.view(torch.uint8).view(-1, page * dim).index_select(0, blocks).view(FP8)
    scale = scales.view(-1).index_select(0, blocks)
    return dequantize_kv_fp8(q.view(-1, page, dim), scale, dtype).view(-1, page * dim)


SHARED_PREFIX = "pdserve-kv-"


class KVPool:
    """Owns the pool tensor; knows page addresses. No allocation policy here.

    :attr:`tensor` holds the pages as bytes are moved (first dimension: pages);
    :attr:`kv` and :attr:`kv_scales` are what attention reads and writes (see the module's
    docstring: for 16-bit pools ``kv`` is ``tensor`` and ``kv_scales`` is ``None``).

    ``shared_dir`` (CPU pools): the pool lives in a file of its own there (``/dev/shm``: shared
    memory), readable and writable by this user only, that other processes of this host map
    (the ``shm`` transfer backend); :meth:`close` removes it, and a pool removes the files of
    processes that died without closing theirs."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device, shared_dir: str = "") -> None:
        if is_fp8(layout) and (layout.head_dim * layout.page_size) % KV_SCALE_DTYPE.itemsize:
            raise ValueError(f"FP8 KV pages need page_size * head_dim a multiple of 4, got {layout.describe()}")
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        shape = (num_pages, *page_shape(layout))
        dtype = storage_dtype(layout)
        self.shared_path = ""
        if shared_dir:
            if device.type != "cpu":
                raise ValueError("a shared-memory page pool is a CPU pool")
            self.shared_path = _shared_file(Path(shared_dir), math.prod(shape) * dtype.itemsize)
            self.tensor = torch.from_file(self.shared_path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
        else:
            pin = device.type == "cpu" and torch.cuda.is_available()
            self.tensor = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        self.kv, self.kv_scales = kv_views(self.tensor, layout)

    def close(self) -> None:
        """Remove the pool's shared file (its mapping stays valid for whoever holds it)."""
        if self.shared_path:
            Path(self.shared_path).unlink(missing_ok=True)

    @property
    def page_bytes(self) -> int:
        return page_bytes(self.layout)

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
