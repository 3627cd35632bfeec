"""Paged attention over the KV pool, read in place (the rotary-embed + KV-store kernel: :mod:`.rope`).

Pool layout ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]`` (see
:mod:`pdserve.engine.kv_pool`): the K of (page, layer, head) is one contiguous
``[page_size, head_dim]`` block and its V lies ``num_kv_heads * page_size * head_dim``
elements further. A token's *slot* is ``page * page_size + offset``.

* :func:`decode_attention`: one query token per sequence over its pages; every query
  head of a GQA group in one program (one pass over the group's K/V), the context
  split ``num_splits`` ways so that a small batch still fills the GPU, then merged.
  With ``rope``, it does :func:`.rope.rope_store`'s work for its tokens too (one launch
  fewer a layer: at batch 1 a launch costs more than the work).
* :func:`.paged_prefill.prefill_attention`: chunks of query tokens whose keys are a cached
  or earlier prefix in the pool plus the chunk itself (causal), on this module's helpers.

FP8 pools (``kv_scales`` given, see :mod:`pdserve.engine.kv_pool`): K and V are read in place as
float8_e4m3fn and converted to the query's dtype in registers (exact), each token's block scale
(one float32 per (page, layer, K|V, head)) loaded beside its row; the key scales multiply the
score columns and the value scales the probabilities (:func:`pdserve.engine.quant.quantize_kv_fp8`),
so no tile is dequantized. A block of a (page, layer, head) is then ``page_size * head_dim + 4``
bytes: the kernels take the block stride from the pool view's strides. A store into a block
(:func:`store_fp8_rows`) may re-encode the block's earlier tokens, so a decode split that stores
its sequence's new token owns that token's whole page: the splits start on page boundaries.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import interpreting
from pdserve.engine.kernels.elementwise import to_fp8
from pdserve.engine.quant import kv_key_rotation


# Integer arguments that change between calls (the layer, a table's width) are not
# specialised on: Triton compiles a variant per value class (1, a multiple of 16, other),
# and a variant first met while serving compiles then, for a second or more.
@triton.jit
def _kv_block(table_row, tok, valid, layer, kv_head, NUM_KV: tl.constexpr, PAGE: tl.constexpr, LAYERS: tl.constexpr):
    """The index of the K block of (the page of each of ``tok``, ``layer``, ``kv_head``) for a
    sequence whose page table row starts at ``table_row``; its V block is ``NUM_KV`` further."""
    page = tl.load(table_row + tok // PAGE, mask=valid, other=0).to(tl.int64)
    return ((page * LAYERS + layer) * 2) * NUM_KV + kv_head


@triton.jit
def _load_kv(
    pool_ptr,
    scale_ptr,
    block,
    tok,
    valid,
    d,
    NUM_KV: tl.constexpr,
    PAGE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """K and V ``[len(tok), DIM]`` of positions ``tok`` in blocks ``block`` (:func:`_kv_block`;
    ``BLOCK`` elements apart), as stored, and (FP8) their scales ``[len(tok)]``; 16 bits:
    ``valid`` in place of the scales, unused."""
    k_off = block * BLOCK + (tok % PAGE) * DIM
    k = tl.load(pool_ptr + k_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(pool_ptr + (k_off + NUM_KV * BLOCK)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    k_scale = valid
    v_scale = valid
    if KV_FP8:  # one scale a block: the tokens of a page load the same one
        k_scale = tl.load(scale_ptr + block * SCALE_BLOCK, mask=valid, other=0.0)
        v_scale = tl.load(scale_ptr + (block + NUM_KV) * SCALE_BLOCK, mask=valid, other=0.0)
    return k, v, k_scale, v_scale


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32 (``IEEE``: float32 operands, no TF32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b).to(tl.float32)


@triton.jit
def _scores(q, k, scale, k_scale, IEEE: tl.constexpr, KV_FP8: tl.constexpr):
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
    if KV_FP8:  # q . k_i = (q . kq_i) * ks_i
        s = s * k_scale[None, :]
    return s


@triton.jit
def _online_softmax(s, v, v_scale, m_i, l_i, acc, IEEE: tl.constexpr, KV_FP8: tl.constexpr):
    """One block of keys into the running max ``m_i``, sum ``l_i`` and output ``acc``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing to attend yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = p
    top = 1.0
    if KV_FP8:  # sum_i p_i v_i = sum_i (p_i * vs_i) vq_i
        if v.dtype == tl.float16:
            # = top * sum_i (p_i * vs_i / top) vq_i, top the block's largest value scale: the
            # weights stay within [0, 1] as p does (p * vs alone would fall below float16's
            # normal range), and the powers of two change no rounding
            top = tl.max(v_scale, 0)
            top = tl.where(top > 0, top, 1.0)
            pv = p * (v_scale / top)[None, :]
        else:
            pv = p * v_scale[None, :]
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee") * top
    else:
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v).to(tl.float32) * top
    return m_new, l_i, acc


@triton.jit
def f16_queries(q):
    """``q`` for float16 tiles of an FP8 pool (``F16``: e4m3 converts to float16 in one
    instruction a pair, to bfloat16 through float16 in three), clamped to float16's range (a
    bfloat16 value within it converts exactly)."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def store_kv(pool_ptr, dst, x, rows_ok):
    """Rows ``x [R, D]`` (float32) into a 16-bit pool at ``dst [R, D]`` (pointers), in its dtype."""
    tl.store(dst, x.to(pool_ptr.dtype.element_ty), mask=rows_ok[:, None])


@triton.jit
def block_scale(amax):
    """:func:`pdserve.engine.quant.kv_block_scale`: ``amax / 448`` rounded up to a power of two."""
    t = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    return ((t.to(tl.int32, bitcast=True) + 0x7FFFFF) & -8388608).to(tl.float32, bitcast=True)


@triton.jit
def store_fp8_rows(
    pool_ptr,
    scale_ptr,
    block,
    offset,
    x,
    rows_ok,
    r,
    d,
    PAGE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Rows ``x [R, DIM]`` (float32; those of ``rows_ok``) into FP8 block ``block`` at offsets
    ``offset + r`` (``r``: ``arange(R)``), as :func:`pdserve.engine.quant.store_kv_fp8_blocks`
    stores them, bit for bit: the block's scale grows to cover them, its tokens below ``offset``
    re-encoded where it does. One program stores all of a block's rows of a step."""
    amax = tl.max(tl.max(tl.where(rows_ok[:, None], tl.abs(x), 0.0), 1), 0)
    s_ptr = scale_ptr + block * SCALE_BLOCK
    old = tl.load(s_ptr, mask=offset > 0, other=0.0)  # a block written from offset 0 has no tokens
    new = tl.maximum(block_scale(amax), old)
    base = pool_ptr + block * BLOCK
    if (offset > 0) & (new > old):  # an exponent shift of the tokens already there
        p = tl.arange(0, PAGE)
        held = (p < offset)[:, None]
        ptrs = base + p[:, None] * DIM + d[None, :]
        q_old = tl.load(ptrs, mask=held, other=0.0).to(tl.float32)
        tl.store(ptrs, to_fp8(q_old * old, new, pool_ptr, EXACT), mask=held)
    dst = base + (offset + r)[:, None] * DIM + d[None, :]
    tl.store(dst, to_fp8(x, new, pool_ptr, EXACT), mask=rows_ok[:, None])
    tl.store(s_ptr, new)


@triton.jit(do_not_specialize=["n"])
def _round_kv_fp8_kernel(
    x_ptr, out_ptr, fp8_ptr, n, stride_x, k_col, stride_out, stride_out_kv, out_col,
    NUM_KV: tl.constexpr, PAGE: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    """Program (block, head, K|V): the ``PAGE`` rows of one block of a fresh prompt's keys or
    values, quantized as the pool stores them and read back in ``out``'s dtype (row ``r`` of
    head ``h`` of K or V at ``out_col + r * stride_out + kv * stride_out_kv + h * DIM``: ``out``
    may be ``x`` itself, each program reading its block whole before writing it)."""
    r = tl.program_id(0) * PAGE + tl.arange(0, PAGE)
    head = tl.program_id(1)
    kv = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    ok = (r < n)[:, None] & (d < DIM)[None, :]
    col = k_col + (kv * NUM_KV + head) * DIM
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + col + d[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = block_scale(tl.max(tl.max(tl.abs(x), 1), 0))
    y = to_fp8(x, scale, fp8_ptr, EXACT).to(tl.float32) * scale
    dst = out_ptr + out_col + r.to(tl.int64)[:, None] * stride_out + kv * stride_out_kv + head * DIM + d[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=ok)


def round_kv_fp8(
    rows: torch.Tensor,
    k_col: int,
    num_kv: int,
    head_dim: int,
    page_size: int,
    pool: torch.Tensor,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of one fresh prompt's ``rows`` (qkv ``[n, ...]``, its K heads from
    column ``k_col``, its V heads after them) as an FP8 ``pool`` holds them once stored
    (``page_size``-token blocks from its first token, each quantized with its own scale), in
    ``rows``' dtype: ``(k, v)``, each ``[n, num_kv, head_dim]``, bit for bit
    :func:`pdserve.engine.kv_pool.round_fp8` of each, in one launch (that function's torch
    passes, a dozen launches a call for K and again for V, every layer, every prompt of a step:
    64 prompts of 512 tokens reached their first tokens in 0.81 s against 0.46 over a bf16 pool
    on an H100, 2026-12-06). ``in_place``: written over ``rows``' own K and V columns, and
    ``(k, v)`` are views of them (no buffer: ~8 MB a layer at 4,096 tokens of a 7B model, and
    the copy back a caller would make)."""
    n = rows.shape[0]
    assert rows.stride(1) == 1 and page_size & (page_size - 1) == 0
    width = num_kv * head_dim
    if in_place:
        out, stride_out, stride_kv, col = rows, rows.stride(0), width, k_col
    else:
        out = torch.empty((2, n, num_kv, head_dim), dtype=rows.dtype, device=rows.device)
        stride_out, stride_kv, col = width, n * width, 0
    if n:
        _round_kv_fp8_kernel[(triton.cdiv(n, page_size), num_kv, 2)](
            rows, out, pool, n, rows.stride(0), k_col, stride_out, stride_kv, col,
            NUM_KV=num_kv, PAGE=page_size, DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), EXACT=interpreting(),
        )  # fmt: skip
    if in_place:
        kv = rows[:, k_col : k_col + 2 * width]
        return kv[:, :width].unflatten(1, (num_kv, head_dim)), kv[:, width:].unflatten(1, (num_kv, head_dim))
    return out[0], out[1]


@triton.jit(do_not_specialize=["layer", "window", "stride_qt", "stride_table"])
def _decode_kernel(
    q_ptr,
    pool_ptr,
    scale_ptr,
    table_ptr,
    ctx_ptr,
    part_ptr,
    lse_ptr,
    out_ptr,
    counter_ptr,
    layer,
    scale,
    window,
    stride_qt,
    stride_table,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    had_ptr,
    inv_p,
    NUM_KV: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DIM: tl.constexpr,
    PAGE: tl.constexpr,
    LAYERS: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    PDL: tl.constexpr,
    ROPE: tl.constexpr,
    KV_FP8: tl.constexpr,
    EXACT: tl.constexpr,
    F16: tl.constexpr,
):
    if PDL:  # the o projection after this may be scheduled now (it waits for the output)
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    low = 0
    if window > 0:
        low = tl.maximum(ctx - window, 0)
    base = low
    if KV_FP8:  # splits on page boundaries: the split that stores the new token owns its page
        base = low - low % PAGE
    per_split = tl.cdiv(tl.cdiv(ctx - base, SPLITS), ALIGN) * ALIGN
    start = base + split * per_split
    end = tl.minimum(start + per_split, ctx)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM)
    heads = kv_head * GROUP + g
    q_row = q_ptr + b.to(tl.int64) * stride_qt
    q = tl.load(q_row + heads[:, None] * DIM + d[None, :], mask=g[:, None] < GROUP, other=0.0)
    if ROPE:
        # The row is the qkv projection's, not yet rotated (as rope_store would): q rotated
        # here, and the new token's k rotated and stored, with v, by the split that reads it.
        half: tl.constexpr = DIM // 2
        pos = tl.maximum(ctx - 1, 0).to(tl.int64)  # (a row with no context, ctx 0, reads position 0)
        cos = tl.load(cos_ptr + pos * DIM + d).to(tl.float32)  # the table repeats its halves
        sin = tl.load(sin_ptr + pos * DIM + d).to(tl.float32)
        swap = (d + half) % DIM
        sign = tl.where(d < half, -1.0, 1.0)
        q_swap = tl.load(q_row + heads[:, None] * DIM + swap[None, :], mask=g[:, None] < GROUP, other=0.0)
        q = (q.to(tl.float32) * cos[None, :] + sign[None, :] * q_swap.to(tl.float32) * sin[None, :]).to(q.dtype)
        if KV_FP8:  # then q @ H / p, as rope_store's rotate_qk_ (quant.kv_key_rotation)
            hm = tl.load(had_ptr + d[:, None] * DIM + d[None, :])
            q = (_dot(q, hm, IEEE) * inv_p).to(q.dtype)
        if (start <= ctx - 1) & (ctx - 1 < end):
            k_src = q_row + (NUM_KV * GROUP + kv_head) * DIM
            k_new = tl.load(k_src + d).to(tl.float32) * cos + sign * tl.load(k_src + swap).to(tl.float32) * sin
            v_new = tl.load(q_row + (NUM_KV * GROUP + NUM_KV + kv_head) * DIM + d)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            block = ((slot // PAGE) * LAYERS + layer) * 2 * NUM_KV + kv_head
            k_dst = pool_ptr + block * BLOCK + (slot % PAGE) * DIM
            if KV_FP8:  # the k a separate rope_store would quantize: rotated, rounded to q's dtype
                one = tl.full([1], 1, tl.int1)
                r = tl.zeros([1], tl.int32)
                offset = slot % PAGE
                # k @ H as one row of a tile (a dot needs 16), rounded to q's dtype as rope_store's
                k_tile = tl.where(g[:, None] == 0, k_new.to(q.dtype).to(tl.float32)[None, :], 0.0).to(q.dtype)
                k_rows = tl.sum(_dot(k_tile, hm, IEEE), 0).to(q.dtype).to(tl.float32)[None, :]
                store_fp8_rows(
                    pool_ptr, scale_ptr, block, offset, k_rows, one, r, d, PAGE, DIM, BLOCK, SCALE_BLOCK, EXACT
                )
                v_rows = v_new.to(tl.float32)[None, :]
                v_block = block + NUM_KV
                store_fp8_rows(
                    pool_ptr, scale_ptr, v_block, offset, v_rows, one, r, d, PAGE, DIM, BLOCK, SCALE_BLOCK, EXACT
                )
            else:
                tl.store(k_dst + d, k_new.to(pool_ptr.dtype.element_ty))
                tl.store(k_dst + NUM_KV * BLOCK + d, v_new.to(pool_ptr.dtype.element_ty))
        tl.debug_barrier()  # the stores are seen by this program's loads below
    if F16:
        q = f16_queries(q)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_table
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        valid = tok < end
        if KV_FP8:
            valid = valid & (tok >= low)
        block = _kv_block(table_row, tok, valid, layer, kv_head, NUM_KV, PAGE, LAYERS)
        k, v, ks, vs = _load_kv(
            pool_ptr, scale_ptr, block, tok, valid, d, NUM_KV, PAGE, DIM, BLOCK, SCALE_BLOCK, KV_FP8
        )
        if KV_FP8:  # e4m3 values are exact in q's dtype (16 bits)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.where(valid[None, :], _scores(q, k, scale, ks, IEEE, KV_FP8), float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, vs, m_i, l_i, acc, IEEE, KV_FP8)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLITS == 1:  # the whole context in this program: the output itself, nothing to merge
        dst = out_ptr + (b * NUM_KV * GROUP + heads).to(tl.int64)[:, None] * DIM + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=g[:, None] < GROUP)
        return
    # [B, Hq, SPLITS, D] partial outputs and their log-sum-exp (-inf for an empty split)
    row = (b * NUM_KV * GROUP + heads).to(tl.int64) * SPLITS + split
    tl.store(part_ptr + row[:, None] * DIM + d[None, :], out, mask=g[:, None] < GROUP)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + row, lse, mask=g < GROUP)
    if FUSED_MERGE:
        # The last split of this (sequence, kv head) to finish merges the group's partials.
        tl.debug_barrier()
        counter = counter_ptr + b * NUM_KV + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
            s = tl.arange(0, SPLITS_PAD)
            first = (b * NUM_KV * GROUP + heads).to(tl.int64) * SPLITS
            live = (g[:, None] < GROUP) & (s[None, :] < SPLITS)
            lses = tl.load(lse_ptr + first[:, None] + s[None, :], mask=live, other=float("-inf"), cache_modifier=".cg")
            top = tl.max(lses, 1)
            w = tl.exp(lses - tl.where(top == float("-inf"), 0.0, top)[:, None])  # padding rows: all -inf
            merged = tl.zeros([GROUP_PAD, DIM], tl.float32)
            for j in tl.static_range(SPLITS):
                wj = tl.sum(tl.where(s[None, :] == j, w, 0.0), 1)
                pj = tl.load(
                    part_ptr + (first + j)[:, None] * DIM + d[None, :],
                    mask=g[:, None] < GROUP,
                    other=0.0,
                    cache_modifier=".cg",
                )
                merged += pj * wj[:, None]
            total = tl.sum(w, 1)
            merged = merged / tl.where(total > 0, total, 1.0)[:, None]
            dst = out_ptr + (b * NUM_KV * GROUP + heads).to(tl.int64)[:, None] * DIM + d[None, :]
            tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=g[:, None] < GROUP)
            tl.atomic_xchg(counter, 0)  # ready for the next launch (and the next graph replay)


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, out_ptr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM: tl.constexpr, PDL: tl.constexpr
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)  # b * Hq + head
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM)
    lse = tl.load(lse_ptr + row * SPLITS + s, mask=s < SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)
    part = tl.load(part_ptr + (row * SPLITS + s)[:, None] * DIM + d[None, :], mask=(s < SPLITS)[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * DIM + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    page_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    splits: int,
    out: torch.Tensor,
    window: int | None = None,
    block_n: int | None = None,
    counters: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    pdl: bool = False,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kv_scales: torch.Tensor | None = None,
    f16: bool | None = None,
) -> torch.Tensor:
    """``q [B, Hq, D]`` (rows may be strided) attends each sequence's ``ctx_lens[b]`` tokens
    in pages ``page_tables[b]``; writes ``out [B, Hq, D]``. Graph-safe: no host sync.

    ``rope = (cos, sin, slots)``: ``q`` is the q part of rows of the fused qkv projection,
    not yet rotated, and the last of each sequence's tokens is the row's own: the kernel
    does :func:`.rope.rope_store`'s work for it (q rotated as it is read, the token's k rotated
    and stored with its v in ``slots[b]`` of ``layer``, position ``ctx_lens[b] - 1``).

    ``kv_scales``: ``pool`` is an FP8 pool's values and these its scales
    (:attr:`pdserve.engine.kv_pool.KVPool.kv_scales`); read in place, and with ``rope`` q and the
    new token's k are rotated as :func:`.rope.rope_store` rotates them for an FP8 pool
    (:func:`pdserve.engine.quant.rotate_qk_`), and k (rounded to ``q``'s dtype) and v stored
    into their blocks. ``f16``: a bfloat16 ``q`` attends an FP8 pool in float16 tiles (see
    :func:`f16_tiles`; default :data:`FP8_F16_TILES`).

    ``counters`` (int32, at least ``B * num_kv``, zero, left zero): the splits are merged
    inside the attention kernel by whichever finishes last, instead of by a second kernel.
    With one split the kernel writes ``out`` itself and nothing is merged. ``pdl``: the
    kernel that writes ``out`` lets a programmatic dependent start early (CUDA only).

    Unless given, keys per block and pipeline stages are the fastest that
    ``bench/attention_probe.py`` found on an H200 (7B layout, 640-token contexts,
    2026-12-01): one split (large batches) 128 keys in 3 stages, 25.0 us a layer at batch 64
    against 29.5 with 64; 32 splits 32 keys in 2 stages (5.6 us at batch 1); between, 64
    keys in 2 stages (16 splits: 5.9 us at batch 1, 6.2 in 3 stages).
    """
    if block_n is None:
        block_n = 128 if splits == 1 else 32 if splits >= 32 else 64
    if num_stages is None:
        num_stages = 3 if splits == 1 else 2
    batch, num_q, dim = q.shape
    _, layers, _, num_kv, page, _ = pool.shape
    group = num_q // num_kv
    assert q.stride(2) == 1 and q.stride(1) == dim and out.is_contiguous()
    shape = (batch, num_q, splits) if splits > 1 else (1, 1, 1)
    part = torch.empty((*shape, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    if rope is not None:
        rows_ok = batch == 1 or q.stride(0) >= (num_q + 2 * num_kv) * dim  # (one row: any stride)
        assert rows_ok, "q must be rows of the fused qkv projection"
    cos, sin, slots = rope if rope is not None else (lse, lse, lse)
    had, p = (lse, 1)
    if rope is not None and kv_scales is not None:  # q and the new k rotated as rope_store rotates them
        had, p = kv_key_rotation(dim, q.dtype, q.device)
    _decode_kernel[(batch, num_kv, splits)](
        q,
        pool,
        kv_scales if kv_scales is not None else pool,
        page_tables,
        ctx_lens,
        part,
        lse,
        out,
        counters if counters is not None else lse,
        layer,
        scale,
        window or 0,
        q.stride(0),
        page_tables.stride(0),
        cos,
        sin,
        slots,
        had,
        1.0 / p,
        NUM_KV=num_kv,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        DIM=dim,
        PAGE=page,
        LAYERS=layers,
        **block_strides(pool, kv_scales),
        BLOCK_N=block_n,
        ALIGN=math.lcm(block_n, page) if kv_scales is not None else block_n,
        SPLITS=splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        IEEE=q.dtype == torch.float32,
        FUSED_MERGE=counters is not None and splits > 1,
        PDL=pdl and (splits == 1 or counters is not None),
        ROPE=rope is not None,
        EXACT=interpreting(),
        F16=f16_tiles(q, kv_scales, f16),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if counters is None and splits > 1:
        _merge_kernel[(batch * num_q,)](
            part,
            lse,
            out,
            SPLITS=splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
            DIM=dim,
            PDL=pdl,
            num_warps=4,
        )
    return out


# Whether a bfloat16 model's attention over an FP8 pool converts the pool's tiles to float16
# (and its queries with them) rather than to bfloat16: Triton converts e4m3 to float16 in one
# instruction a pair and to bfloat16 through float16 in three, once for every element of every
# tile read. On an H100 at the engine's launch settings, batch 64 and 640 tokens a sequence, a
# layer took 38.2 us in float16 tiles against 49.5 in bf16 ones (bf16 KV: 32.6), at batch 1 the
# same 7.1 (docs/data/attention_tiles_h100.json, 2026-12-06). float16 keeps three more bits of
# the weights and queries than bf16 (a bf16 query within its range converts exactly).
FP8_F16_TILES = True


def f16_tiles(q: torch.Tensor, kv_scales: torch.Tensor | None, f16: bool | None = None) -> bool:
    """Whether the kernels read an FP8 pool's tiles as float16 for a ``q`` of its dtype:
    bfloat16 queries, an FP8 pool, and ``f16`` (default :data:`FP8_F16_TILES`); a float16
    ``q`` reads them so anyway, a float32 one (the CPU's) as float32."""
    on = FP8_F16_TILES if f16 is None else f16
    return on and kv_scales is not None and q.dtype == torch.bfloat16


def block_strides(pool: torch.Tensor, kv_scales: torch.Tensor | None) -> dict[str, int | bool]:
    """The kernels' constants for the pool's layout: elements from one (page, layer, K|V, head)
    block to the next (``page_size * head_dim`` in 16 bits, the block's bytes in FP8), and the
    scales' (float32 elements) when the pool is FP8. Taken from the K|V dimension's stride (that
    of a dimension of size 1 says nothing)."""
    _, _, _, heads, page, dim = pool.shape
    block = pool.stride(2) // heads
    assert (
        pool.stride(2) == heads * block and (dim == 1 or pool.stride(5) == 1) and (page == 1 or pool.stride(4) == dim)
    )
    if kv_scales is None:
        assert pool.dtype != torch.float8_e4m3fn, "an FP8 pool needs its kv_scales"
        return {"BLOCK": block, "SCALE_BLOCK": 0, "KV_FP8": False}
    assert pool.dtype == torch.float8_e4m3fn and kv_scales.dtype == torch.float32
    scale_block = kv_scales.stride(2) // heads
    assert kv_scales.shape == pool.shape[:4] and (heads == 1 or kv_scales.stride(3) == scale_block)
    assert kv_scales.stride(2) == heads * scale_block and scale_block * kv_scales.element_size() == block, (
        "a scale inside each block"
    )
    return {"BLOCK": block, "SCALE_BLOCK": scale_block, "KV_FP8": True}
