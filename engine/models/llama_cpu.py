"""pdserve's own forward pass for Llama-family decoders on a CPU, in plain torch ops.

The same weights as the GPU pass (:mod:`.llama`: q/k/v and gate/up fused, shared with the
stock modules) and the same page pool, with no Triton: the rotary embedding is a few
element-wise ops on the fused qkv output, k and v go into their slots with one
``index_copy_``, and attention gathers each sequence's pages with one ``index_select`` a
layer (the indices of every layer are computed once a step) before
``scaled_dot_product_attention``. Every op rounds where the stock ``transformers`` code
rounds, so in float32 greedy output equals ``generate``'s.

Pool layout ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]`` (see
:mod:`pdserve.engine.kv_pool`): viewed as rows of ``head_dim`` values, a token's K of
(layer, head) is row ``(((page * L + layer) * 2) * H + head) * page_size + offset`` and its V
``H * page_size`` rows further; viewed as rows of ``page_size * head_dim``, a page's K block
of (layer, head) is row ``((page * L + layer) * 2) * H + head``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdserve.engine.models.batch import StepBatch
from pdserve.engine.models.llama_weights import FusedDecoder, Layer

if TYPE_CHECKING:
    pass


@dataclass
class Chunk:
    """One prefill chunk's rows and, over a cached or earlier prefix, its pages."""

    rows: slice
    ctx_len: int
    gather: torch.Tensor | None  # [L, 1 * H * pages * 2] page rows of every layer; None: fresh


@dataclass
class Plan:
    """What every layer of one step shares: rotary tables and pool indices of each layer."""

    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor
    store: torch.Tensor  # [L, T * 2 * H] rows (of head_dim) where each token's k, v go
    num_decodes: int
    decode_gather: torch.Tensor | None  # [L, 2 * B * H * W] page rows of the decodes' pages
    decode_pages: int
    decode_len: int  # the longest decode context
    decode_ctx_lens: torch.Tensor
    chunks: list[Chunk]
    masks: dict[tuple[str, int, int | None], torch.Tensor] = field(default_factory=dict)


def _page_rows(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[L, 2 * B * H * W]``: for each layer, the rows of ``pool.view(-1, page * dim)`` that
    hold pages ``tables [B, W]``'s K then V blocks, in ``[2, B, H, W]`` order."""
    _, layers, _, heads, _, _ = pool.shape
    head = torch.arange(heads)[None, :, None]
    k = tables.to(torch.long)[:, None, :] * (layers * 2 * heads) + head  # [B, H, W]
    layer0 = torch.stack((k, k + heads)).view(1, -1)
    return layer0 + (torch.arange(layers) * (2 * heads))[:, None]


class LlamaFamilyCPU(FusedDecoder):
    """Forward pass over a :class:`StepBatch` on a CPU; the KV pool is written and read in place.

    Tokens are packed as the GPU pass packs them: one per decoding sequence first, then
    each prefill chunk's. ``tp``: the weights are this rank's shard, the outputs of o and
    down are all-reduced across the group.
    """

    overlaps = False  # the engine gains nothing from queueing a step ahead on a CPU

    def plan(self, step: StepBatch) -> Plan:
        """The step's indices, once for every layer."""
        pool = self.pool
        _, layers, _, heads, page, _ = pool.shape
        slots = step.slots
        base = ((slots // page) * (layers * 2 * heads))[:, None] + torch.arange(2 * heads)[None, :]  # [T, 2H]
        store = (base * page + (slots % page)[:, None]).view(1, -1)
        store = store + (torch.arange(layers) * (2 * heads * page))[:, None]
        nd = step.num_decodes
        decode_gather = None
        pages = 0
        if nd:
            pages = step.decode_tables.shape[1]
            decode_gather = _page_rows(pool, step.decode_tables)
        chunks: list[Chunk] = []
        if step.prefill is not None:
            tables = step.prefill.page_tables
            ctx_lens = step.prefill.ctx_lens.tolist()
            for s, (start, n) in enumerate(step.prefill.spans):
                ctx = ctx_lens[s]
                gather = None if ctx == n else _page_rows(pool, tables[s : s + 1, : -(-ctx // page)])
                chunks.append(Chunk(slice(start, start + n), ctx, gather))
        return Plan(
            cos=self.cos[step.positions][:, None, :],
            sin=self.sin[step.positions][:, None, :],
            store=store,
            num_decodes=nd,
            decode_gather=decode_gather,
            decode_pages=pages,
            decode_len=int(step.decode_ctx_lens.max()) if nd else 0,
            decode_ctx_lens=step.decode_ctx_lens,
            chunks=chunks,
        )

    @torch.inference_mode()
    def forward(self, step: StepBatch) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of ``step.sample_index`` (every row when it is ``None``)."""
        plan = self.plan(step)
        h = F.embedding(step.input_ids, self.embed)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            x, residual = self._add_rms_norm(h, residual, layer.input_norm)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            out = self._attention(index, layer, qkv, plan)
            if index == last and step.sample_index is not None:  # only the sampled rows go on
                assert residual is not None
                out, residual = out[step.sample_index], residual[step.sample_index]
            h = F.linear(out, layer.o_weight, layer.o_bias)
            if self.tp is not None:
                self.tp.all_reduce(h)
            x, residual = self._add_rms_norm(h, residual, layer.post_norm)
            gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
            n = gate_up.shape[1] // 2
            h = F.linear(F.silu(gate_up[:, :n]) * gate_up[:, n:], layer.down_weight, layer.down_bias)
            if self.tp is not None:
                self.tp.all_reduce(h)
        h, _ = self._add_rms_norm(h, residual, self.norm)
        return F.linear(h, self.lm_head)

    def _add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual) * weight, x + residual)``, rounded as the stock RMSNorm rounds."""
        if residual is not None:
            x = x + residual
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * hidden.to(x.dtype), x

    def _attention(self, index: int, layer: Layer, qkv: torch.Tensor, plan: Plan) -> torch.Tensor:
        """Rotate q, k; store k, v in the pool; attend. Returns ``[T, num_q * head_dim]``."""
        nq, nkv, dim = self.num_q, self.num_kv, self.head_dim
        tokens = qkv.shape[0]
        qk = qkv[:, : (nq + nkv) * dim].view(tokens, nq + nkv, dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            qk[:, :nq] = layer.q_norm(qk[:, :nq])
            qk[:, nq:] = layer.k_norm(qk[:, nq:])
        half = dim // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        qk.mul_(plan.cos)
        qk.add_(rotated.mul_(plan.sin))  # q * cos + rotate_half(q) * sin, as transformers rounds it
        kv = qkv[:, nq * dim :].reshape(-1, dim)  # [T * 2 * H, D]: (token, k|v, head) rows
        self.pool.view(-1, dim).index_copy_(0, plan.store[index], kv)
        q = qkv[:, : nq * dim].view(tokens, nq, dim)
        nd = plan.num_decodes
        if nd == tokens:
            return self._decode(index, layer, q, plan)
        if nd == 0 and len(plan.chunks) == 1:
            return self._prefill(index, layer, q, qkv, plan.chunks[0]).view(tokens, nq * dim)
        out = qkv.new_empty((tokens, nq * dim))
        if nd:
            out[:nd] = self._decode(index, layer, q[:nd], plan)
        for chunk in plan.chunks:
            out[chunk.rows] = self._prefill(index, layer, q, qkv, chunk).view(-1, nq * dim)
        return out

    def _gather(self, rows: torch.Tensor, batch: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[batch, H, pages * page_size, D]`` of page rows ``[2 * batch * H * pages]``."""
        _, _, _, heads, page, dim = self.pool.shape
        kv = self.pool.view(-1, page * dim).index_select(0, rows)
        kv = kv.view(2, batch, heads, pages * page, dim)
        return kv[0], kv[1]

    def _decode(self, index: int, layer: Layer, q: torch.Tensor, plan: Plan) -> torch.Tensor:
        """One query token per sequence over its pages: ``[B, num_q * head_dim]``."""
        assert plan.decode_gather is not None
        batch = q.shape[0]
        k, v = self._gather(plan.decode_gather[index], batch, plan.decode_pages)
        qd = q[:, :, None, :]  # [B, Hq, 1, D]
        if batch == 1 and layer.window is None:  # one sequence: its exact length, no mask
            n = plan.decode_len
            o = F.scaled_dot_product_attention(qd, k[:, :, :n], v[:, :, :n], scale=self.scale, enable_gqa=True)
        else:
            mask = self._decode_mask(plan, k.shape[2], layer.window)
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.view(batch, -1)

    def _decode_mask(self, plan: Plan, width: int, window: int | None) -> torch.Tensor:
        key = ("decode", 0, window)
        mask = plan.masks.get(key)
        if mask is None:
            lens = plan.decode_ctx_lens.to(torch.long)[:, None]
            positions = torch.arange(width)[None, :]
            mask = positions < lens
            if window is not None:
                mask &= positions >= lens - window
            mask = plan.masks[key] = mask[:, None, None, :]
        return mask

    def _prefill(self, index: int, layer: Layer, q: torch.Tensor, qkv: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """A chunk's rows attend causally to its prefix and themselves: ``[n, Hq, D]``."""
        nq, nkv, dim = self.num_q, self.num_kv, self.head_dim
        rows = chunk.rows
        qs = q[rows].transpose(0, 1)[None]  # [1, Hq, n, D]
        n = qs.shape[2]
        if chunk.gather is None:
            k = qkv[rows, nq * dim : (nq + nkv) * dim].view(n, nkv, dim).transpose(0, 1)[None]
            v = qkv[rows, (nq + nkv) * dim :].view(n, nkv, dim).transpose(0, 1)[None]
        else:
            pages = chunk.gather.shape[1] // (2 * nkv)
            k, v = self._gather(chunk.gather[index], 1, pages)
            k, v = k[:, :, : chunk.ctx_len], v[:, :, : chunk.ctx_len]
        if chunk.gather is None and layer.window is None:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            qpos = torch.arange(chunk.ctx_len - n, chunk.ctx_len)[:, None]
            kpos = torch.arange(chunk.ctx_len)[None, :]
            mask = kpos <= qpos
            if layer.window is not None:
                mask &= kpos > qpos - layer.window
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)
