"""Paged attention registered in ``transformers``' attention registry.

The stock model code computes q, k, v (with its own rotary embedding) and calls the
attention function by name; ours writes the step's new k, v into the worker's page
pool and attends over each sequence's pages. The step's layout travels in the
``pd_attn`` keyword argument (an :class:`AttentionMetadata`), which ``transformers``
forwards from ``model(...)`` down to every attention call.

The batch is packed: one row of ``T`` tokens, decode tokens first (one per
sequence), then prefill chunks. Pool layout (see :mod:`pdserve.engine.kv_pool`):
``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``. Viewed as rows of
``page_size * head_dim`` values, row ``((page * L + layer) * 2 + kv) * H + head`` is one
head's K or V for one page, so one ``index_select`` per layer gathers a group's K and V
directly in the ``[batch, heads, tokens, head_dim]`` order attention wants.

An FP8 pool (``kv_scales`` set): queries and keys are rotated first
(:func:`pdserve.engine.quant.rotate_queries_keys`: the scores unchanged, the keys' outliers
spread before FP8 rounds them), the new K/V quantized as they are stored and the gathered
pages dequantized into the query's dtype (:func:`pdserve.engine.kv_pool.store_fp8`,
:func:`~pdserve.engine.kv_pool.gather_fp8`); a fresh prompt attending over its own K/V takes
them rounded so too (:func:`~pdserve.engine.kv_pool.round_fp8`): every attention sees the K/V as
the pool holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.engine.kv_pool import gather_fp8, round_fp8, store_fp8
from pdserve.engine.quant import rotate_queries_keys

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class PrefillSpan:
    """One sequence's chunk of new tokens in the packed batch."""

    q_start: int  # index of the chunk's first token in the packed batch
    q_len: int
    ctx_len: int  # tokens of KV after this chunk (cached prefix + chunk)
    rows: torch.Tensor | None  # [2, 1, H, pages] row ids of layer 0 (None when fresh)

    @property
    def is_fresh(self) -> bool:
        return self.ctx_len == self.q_len


@dataclass
class DecodeGroup:
    """Decode sequences of similar length, attended together padded to the longest."""

    start: int  # first decode token index in the packed batch
    count: int
    rows: torch.Tensor  # [2, count, H, max_pages] row ids of layer 0
    ctx_lens: torch.Tensor  # [count]
    positions: torch.Tensor  # [1, max_pages * page_size]
    length: int  # the longest context in the group


@dataclass
class AttentionMetadata:
    """The layout of one forward pass, shared by every layer."""

    kv_pool: torch.Tensor
    write_rows: torch.Tensor  # [2, H, T] rows (of head_dim values) of layer 0 for each new K/V
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    workspace: Workspace
    kv_scales: torch.Tensor | None = None  # an FP8 pool's scales (kv_pool holds its values)
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, group_index: int, window: int | None) -> torch.Tensor:
        key = (group_index, window)
        mask = self._masks.get(key)
        if mask is None:
            g = self.decode_groups[group_index]
            lens = g.ctx_lens[:, None]
            mask = g.positions < lens
            if window is not None:
                mask &= g.positions >= lens - window
            mask = mask[:, None, None, :]
            self._masks[key] = mask
        return mask


def write_rows(pool: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``[2, H, T]`` of ``pool.view(-1, head_dim)`` where layer 0's new K and V go."""
    _, layers, _, heads, page_size, _ = pool.shape
    kv_head = torch.arange(2 * heads, device=pages.device).view(2, heads, 1)
    return (pages * (layers * 2 * heads) + kv_head) * page_size + offsets


def page_rows(pool: torch.Tensor, page_tables: torch.Tensor) -> torch.Tensor:
    """Row ids ``[2, B, H, M]`` of layer 0's K and V for pages ``[B, M]``."""
    _, layers, _, heads, _, _ = pool.shape
    head = torch.arange(heads, device=page_tables.device)[None, :, None]
    k_rows = page_tables[:, None, :] * (layers * 2 * heads) + head
    return torch.stack((k_rows, k_rows + heads))


class Workspace:
    """Reusable gather buffers: fresh large tensors cost a page fault per 4 KiB."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        key = (name, like.dtype, like.device)
        numel = 1
        for s in shape:
            numel *= s
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    pd_attn: AttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers`` attention interface: q [1, Hq, T, D], k/v [1, Hkv, T, D] → [1, T, Hq, D]."""
    if pd_attn is None:
        raise RuntimeError("pdserve paged attention called without metadata (model does not forward kwargs)")
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention softcapping and sinks are not supported by pdserve yet")
    layer = module.layer_idx
    pool = pd_attn.kv_pool
    _, _, _, heads, page_size, dim = pool.shape
    if pd_attn.kv_scales is not None:  # an FP8 pool holds rotated keys: queries attend rotated too
        query, key = rotate_queries_keys(query, key)  # type: ignore[assignment]
    new_kv = torch.stack((key[0], value[0]))  # [2, Hkv, T, D]
    rows = pd_attn.write_rows + layer * 2 * heads * page_size
    if pd_attn.kv_scales is not None:
        store_fp8(pool, pd_attn.kv_scales, rows.view(-1), new_kv.view(-1, dim))
    else:
        pool.view(-1, dim).index_copy_(0, rows.view(-1), new_kv.to(pool.dtype).view(-1, dim))
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    groups = pd_attn.decode_groups
    if len(groups) == 1 and not pd_attn.prefills:  # pure decode step: no output copy
        return _decode_only(pd_attn, groups[0], layer, q, scaling, sliding_window), None
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    out = torch.empty_like(q)
    for i, group in enumerate(groups):
        _decode(pd_attn, i, group, layer, q, out, scaling, sliding_window)
    for span in pd_attn.prefills:
        _prefill(pd_attn, span, layer, q, k, v, out, scaling, sliding_window)
    return out.unsqueeze(0), None


def _gather(
    meta: AttentionMetadata, layer: int, rows: torch.Tensor, name: str, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, H, M * page_size, D]`` (contiguous) for layer-0 row ids ``[2, B, H, M]``;
    from an FP8 pool dequantized into ``like``'s dtype."""
    pool = meta.kv_pool
    _, _, _, heads, page_size, dim = pool.shape
    _, b, h, m = rows.shape
    blocks = (rows + layer * 2 * heads).view(-1)
    if meta.kv_scales is not None:
        buf = gather_fp8(pool, meta.kv_scales, blocks, like.dtype)
    else:
        buf = meta.workspace.get(name, (2 * b * h * m, page_size * dim), pool)
        torch.index_select(pool.view(-1, page_size * dim), 0, blocks, out=buf)
    kv = buf.view(2, b, h, m * page_size, dim)
    return kv[0], kv[1]


def _decode_only(
    meta: AttentionMetadata, group: DecodeGroup, layer: int, q: torch.Tensor, scaling: float | None, window: int | None
) -> torch.Tensor:
    k, v = _gather(meta, layer, group.rows, "decode", q)
    if group.count == 1 and window is None:  # one sequence: attend its exact length, no mask
        n = group.length
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k[:, :, :n], v[:, :, :n], scale=scaling, enable_gqa=True)
    else:
        mask = meta.decode_mask(0, window)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return o.view(1, group.count, q.shape[1], q.shape[2])


def _decode(
    meta: AttentionMetadata,
    index: int,
    group: DecodeGroup,
    layer: int,
    q: torch.Tensor,
    out: torch.Tensor,
    scaling: float | None,
    window: int | None,
) -> None:
    k, v = _gather(meta, layer, group.rows, "decode", q)
    qd = q[group.start : group.start + group.count].unsqueeze(2)  # [B, Hq, 1, D]
    mask = meta.decode_mask(index, window)
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    out[group.start : group.start + group.count] = o.squeeze(2)


def _prefill(
    meta: AttentionMetadata,
    span: PrefillSpan,
    layer: int,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    out: torch.Tensor,
    scaling: float | None,
    window: int | None,
) -> None:
    sl = slice(span.q_start, span.q_start + span.q_len)
    qs = q[sl].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    if span.rows is None:
        k = k_new[sl].transpose(0, 1).unsqueeze(0)
        v = v_new[sl].transpose(0, 1).unsqueeze(0)
        if meta.kv_scales is not None:  # as the pool holds them, as every later read sees them
            page = meta.kv_pool.shape[4]
            k, v = round_fp8(k, page, 2), round_fp8(v, page, 2)
    else:
        k, v = _gather(meta, layer, span.rows, "prefill", q)
        k = k[:, :, : span.ctx_len]
        v = v[:, :, : span.ctx_len]
    if span.is_fresh and window is None:
        o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        qpos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=q.device)[:, None]
        kpos = torch.arange(span.ctx_len, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    out[sl] = o[0].transpose(0, 1)


def register() -> str:
    """Register the attention under :data:`ATTN_IMPLEMENTATION`; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
