"""C kernels of the CPU pass (``cpu_attention.c``), built once per machine and loaded with ctypes.

The source is compiled by the machine's C compiler (``$CC``, else ``cc`` or ``gcc``) with
``-O3 -march=native -fopenmp`` into a cache directory (``$PDSERVE_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/pdserve/kernels`` or ``~/.cache/pdserve/kernels``), named by a hash of the
source, the flags and the compiler's version: a later start loads it (about 0.5 s to build on
two cores). The library needs ``libgomp.so.1``, which torch has already loaded: its OpenMP
threads are torch's. ctypes releases the GIL for the call.

:func:`unavailable_reason` says why the kernels cannot be had here (no compiler, a failed
build); callers decide at start and log it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
MAX_GROUP = 16  # query heads per KV head (MAXG in the source)
MAX_DIM = 256


class NativeUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded on this machine."""


def cache_dir() -> Path:
    explicit = os.environ.get("PDSERVE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeUnavailable("no C compiler found (set CC, or install gcc)")
    return cc


@functools.cache
def library() -> ctypes.CDLL:
    """The built library (built on the first call of this process that finds none)."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{cc} --version failed: {exc}") from None
    key = hashlib.sha256("\0".join((SOURCE.read_text(), " ".join(FLAGS), version)).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_attention-{key}.so"
    if not target.is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, staging = tempfile.mkstemp(prefix=".cpu_attention-", suffix=".so", dir=target.parent)
            os.close(fd)
        except OSError as exc:
            raise NativeUnavailable(
                f"cannot write the kernel cache {target.parent} ({exc}): set PDSERVE_KERNEL_CACHE"
            ) from None
        try:
            built = subprocess.run(
                [cc, *FLAGS, "-o", staging, str(SOURCE)], capture_output=True, text=True, timeout=300, check=False
            )
            if built.returncode != 0:
                tail = (built.stderr or built.stdout).strip().splitlines()[-3:]
                raise NativeUnavailable(f"{cc} could not build {SOURCE.name}: {' / '.join(tail)}")
            os.replace(staging, target)  # a concurrent builder's identical copy may win: either is fine
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeUnavailable(f"{cc} could not build {SOURCE.name}: {exc}") from None
        finally:
            Path(staging).unlink(missing_ok=True)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeUnavailable(f"cannot load {target}: {exc}") from None
    fn = lib.paged_decode_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p,  # pool
        ctypes.c_void_p,  # q
        ctypes.c_int64,  # q_stride
        ctypes.c_void_p,  # out
        ctypes.c_void_p,  # tables
        ctypes.c_int64,  # table_stride
        ctypes.c_void_p,  # lens
        *[ctypes.c_int] * 7,  # rows, layer, layers, heads, group, page, dim
        ctypes.c_float,  # scale
        ctypes.c_int,  # window
    ]
    fn = lib.paged_prefill_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p,  # pool
        ctypes.c_void_p,  # q
        ctypes.c_int64,  # q_stride
        ctypes.c_void_p,  # out
        ctypes.c_void_p,  # table
        *[ctypes.c_int] * 8,  # ctx, n, layer, layers, heads, group, page, dim
        ctypes.c_float,  # scale
        ctypes.c_int,  # window
    ]
    return lib


def unavailable_reason() -> str | None:
    """``None`` when the kernels load here, else why not."""
    try:
        library()
    except NativeUnavailable as exc:
        return str(exc)
    return None


def paged_decode(
    pool: torch.Tensor,
    q: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    layer: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over its own pages, read in place.

    ``pool``: bfloat16 ``[pages, layers, 2, heads, page, dim]``; ``q``: ``[rows, heads * group *
    dim]`` bfloat16 (rows may be strided, each row contiguous; a KV head's query heads
    adjacent); ``tables``: int32 ``[rows, W]`` page ids; ``lens``: int32 ``[rows]`` context
    lengths (the row's own token included). Returns ``[rows, heads * group * dim]`` bfloat16.
    """
    _, layers, _, heads, page, dim = pool.shape
    rows = q.shape[0]
    group = q.shape[1] // (heads * dim)
    if pool.dtype != torch.bfloat16 or q.dtype != torch.bfloat16 or not pool.is_contiguous():
        raise ValueError("paged_decode reads a contiguous bfloat16 pool with bfloat16 queries")
    if q.stride(1) != 1 or group * heads * dim != q.shape[1] or group > MAX_GROUP or dim > MAX_DIM:
        raise ValueError(f"paged_decode: unsupported query shape {tuple(q.shape)} over {heads} heads of {dim}")
    if tables.dtype != torch.int32 or lens.dtype != torch.int32 or tables.stride(1) != 1 or not lens.is_contiguous():
        raise ValueError("paged_decode wants int32 tables (rows contiguous) and int32 lengths")
    if tables.shape[0] != rows or lens.shape[0] != rows:
        raise ValueError("paged_decode: one table and one length per row")
    out = torch.empty((rows, q.shape[1]), dtype=torch.bfloat16)
    if rows == 0:
        return out
    rc = library().paged_decode_bf16(
        pool.data_ptr(),
        q.data_ptr(),
        q.stride(0),
        out.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        rows,
        layer,
        layers,
        heads,
        group,
        page,
        dim,
        scale,
        window or 0,
    )
    if rc != 0:
        raise RuntimeError(f"paged_decode_bf16 returned {rc}")
    return out


def paged_prefill(
    pool: torch.Tensor,
    q: torch.Tensor,
    table: torch.Tensor,
    ctx: int,
    layer: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's prefill chunk: query row ``r`` of ``q`` (``[n, heads *
    group * dim]`` bfloat16, rows may be strided) sits at position ``ctx - n + r`` and attends
    to the keys up to it (the last ``window`` of them) in the sequence's pages ``table`` (int32
    ``[>= ceil(ctx / page)]``), read in place: the chunk's own K and V must be in the pool
    already. Returns ``[n, heads * group * dim]`` bfloat16, computed as :func:`paged_decode`
    computes one row (float32, rounded once).
    """
    _, layers, _, heads, page, dim = pool.shape
    rows = q.shape[0]
    group = q.shape[1] // (heads * dim)
    if pool.dtype != torch.bfloat16 or q.dtype != torch.bfloat16 or not pool.is_contiguous():
        raise ValueError("paged_prefill reads a contiguous bfloat16 pool with bfloat16 queries")
    if q.stride(1) != 1 or group * heads * dim != q.shape[1] or group > MAX_GROUP or dim > MAX_DIM:
        raise ValueError(f"paged_prefill: unsupported query shape {tuple(q.shape)} over {heads} heads of {dim}")
    if table.dtype != torch.int32 or table.dim() != 1 or not table.is_contiguous():
        raise ValueError("paged_prefill wants one contiguous int32 page table")
    if not rows <= ctx <= table.shape[0] * page:
        raise ValueError(f"paged_prefill: {rows} rows over a context of {ctx} in {table.shape[0]} pages of {page}")
    out = torch.empty((rows, q.shape[1]), dtype=torch.bfloat16)
    if rows == 0:
        return out
    rc = library().paged_prefill_bf16(
        pool.data_ptr(),
        q.data_ptr(),
        q.stride(0),
        out.data_ptr(),
        table.data_ptr(),
        ctx,
        rows,
        layer,
        layers,
        heads,
        group,
        page,
        dim,
        scale,
        window or 0,
    )
    if rc != 0:
        raise RuntimeError(f"paged_prefill_bf16 returned {rc}")
    return out
