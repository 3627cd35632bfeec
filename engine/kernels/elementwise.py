"""Row-wise kernels that would otherwise be several passes: residual add + RMSNorm, SiLU·up.

Each rounds where the stock ``transformers`` code rounds (the sum to the activation
dtype before the norm, the normalised row before the weight), so outputs agree with
it to the last bit in float32 and within one rounding in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import interpreting
from pdserve.engine.quant import FP8


@triton.jit
def _norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, eps, n, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """This program's row: ``x + residual`` stored to ``res_out_ptr``, and ``norm(x + residual) *
    weight`` returned in float32, rounded to the activation dtype where the stock code rounds."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    x = x.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * n + cols, x, mask=mask)
    x = x.to(tl.float32)
    var = tl.sum(x * x, 0) / n
    y = (x * tl.rsqrt(var + eps)).to(res_out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (y * w).to(res_out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, n, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    if PDL:  # the GEMV after this may be scheduled now (it waits for this kernel's output)
        tl.extra.cuda.gdc_launch_dependents()
    y = _norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, eps, n, HAS_RES, BLOCK)
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0).to(tl.int64) * n + cols, y.to(out_ptr.dtype.element_ty), mask=cols < n)


@triton.jit
def round_e4m3(v):
    """``v`` (float32, within +-448) rounded to the nearest float8_e4m3fn value, ties to even,
    subnormals kept: what the GPU's conversion does, done in float32 arithmetic for Triton's
    interpreter, whose conversion rounds ties away from zero and loses subnormals."""
    exponent = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)  # e4m3: normal from 2^-6
    step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: 2^(e - 3)
    r = tl.abs(v) / step  # exact: a power of two
    r = (r + 12582912.0) - 12582912.0  # 1.5 * 2^23: to the nearest integer, ties to even
    # the sign kept, -0 too (a product: the interpreter negates as 0 - r, which is +0)
    return r * tl.where(v.to(tl.int32, bitcast=True) < 0, -1.0, 1.0) * step


@triton.jit
def to_fp8(v, scale, q_ptr, EXACT: tl.constexpr):
    """``v / scale`` (float32) as ``q_ptr``'s FP8 type, saturated at +-448, ties to even
    (``EXACT``: rounded in float32 first, for the interpreter)."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
    if EXACT:
        q = round_e4m3(q)
    return q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")


@triton.jit
def _add_rms_norm_fp8_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, res_out_ptr, eps, n, HAS_RES: tl.constexpr, EXACT: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """:func:`_add_rms_norm_kernel`'s row quantized to FP8 with the row's scale
    (``quant.quantize_rows_fp8`` of that kernel's output)."""
    y = _norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, eps, n, HAS_RES, BLOCK)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), 0), 1e-12), 448.0)
    tl.store(q_ptr + row * n + cols, to_fp8(y, scale, q_ptr, EXACT), mask=cols < n)
    tl.store(scale_ptr + row, scale)


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``((q, scale), x + residual)``: :func:`add_rms_norm`'s output quantized per row to FP8
    in the same pass, the bits of ``quant.quantize_rows_fp8(add_rms_norm(...)[0])``, for a
    W8A8 product that would otherwise quantize it in a launch of its own."""
    rows, n = x.shape
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    q = torch.empty((rows, n), dtype=FP8, device=x.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x)
    if rows:
        _add_rms_norm_fp8_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            q,
            scale,
            res_out,
            eps,
            n,
            HAS_RES=residual is not None,
            EXACT=interpreting(),
            BLOCK=triton.next_power_of_2(n),
            num_warps=8 if n > 2048 else 4,
        )
    return (q, scale), res_out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual) * weight, x + residual)`` for rows of ``x [T, n]``. ``pdl``: let
    a programmatic dependent launched after it start early (CUDA only)."""
    rows, n = x.shape
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            res_out,
            eps,
            n,
            HAS_RES=residual is not None,
            BLOCK=triton.next_power_of_2(n),
            PDL=pdl,
            num_warps=8 if n > 2048 else 4,
        )
    return out, res_out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` for ``x [T, 2n]`` (gate and up projections side by side)."""
    rows, two_n = x.shape
    n = two_n // 2
    assert x.is_contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _feed_kernel(ids_ptr, src_ptr, tokens_ptr, n, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    ok = rows < n
    src = tl.load(src_ptr + rows, mask=ok, other=-1)
    fed = src >= 0
    token = tl.load(tokens_ptr + tl.maximum(src, 0), mask=ok & fed, other=0)
    tl.store(ids_ptr + rows, token.to(ids_ptr.dtype.element_ty), mask=ok & fed)


def feed(ids: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place, one launch: ``ids[i] = tokens[src[i]]`` where ``src[i] >= 0`` (an overlapped
    step's input tokens, still on the device, from the step before)."""
    n = ids.shape[0]
    assert src.shape[0] == n and ids.is_contiguous() and src.is_contiguous()
    if n:
        _feed_kernel[(1,)](ids, src, tokens, n, BLOCK=triton.next_power_of_2(n), num_warps=1)


@triton.jit
def _argmax_part_kernel(x_ptr, val_ptr, idx_ptr, n, stride, chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 0)
    first = tl.min(tl.where(x == best, cols, n), 0)  # the first of equals, as torch.argmax
    tl.store(val_ptr + row * chunks + chunk, best)
    tl.store(idx_ptr + row * chunks + chunk, first)


@triton.jit
def _argmax_kernel(val_ptr, idx_ptr, out_ptr, chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ok = j < chunks
    val = tl.load(val_ptr + row * chunks + j, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * chunks + j, mask=ok, other=2**31 - 1)
    best = tl.max(val, 0)
    tl.store(out_ptr + row, tl.min(tl.where(val == best, idx, 2**31 - 1), 0).to(tl.int64))


def argmax_rows(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64; the first index of equal maxima) for a few long rows:
    each row cut into ``block``-wide chunks read at once by many programs, then their
    winners compared (torch reduces a row with few blocks: 9 us for a 152k vocabulary
    on an H200)."""
    rows, n = x.shape
    assert x.stride(1) == 1
    chunks = triton.cdiv(n, block)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    if rows:
        _argmax_part_kernel[(rows, chunks)](x, vals, idx, n, x.stride(0), chunks, BLOCK=block, num_warps=8)
        _argmax_kernel[(rows,)](vals, idx, out, chunks, BLOCK=triton.next_power_of_2(chunks), num_warps=1)
    return out
