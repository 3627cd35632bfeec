"""The rotary-embed + KV-store kernel: rotates q and k in place inside the fused qkv
projection output and writes k, v into their slots of one layer of the page pool
(layout in :mod:`pdserve.engine.kernels.paged`). Into an FP8 pool the same kernel rotates q and k
once more, as :func:`pdserve.engine.quant.rotate_qk_` would after it (a Hadamard rotation that
leaves every score as it was: one product on the tensor cores, in place of torch's product,
scaling and copy over the whole step's rows), and a second kernel stores each k (as rotated
into ``qkv``, in its dtype) and v: one program a block of the step's tokens, whose scale it grows
to cover them (:func:`pdserve.engine.quant.store_kv_fp8_blocks`, bit for bit)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import interpreting
from pdserve.engine.kernels.paged import _dot, block_strides, store_fp8_rows, store_kv
from pdserve.engine.quant import kv_key_rotation, rotate_qk_

# Whether the rotation of q and k before an FP8 pool runs inside the rotary kernel (True) or as
# torch's passes after it (:func:`pdserve.engine.quant.rotate_qk_`; kept to time one against
# the other: ``bench/probes/rope_store_probe.py``).
FUSED_KEY_ROTATION = True


# The layer and the row stride are not specialised on (see paged.py).
@triton.jit(do_not_specialize=["layer", "stride_qkv"])
def _rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    pool_ptr,
    had_ptr,
    inv_p,
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
    KV_FP8: tl.constexpr,
    HADAMARD: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    half: tl.constexpr = DIM // 2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    row = qkv_ptr + t.to(tl.int64) * stride_qkv
    # q and k heads sit side by side in the row: rotate them together, in place
    rot = h < NUM_Q + NUM_KV
    if HADAMARD:  # into an FP8 pool: whole rows, the rotary then [q | k] @ H (q's over p)
        full = tl.arange(0, DIM)
        swap = (full + half) % DIM
        sign = tl.where(full < half, -1.0, 1.0)
        cos_f = tl.load(cos_ptr + pos * DIM + full).to(tl.float32)  # the table repeats its halves
        sin_f = tl.load(sin_ptr + pos * DIM + full).to(tl.float32)
        x_ptr = row + h[:, None] * DIM + full[None, :]
        x = tl.load(x_ptr, mask=rot[:, None], other=0.0)
        x_swap = tl.load(row + h[:, None] * DIM + swap[None, :], mask=rot[:, None], other=0.0).to(tl.float32)
        # rounded to the row's dtype as the rotary alone would store it, then rotated once more
        roped = (x.to(tl.float32) * cos_f[None, :] + sign[None, :] * x_swap * sin_f[None, :]).to(x.dtype)
        hm = tl.load(had_ptr + full[:, None] * DIM + full[None, :])
        out = _dot(roped, hm, IEEE)
        out = tl.where((h < NUM_Q)[:, None], out * inv_p, out)
        tl.debug_barrier()  # every head's row read before any is written
        tl.store(x_ptr, out.to(qkv_ptr.dtype.element_ty), mask=rot[:, None])
        return  # _fp8_store_kernel stores k and v, by blocks
    d = tl.arange(0, half)
    cos = tl.load(cos_ptr + pos * DIM + d).to(tl.float32)
    sin = tl.load(sin_ptr + pos * DIM + d).to(tl.float32)
    lo_ptr = row + h[:, None] * DIM + d[None, :]
    lo = tl.load(lo_ptr, mask=rot[:, None], other=0.0).to(tl.float32)
    hi = tl.load(lo_ptr + half, mask=rot[:, None], other=0.0).to(tl.float32)
    new_lo = lo * cos[None, :] - hi * sin[None, :]
    new_hi = hi * cos[None, :] + lo * sin[None, :]
    tl.store(lo_ptr, new_lo.to(qkv_ptr.dtype.element_ty), mask=rot[:, None])
    tl.store(lo_ptr + half, new_hi.to(qkv_ptr.dtype.element_ty), mask=rot[:, None])
    if KV_FP8:  # _fp8_store_kernel stores k and v, by blocks
        return
    # rotated k, and v, into the pool
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page_base = (slot // PAGE) * LAYERS + layer
    offset = slot % PAGE
    is_k = (h >= NUM_Q) & rot
    k_block = (page_base * 2) * NUM_KV + (h - NUM_Q)
    k_dst = pool_ptr + k_block * BLOCK + offset * DIM
    k_dst = k_dst[:, None] + d[None, :]
    tl.store(k_dst, new_lo.to(pool_ptr.dtype.element_ty), mask=is_k[:, None])
    tl.store(k_dst + half, new_hi.to(pool_ptr.dtype.element_ty), mask=is_k[:, None])
    j = tl.arange(0, KV_PAD)
    is_v = j < NUM_KV
    full = tl.arange(0, DIM)
    v = tl.load(row + (NUM_Q + NUM_KV + j)[:, None] * DIM + full[None, :], mask=is_v[:, None], other=0.0)
    v_block = (page_base * 2 + 1) * NUM_KV + j
    v_dst = pool_ptr + v_block * BLOCK + offset * DIM
    store_kv(pool_ptr, v_dst[:, None] + full[None, :], v.to(tl.float32), is_v)


@triton.jit(do_not_specialize=["layer", "stride_qkv", "num_tokens"])
def _fp8_store_kernel(
    qkv_ptr,
    slot_ptr,
    pool_ptr,
    scale_ptr,
    layer,
    stride_qkv,
    num_tokens,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    DIM: tl.constexpr,
    PAGE: tl.constexpr,
    LAYERS: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Program (t, j): if token ``t`` is the first of the step's tokens in its page (a sequence's
    tokens are consecutive rows with consecutive slots), the rows of its run in that page of
    head ``j`` of the k heads then the v heads (``qkv``'s columns from ``NUM_Q``), into one FP8
    block (:func:`.paged.store_fp8_rows`); every other program returns at once."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    prev = tl.load(slot_ptr + tl.maximum(t - 1, 0)).to(tl.int64)
    offset = slot % PAGE
    if (t > 0) & (offset > 0) & (prev == slot - 1):
        return  # the run's first token stores it
    r = tl.arange(0, PAGE)
    rows = t + r
    in_batch = rows < num_tokens
    slots = tl.load(slot_ptr + rows, mask=in_batch, other=-1).to(tl.int64)
    ok = in_batch & (slots == slot + r) & (offset + r < PAGE)
    d = tl.arange(0, DIM)
    src = qkv_ptr + rows.to(tl.int64)[:, None] * stride_qkv + (NUM_Q + j) * DIM + d[None, :]
    x = tl.load(src, mask=ok[:, None], other=0.0).to(tl.float32)
    block = ((slot // PAGE) * LAYERS + layer) * 2 * NUM_KV + j  # (K|V, head) of j
    store_fp8_rows(pool_ptr, scale_ptr, block, offset, x, ok, r, d, PAGE, DIM, BLOCK, SCALE_BLOCK, EXACT)


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
    strides = block_strides(pool, kv_scales)
    fused = kv_scales is not None and FUSED_KEY_ROTATION
    had, p = kv_key_rotation(dim, qkv.dtype, qkv.device) if fused else (qkv, 1)
    heads_pad = triton.next_power_of_2(num_q + num_kv)
    _rope_store_kernel[(num_tokens,)](
        qkv,
        cos,
        sin,
        positions,
        slots,
        pool,
        had,
        1.0 / p,
        layer,
        qkv.stride(0),
        NUM_Q=num_q,
        NUM_KV=num_kv,
        HEADS_PAD=max(heads_pad, 16) if fused else heads_pad,  # (a product's tile has 16 rows at least)
        KV_PAD=triton.next_power_of_2(num_kv),
        DIM=dim,
        PAGE=page,
        LAYERS=layers,
        BLOCK=strides["BLOCK"],
        KV_FP8=strides["KV_FP8"],
        HADAMARD=fused,
        IEEE=qkv.dtype == torch.float32,
        num_warps=4,
    )
    if kv_scales is not None:  # into an FP8 pool q and k are rotated (quant.kv_key_rotation), then k stored
        if not fused:
            rotate_qk_(qkv[:, : (num_q + num_kv) * dim].view(num_tokens, num_q + num_kv, dim), num_q)
        _fp8_store_kernel[(num_tokens, 2 * num_kv)](
            qkv,
            slots,
            pool,
            kv_scales,
            layer,
            qkv.stride(0),
            num_tokens,
            NUM_Q=num_q,
            NUM_KV=num_kv,
            DIM=dim,
            PAGE=page,
            LAYERS=layers,
            BLOCK=strides["BLOCK"],
            SCALE_BLOCK=strides["SCALE_BLOCK"],
            EXACT=interpreting(),
            num_warps=4,
        )
