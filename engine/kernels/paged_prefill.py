"""Paged prefill attention: chunks of query tokens whose keys are a cached or earlier prefix
in the pool plus the chunk itself (causal), read in place. The pool's layout, the FP8 pools
and the helpers it shares with decode: :mod:`.paged`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.paged import (
    _kv_block,
    _load_kv,
    _online_softmax,
    _scores,
    block_strides,
    f16_queries,
    f16_tiles,
)

# chunks of up to this many rows take query tiles of 16 rows, longer ones 64: two compiled
# kernels a dtype (what the fast path's warm-up compiles)
SHORT_CHUNK = 32


@triton.jit(do_not_specialize=["layer", "window", "stride_qt", "stride_table"])
def _prefill_kernel(
    q_ptr,
    pool_ptr,
    scale_ptr,
    table_ptr,
    q_start_ptr,
    q_len_ptr,
    ctx_ptr,
    out_ptr,
    layer,
    scale,
    window,
    stride_qt,
    stride_table,
    NUM_KV: tl.constexpr,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    PAGE: tl.constexpr,
    LAYERS: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    F16: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    span = tl.program_id(2)
    q_len = tl.load(q_len_ptr + span)
    if m_block * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_start_ptr + span)
    ctx = tl.load(ctx_ptr + span).to(tl.int32)
    prefix = ctx - q_len
    kv_head = head // GROUP
    i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_q = i < q_len
    q_pos = prefix + i
    d = tl.arange(0, DIM)
    q_rows = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * DIM + d[None, :], mask=valid_q[:, None], other=0.0)
    if F16:
        q = f16_queries(q)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    hi = tl.minimum(prefix + (m_block + 1) * BLOCK_M, ctx)
    lo = 0
    if window > 0:
        lo = tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    table_row = table_ptr + span.to(tl.int64) * stride_table
    for n0 in range(lo, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        valid_k = tok < hi
        block = _kv_block(table_row, tok, valid_k, layer, kv_head, NUM_KV, PAGE, LAYERS)
        k, v, ks, vs = _load_kv(
            pool_ptr, scale_ptr, block, tok, valid_k, d, NUM_KV, PAGE, DIM, BLOCK, SCALE_BLOCK, KV_FP8
        )
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        keep = valid_k[None, :] & (tok[None, :] <= q_pos[:, None])
        if window > 0:
            keep = keep & (tok[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, _scores(q, k, scale, ks, IEEE, KV_FP8), float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, vs, m_i, l_i, acc, IEEE, KV_FP8)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows past the chunk attend nothing
    num_q: tl.constexpr = NUM_KV * GROUP
    tl.store(
        out_ptr + q_rows[:, None] * (num_q * DIM) + head * DIM + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=valid_q[:, None],
    )


def prefill_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    page_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    kv_scales: torch.Tensor | None = None,
    f16: bool | None = None,
) -> torch.Tensor:
    """Spans of ``q [T, Hq, D]`` (span ``s``: rows ``q_starts[s]`` onwards, ``q_lens[s]`` of
    them, the last at position ``ctx_lens[s] - 1``) attend causally to their sequence's
    pages ``page_tables[s]``, which already hold the span's own K/V; writes ``out [T, Hq, D]``.
    ``kv_scales``: ``pool`` is an FP8 pool's values and these its scales, read in place (``f16``:
    in float16 tiles, :func:`.paged.f16_tiles`)."""
    _, num_q, dim = q.shape
    _, layers, _, num_kv, page, _ = pool.shape
    assert q.stride(2) == 1 and q.stride(1) == dim and out.is_contiguous()
    block_m = 64 if max_q_len > SHORT_CHUNK else 16
    grid = (triton.cdiv(max_q_len, block_m), num_q, q_lens.shape[0])
    _prefill_kernel[grid](
        q,
        pool,
        kv_scales if kv_scales is not None else pool,
        page_tables,
        q_starts,
        q_lens,
        ctx_lens,
        out,
        layer,
        scale,
        window or 0,
        q.stride(0),
        page_tables.stride(0),
        NUM_KV=num_kv,
        GROUP=num_q // num_kv,
        DIM=dim,
        PAGE=page,
        LAYERS=layers,
        **block_strides(pool, kv_scales),
        BLOCK_M=block_m,
        BLOCK_N=64,
        IEEE=q.dtype == torch.float32,
        F16=f16_tiles(q, kv_scales, f16),
        num_warps=4,
    )
    return out
