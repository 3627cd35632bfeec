"""Activations quantized to FP8 per row (per token) for the W8A8 products of :mod:`.fp8`:
:func:`quantize_rows`, one launch for a row of up to :data:`QUANT_ONE_PASS_MAX` columns, two
above (each chunk's amax, then each chunk quantized with its row's), SiLU·up fused for the
down projection. Bit for bit :func:`pdserve.engine.quant.quantize_rows_fp8`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import elementwise, interpreting
from pdserve.engine.quant import FP8

# One pass over a row held in registers up to this many columns; a longer row (down's input at
# 7B: 18,944) is cut into chunks of QUANT_BLOCK, each its own program, in two launches: each
# chunk's amax, then each chunk quantized with its row's (SiLU·up computed in both). One program
# walking the row twice took 15.7 us at any row count on an H200 (fp8_probe, 2026-12-04): a
# third of down's product at 64 rows.
QUANT_ONE_PASS_MAX = 8192
QUANT_BLOCK = 2048


@triton.jit
def _activation(x_row, rk, ok, K, SILU_MUL: tl.constexpr):
    """Columns ``rk`` of a row in float32 (``silu(gate) * up``, rounded as
    :func:`.elementwise.silu_mul` rounds it, with ``SILU_MUL``)."""
    if SILU_MUL:
        gate = tl.load(x_row + rk, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + rk, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_row.dtype.element_ty).to(tl.float32)
        return (act * up).to(x_row.dtype.element_ty).to(tl.float32)
    return tl.load(x_row + rk, mask=ok, other=0.0).to(tl.float32)


_to_fp8 = elementwise.to_fp8


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_xm, SILU_MUL: tl.constexpr, EXACT: tl.constexpr, BLOCK_K: tl.constexpr
):
    """One program a row, the row in registers."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    rk = tl.arange(0, BLOCK_K)
    ok = rk < K
    v = _activation(x_row, rk, ok, K, SILU_MUL)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), 0), 1e-12), 448.0)
    tl.store(q_ptr + row * K + rk, _to_fp8(v, scale, q_ptr, EXACT), mask=ok)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _chunk_amax_kernel(x_ptr, amax_ptr, K, stride_xm, SILU_MUL: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row, chunk): the chunk's largest magnitude into ``amax [rows, chunks]``."""
    row = tl.program_id(0).to(tl.int64)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    v = _activation(x_ptr + row * stride_xm, rk, rk < K, K, SILU_MUL)
    tl.store(amax_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.max(tl.abs(v), 0))


@triton.jit
def _quantize_chunks_kernel(
    x_ptr,
    amax_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    SILU_MUL: tl.constexpr,
    EXACT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Program (row, chunk): the row's amax from its chunks', then the chunk quantized."""
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.num_programs(1)
    rc = tl.arange(0, CHUNKS)
    amax = tl.max(tl.load(amax_ptr + row * chunks + rc, mask=rc < chunks, other=0.0), 0)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = rk < K
    v = _activation(x_ptr + row * stride_xm, rk, ok, K, SILU_MUL)
    tl.store(q_ptr + row * K + rk, _to_fp8(v, scale, q_ptr, EXACT), mask=ok)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + row, scale)


def quantize_rows(
    x: torch.Tensor, silu_mul_input: bool = False, block_k: int | None = None, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as FP8 per row: ``q [M, K]`` float8_e4m3fn and ``scale [M]`` float32,
    ``x ~= q * scale[:, None]`` (each row's amax over 448, at least 1e-12 / 448), the same bits
    as :func:`pdserve.engine.quant.quantize_rows_fp8`. ``silu_mul_input``: ``x`` is ``[M, 2K]``,
    gate and up side by side, and the rows quantized are ``silu(gate) * up`` (the down
    projection's input, never written in 16 bits). ``block_k``: a row up to this many columns
    in one program and one launch (default :data:`QUANT_ONE_PASS_MAX`), else in chunks of
    ``block_k`` (default :data:`QUANT_BLOCK`) over two launches. ``num_warps``: the programs'
    (default 8 for rows or chunks of 4,096 columns and more, else 4)."""
    rows, cols = x.shape
    k = cols // 2 if silu_mul_input else cols
    assert x.stride(1) == 1 and k > 0 and (not silu_mul_input or cols == 2 * k)
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    whole = triton.next_power_of_2(k)
    if (block_k or QUANT_ONE_PASS_MAX) >= k:
        _quantize_rows_kernel[(rows,)](
            x,
            q,
            scale,
            k,
            x.stride(0),
            SILU_MUL=silu_mul_input,
            EXACT=interpreting(),
            BLOCK_K=whole,
            num_warps=num_warps or (8 if whole >= 4096 else 4),
        )
        return q, scale
    block = min(block_k or QUANT_BLOCK, whole)
    grid = (rows, triton.cdiv(k, block))
    amax = torch.empty(grid, dtype=torch.float32, device=x.device)
    warps = num_warps or (8 if block >= 4096 else 4)
    _chunk_amax_kernel[grid](x, amax, k, x.stride(0), SILU_MUL=silu_mul_input, BLOCK_K=block, num_warps=warps)
    _quantize_chunks_kernel[grid](
        x,
        amax,
        q,
        scale,
        k,
        x.stride(0),
        SILU_MUL=silu_mul_input,
        EXACT=interpreting(),
        BLOCK_K=block,
        CHUNKS=max(2, triton.next_power_of_2(grid[1])),
        num_warps=warps,
    )
    return q, scale
