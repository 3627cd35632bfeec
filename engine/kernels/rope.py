"""The rotary-embed + KV-store kernel: rotates q and k in place inside the fused qkv
projection output and writes k, v into their slots of one layer of the page pool
(layout in :mod:`pdserve.engine.kernels.paged`). Into an FP8 pool one kernel does the rotary and
then rotates q and k once more, as :func:`pdserve.engine.quant.rotate_qk_` would after it (a
Hadamard rotation that leaves every score as it was: a product on the tensor cores, in place of
torch's product, scaling and copy over the whole step's rows), and a second kernel stores each k
(as rotated into ``qkv``, in its dtype) and v: one program a block of the step's tokens, whose
scale it grows to cover them (:func:`pdserve.engine.quant.store_kv_fp8_blocks`, bit for bit)."""

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


def rotation_tokens(num_tokens: int) -> int:
    """Tokens a program of the fused rotation takes: one while a step's tokens are a few
    hundred (a program each keeps the SMs busy), up to 8 in long prefills (the rotation's
    matrix read once a program)."""
    return max(1, min(8, num_tokens // 512))


# The layer and the row stride are not specialised on (see paged.py).
@triton.jit(do_not_specialize=["layer", "stride_qkv"])
def _rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    pool_ptr,
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


@triton.jit(do_not_specialize=["stride_qkv", "num_tokens", "per_program"])
def _rope_rotate_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    had_ptr,
    inv_p,
    stride_qkv,
    num_tokens,
    per_program,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Before an FP8 pool: each of ``per_program`` tokens' q and k heads rotated (the rotary,
    rounded to the row's dtype as :func:`_rope_store_kernel` stores it), then multiplied by the
    key rotation ``H`` (q's over ``p``: :func:`pdserve.engine.quant.rotate_qk_`), in place; ``H``
    read once a program (32 KiB at 128 dimensions: once a token, a 4,096-token step would read
    it 4,096 times over from L2 a layer)."""
    half: tl.constexpr = DIM // 2
    full = tl.arange(0, DIM)
    swap = (full + half) % DIM
    sign = tl.where(full < half, -1.0, 1.0)
    h = tl.arange(0, HEADS_PAD)
    rot = h < NUM_Q + NUM_KV
    hm = tl.load(had_ptr + full[:, None] * DIM + full[None, :])
    first = tl.program_id(0) * per_program
    for t in range(first, tl.minimum(first + per_program, num_tokens)):
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + pos * DIM + full).to(tl.float32)  # the table repeats its halves
        sin = tl.load(sin_ptr + pos * DIM + full).to(tl.float32)
        row = qkv_ptr + tl.cast(t, tl.int64) * stride_qkv
        x_ptr = row + h[:, None] * DIM + full[None, :]
        x = tl.load(x_ptr, mask=rot[:, None], other=0.0)
        x_swap = tl.load(row + h[:, None] * DIM + swap[None, :], mask=rot[:, None], other=0.0).to(tl.float32)
        roped = (x.to(tl.float32) * cos[None, :] + sign[None, :] * x_swap * sin[None, :]).to(x.dtype)
        out = _dot(roped, hm, IEEE)
        out = tl.where((h < NUM_Q)[:, None], out * inv_p, out)
        tl.debug_barrier()  # every head's row read before any is written
        tl.store(x_ptr, out.to(qkv_ptr.dtype.element_ty), mask=rot[:, None])


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
    if kv_scales is not None and FUSED_KEY_ROTATION:  # the rotary and the key rotation in one
        had, p = kv_key_rotation(dim, qkv.dtype, qkv.device)
        per_program = rotation_tokens(num_tokens)
        _rope_rotate_kernel[(triton.cdiv(num_tokens, per_program),)](
            qkv,
            cos,
            sin,
            positions,
            had,
            1.0 / p,
            qkv.stride(0),
            num_tokens,
            per_program,
            NUM_Q=num_q,
            NUM_KV=num_kv,
            HEADS_PAD=max(16, triton.next_power_of_2(num_q + num_kv)),  # (a product's tile: 16 rows at least)
            DIM=dim,
            IEEE=qkv.dtype == torch.float32,
            num_warps=4,
        )
    else:
        _rope_store_kernel[(num_tokens,)](
            qkv,
            cos,
            sin,
            positions,
            slots,
            pool,
            layer,
            qkv.stride(0),
            NUM_Q=num_q,
            NUM_KV=num_kv,
            HEADS_PAD=triton.next_power_of_2(num_q + num_kv),
            KV_PAD=triton.next_power_of_2(num_kv),
            DIM=dim,
            PAGE=page,
            LAYERS=layers,
            BLOCK=strides["BLOCK"],
            KV_FP8=strides["KV_FP8"],
            num_warps=4,
        )
        if kv_scales is not None:  # into an FP8 pool q and k are rotated (quant.kv_key_rotation)
            rotate_qk_(qkv[:, : (num_q + num_kv) * dim].view(num_tokens, num_q + num_kv, dim), num_q)
    if kv_scales is not None:  # then k and v stored, by blocks
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
