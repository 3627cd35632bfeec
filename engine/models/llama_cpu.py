"""pdserve's own forward pass for Llama-family decoders on a CPU: torch ops, and for a
bfloat16 model small C kernels (:mod:`pdserve.engine.kernels.native`).

The same weights as the GPU pass (:mod:`.llama`: q/k/v and gate/up fused, shared with the
stock modules) and the same page pool, with no Triton. Matmuls run on oneDNN with each
weight reordered once at start (:func:`pack`: twice the speed of ``F.linear``, which
reorders on every call); k and v go into their slots with one ``index_copy_``.

A bfloat16 model over a bfloat16 pool (the default model's case): decode rows, speculative
verify rows and prefill chunks of up to :data:`NATIVE_PREFILL_MAX_CTX` tokens of context
attend through the C kernels, which read each sequence's pages in place; the residual adds
and RMS norms, the rotary embedding and silu(gate) * up are one C loop each (``fused``). Both
choices are made at start and logged (``--cpu-attention``).

Otherwise (float32, an FP8 pool, longer prefill chunks, ``--cpu-attention torch``) attention
gathers the pages of a group of sequences with one ``index_select`` a layer (the indices of
every layer are computed once a step; a 16-bit pool's rows are whole pages of one layer, put
in order by the copy that casts them) and attends each KV head with its group of query heads:
in float32 with ``scaled_dot_product_attention``, or, decoding over a bfloat16 pool, as two
matmuls with the probabilities and V in bfloat16 as torch's bfloat16 SDPA kernel has them.
Every path rounds where the stock ``transformers`` code rounds, so in float32 greedy output
equals ``generate``'s.

Pool layout ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]`` (see
:mod:`pdserve.engine.kv_pool`): viewed as rows of ``head_dim`` values, a token's K of
(layer, head) is row ``(((page * L + layer) * 2) * H + head) * page_size + offset`` and its V
``H * page_size`` rows further; viewed as rows of ``page_size * head_dim``, a page's K block
of (layer, head) is row ``((page * L + layer) * 2) * H + head``. An FP8 pool (``kv_scales``)
keeps that numbering (q and k rotated first, :func:`pdserve.engine.quant.rotate_qk_`;
:func:`pdserve.engine.kv_pool.store_fp8` quantizes as it stores, a scale a block,
:func:`~pdserve.engine.kv_pool.gather_fp8` dequantizes the gathered blocks to float32); a fresh
prompt attending over its own k, v takes them rounded so too, as every later read sees them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import native
from pdserve.engine.kv_pool import gather_fp8, round_fp8, store_fp8
from pdserve.engine.models.batch import StepBatch
from pdserve.engine.models.cpu_plan import (
    MATMUL_MIN_BATCH,
    NATIVE_PREFILL_MAX_CTX,
    Chunk,
    DecodeGroup,
    Linears,
    Plan,
    can_pack,
    length_groups,
    pack,
    page_rows,
)
from pdserve.engine.models.llama_weights import FusedDecoder, Layer
from pdserve.engine.quant import rotate_qk_

if TYPE_CHECKING:
    from pdserve.engine.parallel import TPGroup

log = logging.getLogger(__name__)

CPU_ATTENTION = ("auto", "native", "torch")


class LlamaFamilyCPU(FusedDecoder):
    """Forward pass over a :class:`StepBatch` on a CPU; the KV pool is written and read in place.

    Tokens are packed as the GPU pass packs them: one per decoding sequence first, then
    each prefill chunk's. ``tp``: the weights are this rank's shard, the outputs of o and
    down are all-reduced across the group.
    """

    overlaps = False  # the engine gains nothing from queueing a step ahead on a CPU

    def __init__(
        self,
        model: Any,
        pool: torch.Tensor,
        max_positions: int,
        tp: TPGroup | None = None,
        kv_scales: torch.Tensor | None = None,
        attention: str = "auto",
    ) -> None:
        super().__init__(model, pool, max_positions, tp, kv_scales)
        self.linears = [
            Linears(
                qkv=pack(layer.qkv_weight, layer.qkv_bias),
                o=pack(layer.o_weight, layer.o_bias),
                gate_up=pack(layer.gate_up_weight, layer.gate_up_bias),
                down=pack(layer.down_weight, layer.down_bias),
            )
            for layer in self.layers
        ]
        self.head = pack(self.lm_head)
        self.packed = self.head.packed
        self._buffers: dict[str, torch.Tensor] = {}
        # A 16-bit pool is read a page's layer at a time (its K and V of every head: one run,
        # 6x fewer rows than a head's K or V block each at 3 KV heads), then put in [batch,
        # head, token] order by the copy that casts K (and V, unless decode_matmuls) to float32.
        # A float32 pool is read a head's K or V block at a time, straight into that order.
        self.blocks = kv_scales is None and pool.dtype != torch.float32
        # Decodes over a bfloat16 pool, MATMUL_MIN_BATCH or more at once: attention as two
        # matmuls, scores in float32, V and the probabilities in bfloat16 (oneDNN's bfloat16
        # matmul: 2.7 ms a batch-16 step against float32's 5.4, and V is not cast); False:
        # float32 SDPA (see docs/cpu.md).
        self.decode_matmuls = self.blocks and pool.dtype == torch.bfloat16 and can_pack(torch.bfloat16)
        self.native = self._native_attention(attention)
        self.fused = self._fused_elementwise()

    def _native_attention(self, attention: str) -> bool:
        """Whether decodes and verify rows attend through the C kernel (``--cpu-attention``):
        under ``auto`` wherever the pool and the model are bfloat16 and the kernel builds here;
        the choice is logged with its reason."""
        if attention not in CPU_ATTENTION:
            raise ValueError(f"cpu attention must be one of {', '.join(CPU_ATTENTION)}, not {attention!r}")
        if attention == "torch":
            log.info("cpu decode attention", extra={"path": "torch", "reason": "cpu_attention 'torch'"})
            return False
        if self.kv_scales is not None or self.pool.dtype != torch.bfloat16 or self.embed.dtype != torch.bfloat16:
            reason = (
                "the native kernel does not read an FP8 pool"
                if self.kv_scales is not None
                else f"the native kernel reads a bfloat16 pool of a bfloat16 model; this is {self.pool.dtype}"
            )
            if attention == "native":
                raise ValueError(f"cpu_attention 'native': {reason}")
            log.info("cpu decode attention", extra={"path": "torch", "reason": reason})
            return False
        _, _, _, heads, _, dim = self.pool.shape
        unavailable = native.unavailable_reason()
        if unavailable is None and (self.num_q // heads > native.MAX_GROUP or dim > native.MAX_DIM):
            unavailable = f"{self.num_q // heads} query heads per KV head of {dim} exceed the kernel's limits"
        if unavailable is not None:
            if attention == "native":
                raise ValueError(f"cpu_attention 'native': {unavailable}")
            log.warning("cpu decode attention", extra={"path": "torch", "reason": unavailable})
            return False
        log.info("cpu decode attention", extra={"path": "native", "library": str(native.library()._name)})
        return True

    def _fused_elementwise(self) -> bool:
        """Whether the residual adds and RMS norms, the rotary embedding and silu(gate) * up run
        as one C loop each (``cpu_elementwise.c``, rounded as the torch ops round): for a
        bfloat16 model where the kernels build; logged with the reason either way."""
        if self.embed.dtype != torch.bfloat16:
            reason = f"the element-wise kernels take bfloat16 rows; this model is {self.embed.dtype}"
            log.info("cpu element-wise path", extra={"path": "torch", "reason": reason})
            return False
        unavailable = native.unavailable_reason()
        if unavailable is not None:
            log.warning("cpu element-wise path", extra={"path": "torch", "reason": unavailable})
            return False
        log.info("cpu element-wise path", extra={"path": "native"})
        return True

    def plan(self, step: StepBatch) -> Plan:
        """The step's indices, once for every layer."""
        pool = self.pool
        _, layers, _, heads, page, _ = pool.shape
        slots = step.slots
        base = ((slots // page) * (layers * 2 * heads))[:, None] + torch.arange(2 * heads)[None, :]  # [T, 2H]
        store = (base * page + (slots % page)[:, None]).view(1, -1)
        store = store + (torch.arange(layers) * (2 * heads * page))[:, None]
        nd = step.num_decodes
        groups = self._decode_groups(step) if nd else []
        chunks: list[Chunk] = []
        if step.prefill is not None:
            tables = step.prefill.page_tables
            ctx_lens = step.prefill.ctx_lens.tolist()
            first_verify = len(step.prefill.spans) - step.prefill.num_verifies
            for s, (start, n) in enumerate(step.prefill.spans):
                ctx = ctx_lens[s]
                verify = s >= first_verify
                if verify and self.native:  # each row as a decode of its position
                    table = tables[s : s + 1, : -(-ctx // page)].to(torch.int32).expand(n, -1).contiguous()
                    lens = torch.arange(ctx - n + 1, ctx + 1, dtype=torch.int32)
                    chunks.append(Chunk(slice(start, start + n), ctx, None, True, (table, lens)))
                    continue
                if not verify and self.native and ctx <= NATIVE_PREFILL_MAX_CTX:  # read in place
                    table = tables[s, : -(-ctx // page)].to(torch.int32).contiguous()
                    chunks.append(Chunk(slice(start, start + n), ctx, None, False, table_native=table))
                    continue
                gather = None if ctx == n else page_rows(pool, tables[s : s + 1, : -(-ctx // page)], self.blocks)
                chunks.append(Chunk(slice(start, start + n), ctx, gather, verify))
        return Plan(
            positions=step.positions,
            cos=self.cos[step.positions][:, None, :],
            sin=self.sin[step.positions][:, None, :],
            store=store,
            num_decodes=nd,
            groups=groups,
            chunks=chunks,
        )

    def _decode_groups(self, step: StepBatch) -> list[DecodeGroup]:
        page = self.pool.shape[4]
        lens = step.decode_ctx_lens.tolist()
        if self.native:  # one call reads each row's own pages, its own length: no groups, no padding
            longest = max(lens)
            pages = -(-longest // page)
            # int32 already (StepBatch): the slice keeps each row contiguous, as the kernel wants
            return [DecodeGroup(None, None, pages, longest, None, step.decode_ctx_lens, step.decode_tables[:, :pages])]
        members = length_groups(lens, page)
        groups = []
        for member in members:
            rows = None if len(members) == 1 else torch.tensor(member)
            ctx = step.decode_ctx_lens if rows is None else step.decode_ctx_lens[rows]
            longest = lens[member[0]]
            pages = -(-longest // page)
            tables = step.decode_tables[:, :pages] if rows is None else step.decode_tables[rows, :pages]
            groups.append(DecodeGroup(rows, page_rows(self.pool, tables, self.blocks), pages, longest, None, ctx))
        return groups

    @torch.inference_mode()
    def forward(self, step: StepBatch) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of ``step.sample_index`` (every row when it is ``None``)."""
        plan = self.plan(step)
        h = F.embedding(step.input_ids, self.embed)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for index, (layer, linear) in enumerate(zip(self.layers, self.linears, strict=True)):
            x, residual = self._add_rms_norm(h, residual, layer.input_norm)
            qkv = linear.qkv(x)
            out = self._attention(index, layer, qkv, plan)
            if index == last and step.sample_index is not None:  # only the sampled rows go on
                assert residual is not None
                out, residual = out[step.sample_index], residual[step.sample_index]
            h = linear.o(out)
            if self.tp is not None:
                self.tp.all_reduce(h)
            x, residual = self._add_rms_norm(h, residual, layer.post_norm)
            gate_up = linear.gate_up(x)
            if self.fused:
                h = linear.down(native.silu_mul(gate_up))
            else:
                n = gate_up.shape[1] // 2
                h = linear.down(F.silu(gate_up[:, :n]) * gate_up[:, n:])
            if self.tp is not None:
                self.tp.all_reduce(h)
        h, _ = self._add_rms_norm(h, residual, self.norm)
        return self.head(h)

    def _add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual) * weight, x + residual)``, rounded as the stock RMSNorm rounds
        (fused: the sum is written over ``residual``)."""
        if self.fused and x.dim() == 2 and x.stride(1) == 1:
            return native.add_rms_norm(x, residual, weight, self.eps)
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
        if self.fused:
            native.rope(qkv, nq + nkv, dim, self.cos, self.sin, plan.positions)
        else:
            half = dim // 2
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk.mul_(plan.cos)
            qk.add_(rotated.mul_(plan.sin))  # q * cos + rotate_half(q) * sin, as transformers rounds it
        if self.kv_scales is not None:  # an FP8 pool holds rotated keys (quant.kv_key_rotation)
            rotate_qk_(qk, nq)
        kv = qkv[:, nq * dim :].reshape(-1, dim)  # [T * 2 * H, D]: (token, k|v, head) rows
        if self.kv_scales is not None:
            store_fp8(self.pool, self.kv_scales, plan.store[index], kv)
        else:
            self.pool.view(-1, dim).index_copy_(0, plan.store[index], kv)
        q = qkv[:, : nq * dim].view(tokens, nq, dim)
        nd = plan.num_decodes
        if nd == tokens and len(plan.groups) == 1:
            return self._decode(index, layer, q, plan.groups[0], plan).to(qkv.dtype)
        if nd == 0 and len(plan.chunks) == 1:
            return self._prefill(index, layer, q, qkv, plan.chunks[0]).view(tokens, nq * dim)
        out = qkv.new_empty((tokens, nq * dim))
        for group in plan.groups:
            if group.rows is None:
                out[:nd] = self._decode(index, layer, q[:nd], group, plan)
            else:
                out[group.rows] = self._decode(index, layer, q[group.rows], group, plan).to(qkv.dtype)
        for chunk in plan.chunks:
            out[chunk.rows] = self._prefill(index, layer, q, qkv, chunk).view(-1, nq * dim)
        return out

    def _gather(
        self, rows: torch.Tensor, batch: int, pages: int, v_dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[batch, H, pages * page_size, D]`` of page rows ``rows`` (:func:`page_rows`),
        K in float32, V in float32 or (``v_dtype``, a 16-bit pool's) as the pool holds it."""
        _, _, _, heads, page, dim = self.pool.shape
        if self.kv_scales is not None:
            kv = gather_fp8(self.pool, self.kv_scales, rows, torch.float32).view(2, batch, heads, pages * page, dim)
            return kv[0], kv[1]
        if self.blocks:
            width = 2 * heads * page * dim
            buf = self._buffer("gather", rows.shape[0] * width, self.pool.dtype).view(-1, width)
            torch.index_select(self.pool.view(-1, width), 0, rows, out=buf)
            src = buf.view(batch, pages, 2, heads, page, dim).permute(2, 0, 3, 1, 4, 5)
            if v_dtype == torch.float32:
                kv = self._buffer("upcast", buf.numel(), torch.float32).view(2, batch, heads, pages, page, dim)
                kv.copy_(src)
                kv = kv.view(2, batch, heads, pages * page, dim)
                return kv[0], kv[1]
            k = self._buffer("k", buf.numel() // 2, torch.float32).view(batch, heads, pages, page, dim)
            v = self._buffer("v", buf.numel() // 2, v_dtype).view(batch, heads, pages, page, dim)
            k.copy_(src[0])
            v.copy_(src[1])
            return k.view(batch, heads, pages * page, dim), v.view(batch, heads, pages * page, dim)
        buf = self._buffer("gather", rows.shape[0] * page * dim, self.pool.dtype).view(-1, page * dim)
        torch.index_select(self.pool.view(-1, page * dim), 0, rows, out=buf)
        if buf.dtype != torch.float32:
            buf = self._buffer("upcast", buf.numel(), torch.float32).view(buf.shape).copy_(buf)
        kv = buf.view(2, batch, heads, pages * page, dim)
        return kv[0], kv[1]

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused flat buffer (fresh large tensors cost a page fault per 4 KiB)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    def _decode(self, index: int, layer: Layer, q: torch.Tensor, group: DecodeGroup, plan: Plan) -> torch.Tensor:
        """One query token per sequence over its pages: ``[B, num_q * head_dim]`` (float32, or
        the model's dtype from :attr:`decode_matmuls`), each KV head attended by its group of
        query heads (no repeated K, V)."""
        if group.tables is not None:
            return native.paged_decode(
                self.pool, q.view(q.shape[0], -1), group.tables, group.ctx_lens, index, self.scale, layer.window
            )
        batch = q.shape[0]
        nkv = self.num_kv
        matmuls = self.decode_matmuls and batch >= MATMUL_MIN_BATCH
        assert group.gather is not None
        k, v = self._gather(group.gather[index], batch, group.pages, q.dtype if matmuls else torch.float32)
        qg = q.float().view(batch, nkv, -1, self.head_dim)  # [B, H, Hq / H, D]
        mask = self._decode_mask(group, k.shape[2], layer.window)
        if mask is None:  # one sequence: its exact length
            n = group.length
            k, v = k[:, :, :n], v[:, :, :n]
        if not matmuls:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
            return o.view(batch, -1)
        # Rounded nearly as torch's bfloat16 SDPA kernel (the stock code's) rounds: scores in
        # float32, the probabilities in bfloat16 for their product with V (accumulated in
        # float32, rounded once). The kernel rounds them before normalizing, we after: within
        # twice its error against float64 (tests/engine/test_cpu_fast_model.py).
        scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(self.scale)
        if mask is not None:
            scores.add_(mask)
        p = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(p, v).view(batch, -1)

    def _decode_mask(self, group: DecodeGroup, width: int, window: int | None) -> torch.Tensor | None:
        """Additive float32 mask ``[B, 1, 1, width]`` of each sequence's keys (cached per window)."""
        if group.ctx_lens.shape[0] == 1 and window is None:
            return None
        if window is None and group.mask is not None:
            return group.mask
        lens = group.ctx_lens.to(torch.long)[:, None]
        positions = torch.arange(width)[None, :]
        keep = positions < lens
        if window is not None:
            keep &= positions >= lens - window
        mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))[:, None, None, :]
        if window is None:
            group.mask = mask
        return mask

    def _verify(self, index: int, q: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """A speculative verify's rows, each over exactly its own prefix as :meth:`_decode`
        attends one sequence (the same ops, so greedy output is what plain decoding gives):
        ``[n, Hq, D]`` in the model's dtype."""
        assert chunk.gather is not None
        n = q.shape[0]
        pages = -(-chunk.ctx_len // self.pool.shape[4])
        k, v = self._gather(chunk.gather[index], 1, pages)
        start = chunk.ctx_len - n
        out = q.new_empty(q.shape)
        for t in range(n):
            qg = q[t : t + 1].float().view(1, self.num_kv, -1, self.head_dim)
            end = start + t + 1
            o = F.scaled_dot_product_attention(qg, k[:, :, :end], v[:, :, :end], scale=self.scale)
            out[t] = o.view(-1, self.head_dim).to(q.dtype)
        return out

    def _prefill(self, index: int, layer: Layer, q: torch.Tensor, qkv: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """A chunk's rows attend causally to its prefix and themselves: ``[n, Hq, D]``, in
        the model's dtype (computed in float32)."""
        nq, nkv, dim = self.num_q, self.num_kv, self.head_dim
        rows = chunk.rows
        if chunk.rows_native is not None:
            table, lens = chunk.rows_native
            out = native.paged_decode(
                self.pool, q[rows].view(-1, nq * dim), table, lens, index, self.scale, layer.window
            )
            return out.view(-1, nq, dim)
        if chunk.table_native is not None:
            out = native.paged_prefill(
                self.pool,
                q[rows].view(-1, nq * dim),
                chunk.table_native,
                chunk.ctx_len,
                index,
                self.scale,
                layer.window,
            )
            return out.view(-1, nq, dim)
        if chunk.verify and chunk.gather is not None and layer.window is None:
            return self._verify(index, q[rows], chunk)
        qs = q[rows].transpose(0, 1)[None].float()  # [1, Hq, n, D]
        n = qs.shape[2]
        if chunk.gather is None:
            k = qkv[rows, nq * dim : (nq + nkv) * dim].view(n, nkv, dim).transpose(0, 1)[None]
            v = qkv[rows, (nq + nkv) * dim :].view(n, nkv, dim).transpose(0, 1)[None]
            if self.kv_scales is not None:  # as the pool holds them, as every later read sees them
                page = self.pool.shape[4]
                k, v = round_fp8(k, page, 2), round_fp8(v, page, 2)
            k, v = k.float(), v.float()
        else:
            pages = -(-chunk.ctx_len // self.pool.shape[4])
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
        return o[0].transpose(0, 1).to(q.dtype)
