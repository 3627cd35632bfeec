"""The rotary-embed + KV-store kernel: rotates q and k in place inside the fused qkv
projection output and writes k, v into their slots of one layer of the page pool
(layout in :mod:`pdserve.engine.kernels.paged`). Into an FP8 pool each k (as rotated into
``qkv``, in its dtype) and v is quantized with its own scale, amax / 448, written beside it
(:func:`pdserve.engine.quant.quantize_kv_fp8`, bit for bit)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import interpreting
from pdserve.engine.kernels.elementwise import to_fp8
from pdserve.engine.kernels.paged import block_strides, store_kv


# The layer and the row stride are not specialised on (see paged.py).
@triton.jit(do_not_specialize=["layer", "stride_qkv"])
def _rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    pool_ptr,
    scale_ptr,
    layer,
    stride_qkv,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
    DIM: tl.constexpr,
    PAGE: tl.constexpr,
    LAYERS: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    KV_FP8: tl.constexpr,
    EXACT: tl.constexpr,
):
    t = tl.program_id(0)
    half: tl.constexpr = DIM // 2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, half)
    cos = tl.load(cos_ptr + pos * DIM + d).to(tl.float32)
    sin = tl.load(sin_ptr + pos * DIM + d).to(tl.float32)
    h = tl.arange(0, HEADS_PAD)
    row = qkv_ptr + t.to(tl.int64) * stride_qkv
    # q and k heads sit side by side in the row: rotate them together, in place
    rot = h < NUM_Q + NUM_KV
    lo_ptr = row + h[:, None] * DIM + d[None, :]
    lo = tl.load(lo_ptr, mask=rot[:, None], other=0.0).to(tl.float32)
    hi = tl.load(lo_ptr + half, mask=rot[:, None], other=0.0).to(tl.float32)
    new_lo = lo * cos[None, :] - hi * sin[None, :]
    new_hi = hi * cos[None, :] + lo * sin[None, :]
    tl.store(lo_ptr, new_lo.to(qkv_ptr.dtype.element_ty), mask=rot[:, None])
    tl.store(lo_ptr + half, new_hi.to(qkv_ptr.dtype.element_ty), mask=rot[:, None])
    # rotated k, and v, into the pool
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page_base = (slot // PAGE) * LAYERS + layer
    offset = slot % PAGE
    is_k = (h >= NUM_Q) & rot
    k_block = (page_base * 2) * NUM_KV + (h - NUM_Q)
    k_dst = pool_ptr + k_block * BLOCK + offset * DIM
    k_dst = k_dst[:, None] + d[None, :]
    if KV_FP8:  # one scale over both halves of each k, as rounded into qkv
        lo_k = new_lo.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        hi_k = new_hi.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(lo_k), 1), tl.max(tl.abs(hi_k), 1))
        k_scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
        tl.store(k_dst, to_fp8(lo_k, k_scale[:, None], pool_ptr, EXACT), mask=is_k[:, None])
        tl.store(k_dst + half, to_fp8(hi_k, k_scale[:, None], pool_ptr, EXACT), mask=is_k[:, None])
        tl.store(scale_ptr + k_block * SCALE_BLOCK + offset, k_scale, mask=is_k)
    else:
        tl.store(k_dst, new_lo.to(pool_ptr.dtype.element_ty), mask=is_k[:, None])
        tl.store(k_dst + half, new_hi.to(pool_ptr.dtype.element_ty), mask=is_k[:, None])
    j = tl.arange(0, KV_PAD)
    is_v = j < NUM_KV
    full = tl.arange(0, DIM)
    v = tl.load(row + (NUM_Q + NUM_KV + j)[:, None] * DIM + full[None, :], mask=is_v[:, None], other=0.0)
    v_block = (page_base * 2 + 1) * NUM_KV + j
    v_dst = pool_ptr + v_block * BLOCK + offset * DIM
    v_scale_dst = scale_ptr + v_block * SCALE_BLOCK + offset
    store_kv(pool_ptr, scale_ptr, v_dst[:, None] + full[None, :], v_scale_dst, v.to(tl.float32), is_v, EXACT, KV_FP8)


def rope_store(
    qkv: torch.Tensor,
    num_q: int,
    num_kv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Rotate q and k of ``qkv [T, (num_q + 2 * num_kv) * D]`` in place; store k, v in ``slots``.

    ``cos``/``sin`` ``[max_positions, D]`` hold each position's table (halves repeated).
    ``kv_scales``: ``pool`` is an FP8 pool's values and these its scales; each k and v is
    stored quantized with its scale.
    """
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    _, layers, _, heads, page, dim = pool.shape
    assert heads == num_kv and qkv.stride(1) == 1
    _rope_store_kernel[(num_tokens,)](
        qkv,
        cos,
        sin,
        positions,
        slots,
        pool,
        kv_scales if kv_scales is not None else pool,
        layer,
        qkv.stride(0),
        NUM_Q=num_q,
        NUM_KV=num_kv,
        HEADS_PAD=triton.next_power_of_2(num_q + num_kv),
        KV_PAD=triton.next_power_of_2(num_kv),
        DIM=dim,
        PAGE=page,
        LAYERS=layers,
        **block_strides(pool, kv_scales),
        EXACT=interpreting(),
        num_warps=4,
    )
