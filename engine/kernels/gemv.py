"""Matrix-vector products for decode at small batch: ``out = x @ w.T (+ bias)``.

At batch 1 a decode step is bound by reading every weight once; the library's general
matrix kernels reach about 3.8 TB/s on the large projections of a 7B model on an H200
and under 3 TB/s on the small ones. These kernels stream ``w`` in ``[BLOCK_N, BLOCK_K]``
tiles with a few rows of ``x`` (``x`` stays in L2), one program per ``BLOCK_N`` outputs.

``silu_mul_input``: ``x`` holds gate and up side by side and the product reads
``silu(gate) * up`` on the fly, so the down projection needs no separate activation pass.

``split_k``: a matrix with few output rows per SM (the 7B model's o, qkv and down
projections give 448 to 576 programs of 8 rows to 132 SMs, so a quarter of the SMs idle
through the last wave) is cut along K as well; each program leaves its partial sums in a
scratch buffer and the last of a row block's programs to finish adds them up (an atomic
counter per row block, left at zero for the next launch and graph replay).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import interpreting


@triton.jit
def _accumulate(acc, w, x_ptr, rk, k_ok, rm, M, K, stride_xm, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr):
    """``acc[m] += w @ x[m, rk]`` for each row ``m`` (``x`` read as ``silu(gate) * up``)."""
    w = w.to(tl.float32)
    for m in tl.static_range(BLOCK_M):
        x_ok = k_ok & ((rk * 0 + m) < M)  # a tensor mask: a scalar one is rejected by newer interpreters
        if SILU_MUL:
            gate = tl.load(x_ptr + m * stride_xm + rk, mask=x_ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + m * stride_xm + K + rk, mask=x_ok, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(x_ptr + m * stride_xm + rk, mask=x_ok, other=0.0).to(tl.float32)
        part = tl.sum(w * x[None, :], 1)
        acc += tl.where(rm[:, None] == m, part[None, :], 0.0)
    return acc


@triton.jit
def _accumulate_dot(acc, w, x_ptr, rk, k_ok, rm, M, K, stride_xm, SILU_MUL: tl.constexpr, WIDEN: tl.constexpr):
    """``acc += x[:, rk] @ w.T`` on the tensor cores (``w`` converted to ``x``'s dtype first;
    ``WIDEN``: both in float32, as Triton's interpreter needs: its bfloat16 products are wrong)."""
    x_ok = (rm[:, None] < M) & k_ok[None, :]
    rows = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    if SILU_MUL:
        gate = tl.load(rows, mask=x_ok, other=0.0).to(tl.float32)
        up = tl.load(rows + K, mask=x_ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
        x = (act * up).to(x_ptr.dtype.element_ty)
    else:
        x = tl.load(rows, mask=x_ok, other=0.0)
    if WIDEN:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    return tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)


@triton.jit
def _step(
    acc,
    w,
    x_ptr,
    rk,
    k_ok,
    rm,
    M,
    K,
    stride_xm,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT: tl.constexpr,
    WIDEN: tl.constexpr,
):
    if DOT:
        acc = _accumulate_dot(acc, w, x_ptr, rk, k_ok, rm, M, K, stride_xm, SILU_MUL, WIDEN)
    else:
        acc = _accumulate(acc, w, x_ptr, rk, k_ok, rm, M, K, stride_xm, SILU_MUL, BLOCK_M)
    return acc


@triton.jit
def _finish(acc, b_ptr, scale_ptr, rn, n_ok, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Each output channel times its weight scale (FP8 weights), plus the bias."""
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    scale_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT: tl.constexpr,
    WIDEN: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    k_start = 0
    k_end = K
    if SPLIT_K > 1:
        per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_start = tl.program_id(1) * per_split
        k_end = tl.minimum(k_start + per_split, K)
    if PDL:
        # Launched while the kernel before still runs: the first weight tile (which no
        # kernel writes) is read first, then the wait for that kernel's output, ``x``.
        rk = k_start + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        acc = _step(acc, w, x_ptr, rk, k_ok, rm, M, K, stride_xm, SILU_MUL, BLOCK_M, DOT, WIDEN)
        k_first = k_start + BLOCK_K
    else:
        k_first = k_start
    for k0 in range(k_first, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _step(acc, w, x_ptr, rk, k_ok, rm, M, K, stride_xm, SILU_MUL, BLOCK_M, DOT, WIDEN)
    keep = (rm[:, None] < M) & n_ok[None, :]
    if SPLIT_K > 1:
        # [SPLIT_K, BLOCK_M, N] partial sums; the last program of this row block adds them.
        part = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(part + tl.program_id(1) * BLOCK_M * N, acc, mask=keep)
        tl.debug_barrier()
        counter = counter_ptr + pid
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for j in tl.static_range(SPLIT_K):  # in split order: the sum does not depend on who came last
                acc += tl.load(part + j * BLOCK_M * N, mask=keep, other=0.0, cache_modifier=".cg")
            acc = _finish(acc, b_ptr, scale_ptr, rn, n_ok, HAS_BIAS, HAS_SCALE)
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)
            tl.atomic_xchg(counter, 0)  # ready for the next launch (and the next graph replay)
    else:
        acc = _finish(acc, b_ptr, scale_ptr, rn, n_ok, HAS_BIAS, HAS_SCALE)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)


DOT_FROM_ROWS = 8  # from this many rows of x a GEMV multiplies on the tensor cores


def model_tiles(tiles: dict[str, int]) -> dict[str, Any]:
    """The tiles a model's GEMV runs at: ``tiles`` (chosen on a GPU), or in Triton's
    interpreter 128 output channels a program (the same kernel; an interpreted program costs
    Python per operation whatever its tile, so 8 channels a program made the GEMVs most of an
    interpreted decode step). The kernel's own tests choose their tiles themselves."""
    if not interpreting():
        return tiles
    return {**tiles, "block_n": max(tiles.get("block_n", 8), 128)}


# One set a (device type, device index, stream): two streams' split-K launches running at once
# (the two engines of a co-located process) must not share counters, or one launch's adds
# land in the other's count and a row block is summed before its parts are in.
_COUNTERS: dict[tuple[str, int | None, int], torch.Tensor] = {}


def _stream_key(device: torch.device) -> tuple[str, int | None, int]:
    if device.type != "cuda":
        return device.type, device.index, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device.type, index, torch.cuda.current_stream(index).cuda_stream


def split_counters(device: torch.device, blocks: int) -> torch.Tensor:
    """The zeroed int32 counters that ``split_k`` GEMVs on ``device`` launched on the current
    stream share (each launch leaves them at zero; launches on one stream run one after
    another; another stream gets its own). Allocate them before a CUDA graph is captured, on
    the capture stream: :func:`reserve_counters`, or a launch there before the capture."""
    key = _stream_key(device)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"split-K counters for {blocks} blocks first asked for inside a CUDA graph capture: "
                "reserve_counters(device, blocks) on the capture stream before capturing"
            )
        have = torch.zeros(
            max(blocks, 4096), dtype=torch.int32, device=device if key[1] is None else torch.device(key[0], key[1])
        )
        _COUNTERS[key] = have
    return have


def reserve_counters(device: torch.device | str, blocks: int = 4096) -> None:
    """Allocate the split-K counters for ``device`` and the current stream now (outside any
    graph capture)."""
    split_counters(torch.device(device), blocks)


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu_mul_input: bool = False,
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
    split_k: int = 1,
    pdl: bool = False,
    scale: torch.Tensor | None = None,
    dot: bool | None = None,
) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T`` for small ``M`` (``x`` is ``[M, 2K]`` with ``silu_mul_input``).

    ``scale``: float32 ``[N]``, each output channel's weight scale (``w`` in float8_e4m3fn,
    read in place and converted in registers: the product of ``x`` with ``w * scale``).
    ``dot``: multiply tiles on the tensor cores (``x`` padded to 16 rows) instead of one
    row of ``x`` at a time; by default from ``M`` (:data:`DOT_FROM_ROWS`).
    ``pdl``: launched as a programmatic dependent of the kernel before it on the stream
    (CUDA only): its programs start, and read their first weight tile, while that kernel
    finishes, then wait for it before reading ``x``."""
    m = x.shape[0]
    n, k = w.shape
    assert w.is_contiguous() and x.stride(1) == 1
    assert x.shape[1] == (2 * k if silu_mul_input else k)
    assert scale is None or (scale.dtype == torch.float32 and scale.shape == (n,))
    assert scale is not None or w.dtype == x.dtype, "weights other than x's dtype need a scale"
    if dot is None:
        dot = m >= DOT_FROM_ROWS
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = triton.next_power_of_2(max(m, 16 if dot else 1))
    blocks = triton.cdiv(n, block_n)
    if split_k > 1:
        part = torch.empty((split_k, block_m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, blocks)
    else:
        part, counters = out, out
    _gemv_kernel[(blocks, split_k)](
        x,
        w,
        bias if bias is not None else w,
        scale if scale is not None else out,
        out,
        part,
        counters,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        DOT=dot,
        WIDEN=interpreting(),
        SILU_MUL=silu_mul_input,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


@triton.jit
def _l2_prefetch_kernel(src_ptr, sink_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(sink_ptr + tl.program_id(0), tl.sum(x, 0))  # read, so the load is not dropped


def l2_prefetch(t: torch.Tensor, sink: torch.Tensor, block: int = 8192) -> None:
    """Read ``t`` into the L2 cache (kept there as "evict last") so that a kernel right
    after reads it from L2 instead of device memory. At batch 1 the attention of a layer
    leaves the memory bus nearly idle for several microseconds: the o projection's
    weights (25.7 MB at 7B dimensions, L2 holds 50 MB on an H100/H200) are read then, on a
    side stream. One load of ``block`` elements per program (a loop per program was
    latency-bound: 44 us for those 25.7 MB); ``sink``: float32, one sum per program."""
    n = t.numel()
    programs = triton.cdiv(n, block)
    assert t.is_contiguous() and sink.numel() >= programs and sink.dtype == torch.float32
    _l2_prefetch_kernel[(programs,)](t, sink, n, BLOCK=block, num_warps=8)
