"""C kernels of the CPU pass (``cpu_attention.c``, ``cpu_elementwise.c`` and their shared
``cpu_common.h``), built once per machine and loaded with ctypes.

The sources are compiled by the machine's C compiler (``$CC``, else ``cc`` or ``gcc``) with
``-O3 -march=native -fopenmp`` into a cache directory (``$PDSERVE_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/pdserve/kernels`` or ``~/.cache/pdserve/kernels``), named by a hash of the
sources, the flags and the compiler's version: a later start loads it (about 2 s to build on
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

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_attention.c", "cpu_elementwise.c"))
HEADERS = (Path(__file__).with_name("cpu_common.h"),)  # included by the sources: part of the build key
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


def build_key(compiler_version: str) -> str:
    """What names a build: a hash of the sources and the header they include, the flags and
    the compiler's version."""
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    return hashlib.sha256("\0".join((*texts, " ".join(FLAGS), compiler_version)).encode()).hexdigest()[:16]


@functools.cache
def library() -> ctypes.CDLL:
    """The built library (built on the first call of this process that finds none)."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{cc} --version failed: {exc}") from None
    target = cache_dir() / f"cpu_kernels-{build_key(version)}.so"
    if not target.is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, staging = tempfile.mkstemp(prefix=".cpu_kernels-", suffix=".so", dir=target.parent)
            os.close(fd)
        except OSError as exc:
            raise NativeUnavailable(
                f"cannot write the kernel cache {target.parent} ({exc}): set PDSERVE_KERNEL_CACHE"
            ) from None
        try:
            built = subprocess.run(
                [cc, *FLAGS, "-o", staging, *map(str, SOURCES)],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            if built.returncode != 0:
                tail = (built.stderr or built.stdout).strip().splitlines()[-3:]
                raise NativeUnavailable(f"{cc} could not build the kernels: {' / '.join(tail)}")
            os.replace(staging, target)  # a concurrent builder's identical copy may win: either is fine
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeUnavailable(f"{cc} could not build the kernels: {exc}") from None
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
    lib.silu_mul_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.add_rms_norm_bf16.restype = None
    lib.add_rms_norm_bf16.argtypes = [
        ctypes.c_void_p,  # x
        ctypes.c_int64,  # x's row stride
        ctypes.c_void_p,  # residual (NULL: none)
        ctypes.c_int64,  # its row stride
        ctypes.c_void_p,  # weight
        ctypes.c_float,  # eps
        ctypes.c_int64,  # rows
        ctypes.c_int64,  # hidden
        ctypes.c_void_p,  # norm out
        ctypes.c_void_p,  # residual out
    ]
    lib.rope_bf16.restype = None
    lib.rope_bf16.argtypes = [
        ctypes.c_void_p,  # qk
        ctypes.c_int64,  # row stride
        ctypes.c_int64,  # tokens
        ctypes.c_int,  # heads
        ctypes.c_int,  # dim
        ctypes.c_void_p,  # cos
        ctypes.c_void_p,  # sin
        ctypes.c_void_p,  # positions (int64)
    ]
    return lib


def unavailable_reason() -> str | None:
    """``None`` when the kernels load here, else why not."""
    try:
        library()
    except NativeUnavailable as exc:
        return str(exc)
    return None


def _pool_and_queries(pool: torch.Tensor, q: torch.Tensor, name: str) -> tuple[int, int, int, int, int]:
    """The pool's layers, KV heads, page size and head size and the query heads per KV head,
    once the pool and the queries are ones the kernels read."""
    _, layers, _, heads, page, dim = pool.shape
    group = q.shape[1] // (heads * dim)
    if pool.dtype != torch.bfloat16 or q.dtype != torch.bfloat16 or not pool.is_contiguous():
        raise ValueError(f"{name} reads a contiguous bfloat16 pool with bfloat16 queries")
    if q.stride(1) != 1 or group * heads * dim != q.shape[1] or group > MAX_GROUP or dim > MAX_DIM:
        raise ValueError(f"{name}: unsupported query shape {tuple(q.shape)} over {heads} heads of {dim}")
    return layers, heads, page, dim, group


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
    layers, heads, page, dim, group = _pool_and_queries(pool, q, "paged_decode")
    rows = q.shape[0]
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
    layers, heads, page, dim, group = _pool_and_queries(pool, q, "paged_prefill")
    rows = q.shape[0]
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


def _bf16_rows(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.bfloat16 or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name}: bfloat16 rows, each contiguous (got {t.dtype} {tuple(t.shape)})")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate_up[:, :n]) * gate_up[:, n:]`` of bfloat16 rows ``[rows, 2n]``, rounded as
    those two ops round: ``[rows, n]``."""
    _bf16_rows(gate_up, "silu_mul")
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=torch.bfloat16)
    library().silu_mul_bf16(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, n)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)`` of bfloat16 rows ``[rows, hidden]``
    (``x`` alone without a residual), rounded as the stock RMSNorm rounds; the sum is written
    into ``residual`` when given, as the next layer's residual."""
    _bf16_rows(x, "add_rms_norm")
    rows, hidden = x.shape
    if weight.dtype != torch.bfloat16 or weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError("add_rms_norm: a contiguous bfloat16 weight of the rows' width")
    norm = torch.empty((rows, hidden), dtype=torch.bfloat16)
    if residual is None:
        res = x if x.is_contiguous() else x.contiguous()
    else:
        _bf16_rows(residual, "add_rms_norm's residual")
        if residual.shape != x.shape:
            raise ValueError("add_rms_norm: the residual's shape is not x's")
        res = residual if residual.is_contiguous() else torch.empty_like(x)
    library().add_rms_norm_bf16(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(),
        eps,
        rows,
        hidden,
        norm.data_ptr(),
        res.data_ptr(),
    )
    return norm, res


def rope(qk: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """The rotary embedding in place over the first ``heads`` heads of size ``dim`` of each row
    of ``qk`` (bfloat16 ``[tokens, >= heads * dim]``, rows contiguous), at ``positions`` (int64)
    of the tables ``cos``, ``sin`` (bfloat16 ``[positions, dim]``), rounded as the stock
    ``apply_rotary_pos_emb`` rounds."""
    _bf16_rows(qk, "rope")
    if qk.shape[1] < heads * dim or dim > MAX_DIM or dim % 2:
        raise ValueError(f"rope: {heads} heads of {dim} in rows of {qk.shape[1]}")
    for table in (cos, sin):
        if table.dtype != torch.bfloat16 or not table.is_contiguous() or table.shape[1] != dim:
            raise ValueError("rope: contiguous bfloat16 tables [positions, dim]")
    if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.shape[0] != qk.shape[0]:
        raise ValueError("rope: one int64 position per row")
    library().rope_bf16(
        qk.data_ptr(), qk.stride(0), qk.shape[0], heads, dim, cos.data_ptr(), sin.data_ptr(), positions.data_ptr()
    )
