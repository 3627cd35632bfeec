"""pdserve's own forward pass for Llama-family decoders: Llama, Qwen2, Qwen3, Mistral.

Built from a loaded ``transformers`` model, whose weights it shares: q/k/v become one
fused projection and gate/up another (the stock modules keep working on views of the
fused tensors, so nothing is held twice). A layer is eight launches: add+RMSNorm, qkv,
rotary+KV store, attention (in place on the page pool), o, add+RMSNorm, gate_up,
SiLU·up, down — few enough that a decode step replays as one CUDA graph; in a decode-only
step the attention kernel does the rotary and the KV store itself.

With FP8 weights (``--quantization fp8``, :func:`.llama_weights.quantize_fp8_`) every product
of qkv, o, gate_up and down goes through :func:`pdserve.engine.kernels.fp8.linear` (the FP8
GEMV up to its row limit, down reading SiLU·up fused; above it activations quantized per
token, SiLU·up fused, then the batched W8A8 kernel or, for prefill, ``torch._scaled_mm``);
the LM head stays in the model's dtype.

With an FP8 KV pool (``--kv-cache-dtype fp8_e4m3``, ``kv_scales``) q and k are rotated after the
rotary embedding (:func:`pdserve.engine.quant.rotate_qk_`), the rotary+KV store and the
decode attention's own store quantize each k and v with its block's scale, and both attention kernels
read the pool in place (:mod:`pdserve.engine.kernels.paged`). Whole prompts on a GPU
(``sdpa_prefill``) attend over their own k, v rounded as the pool holds them: every attention
sees the same K/V whichever path it takes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pdserve.engine.attention import page_rows
from pdserve.engine.kernels import elementwise, fp8, gemv, paged, paged_prefill, rope
from pdserve.engine.models.batch import StepBatch
from pdserve.engine.models.llama_weights import FusedDecoder, Layer, Weight
from pdserve.engine.quant import Fp8Weight, kv_key_rotation

if TYPE_CHECKING:
    from pdserve.engine.parallel import TPGroup

# GEMV tiles for a single token, the fastest of a sweep on an H200 at 7B dimensions
# (bench/gemv_probe.py): they read the weights at 4.3 (gate/up, LM head), 3.75 (down, with
# SiLU·up fused, cut in two along K; 3.55 uncut) and 2.8 TB/s (o) against the library's 3.8,
# 3.4 and 2.2. The library keeps qkv (as fast: 2.95 against 2.87) and every batch above one.
GEMV_O = {"block_n": 8, "block_k": 1024, "num_warps": 8}
GEMV_GATE_UP = {"block_n": 8, "block_k": 512, "num_warps": 4}
GEMV_DOWN = {"block_n": 8, "block_k": 512, "num_warps": 4, "split_k": 2}  # 36.2 us, split 1: 38.2 (2026-12-01)
GEMV_LM_HEAD = {"block_n": 8, "block_k": 512, "num_warps": 4}
PREFILL_WARM_ROWS = (1, paged_prefill.SHORT_CHUNK + 1)  # a chunk of each of the prefill kernel's row tiles
# Whole prompts attend through the library's SDPA, which on Hopper (torch 2.11) takes cuDNN's
# attention (4,096 tokens of a 7B model on an H100: 58.5 ms, as cuDNN's 57.6; flash 64.8): cuDNN
# builds a graph for every shape it meets first, cached per thread, so every new prompt length
# built one on a request's path (the suspect, not timed alone, of a fresh process's first
# 544-token prompt taking 58.9 ms against ~14 on an H100, 2026-12-06). A prompt is padded up to
# one of a few lengths (:func:`sdpa_length`: SDPA_BUCKETS a doubling, at least SDPA_MIN_BUCKET
# tokens apart), each met once at start (:meth:`LlamaFamily.warm_up_sdpa`).
SDPA_BUCKETS = 16
SDPA_MIN_BUCKET = 64
# A chunk of at least this many rows after a cached or earlier prefix attends with flash
# attention over its pages gathered (:func:`prefixed_sdpa`), shorter ones with the paged
# prefill kernel, which read a long chunk's keys once a query head (on an H100 a 7B model's
# 1,988-token chunk after 128 cached tokens took 48.6 ms against 40.3 for 2,048 fresh ones,
# so that loading a prefix from a KV tier could make its prompt slower, 2026-12-07).
PREFIXED_SDPA_ROWS = 1024


def sdpa_length(n: int) -> int:
    """The length a whole prompt of ``n`` tokens attends at: ``n`` rounded up to a multiple of
    1/:data:`SDPA_BUCKETS` of the power of two at or above it (at least :data:`SDPA_MIN_BUCKET`),
    fewer than 64 rows more up to 1,024 tokens, under an eighth more above (24 lengths up to 2,048
    tokens, 40 up to 8,192)."""
    if n <= 0:
        return n
    step = max(SDPA_MIN_BUCKET, (1 << (n - 1).bit_length()) // SDPA_BUCKETS)
    return -(-n // step) * step


def sdpa_lengths(max_tokens: int) -> list[int]:
    """Every length :func:`sdpa_length` gives for 1 to ``max_tokens`` tokens, ascending."""
    lengths = []
    n = 1
    while n <= max_tokens:
        lengths.append(sdpa_length(n))
        n = lengths[-1] + 1
    return lengths


def causal_sdpa(rows: torch.Tensor, heads: int, kv_heads: int, dim: int, scale: float) -> torch.Tensor:
    """Causal attention of one whole prompt over itself, from its step's qkv ``rows`` (``[n,
    (heads + 2 * kv_heads) * dim]``: q's heads, then k's, then v's), through the library's SDPA:
    ``[1, heads, n, dim]``. The library meets :func:`sdpa_length` rows, always laid out as a
    step's: rows of that length with no gap between them are read in place, any others copied
    into such rows, the rest zeros. A query attends only to the keys at or before it, so the
    rows past ``n`` change nothing of the first ``n``."""
    n, width = rows.shape
    length = sdpa_length(n)
    if length != n or rows.stride() != (width, 1):
        padded = rows.new_empty((length, width))
        padded[:n] = rows
        padded[n:].zero_()  # finite: a masked score must not be NaN where the mask is added
        rows = padded
    q = rows[:, : heads * dim].view(length, heads, dim)
    k = rows[:, heads * dim : (heads + kv_heads) * dim].view(length, kv_heads, dim)
    v = rows[:, (heads + kv_heads) * dim :].view(length, kv_heads, dim)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, :n]


def prefixed_sdpa(
    q: torch.Tensor, pool: torch.Tensor, layer: int, page_rows: torch.Tensor, ctx: int, scale: float
) -> torch.Tensor:
    """A chunk's queries ``q [n, heads, dim]`` (at positions ``ctx - n`` to ``ctx - 1``) attending
    causally to the ``ctx`` tokens of K/V in their pages, which hold the chunk's own by now
    (``page_rows``: layer 0's rows ``[2, 1, kv_heads, pages]`` of
    :func:`pdserve.engine.attention.page_rows`), gathered in one ``index_select`` a layer:
    ``[1, heads, n, dim]``. In 16 bits on a GPU through flash attention, whose causal mask is
    aligned to the last key (bottom-right, as a chunk after a prefix wants; the library's
    ``is_causal`` aligns it to the first), its query heads grouped over the key heads in the
    kernel; elsewhere (the CPU's tests, a float32 model) the same mask spelled out."""
    _, _, _, kv_heads, page, dim = pool.shape
    n = q.shape[0]
    blocks = (page_rows + layer * 2 * kv_heads).view(-1)
    kv = pool.view(-1, page * dim).index_select(0, blocks).view(2, 1, kv_heads, -1, dim)
    k, v = kv[0, :, :, :ctx], kv[1, :, :, :ctx]
    qs = q.transpose(0, 1)[None]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.aten._scaled_dot_product_flash_attention(qs, k, v, 0.0, True, False, scale=scale)[0]
    mask = torch.ones((n, ctx), dtype=torch.bool, device=q.device).tril(ctx - n)
    return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


class LlamaFamily(FusedDecoder):
    """Forward pass over a :class:`StepBatch`; the KV pool is written and read in place.

    ``sdpa_prefill``: whole prompts (no cached prefix) attend with the library's SDPA over
    their own q, k, v (:func:`causal_sdpa`); chunks of at least ``prefixed_sdpa_rows`` rows
    after a prefix with flash attention over their gathered pages (:func:`prefixed_sdpa`; on a
    GPU, :data:`PREFIXED_SDPA_ROWS`; 0: none), in layers without a window, from a 16-bit pool;
    the others with the paged prefill kernel.
    ``use_gemv``: a step of one token multiplies with the GEMV kernels. ``fused_merge``:
    decode attention merges its context splits itself (measured slower on an H200: off).
    ``l2_prefetch``: in a one-token step on a GPU, the o projection's weights are read into
    L2 on a side stream while the layer's attention runs (see :func:`gemv.l2_prefetch`).
    Measured slower on an H200 (4.11 against 4.01 ms a step at batch 1, 2026-12-01): off.
    ``pdl``: in a one-token step on a GPU, each GEMV is a programmatic dependent launch of the
    kernel before it (which lets it start early), so that its programs are resident and
    reading their first weights while that kernel finishes (measured slower: off).
    ``separate_rope``: a decode-only step rotates q, k and stores k, v in a kernel of its own
    before the attention, as steps with a prefill do (off: the attention kernel does it,
    one launch a layer fewer).

    ``tp``: the model's weights are this rank's shard (:mod:`pdserve.engine.parallel`): the
    layer has ``1 / tp.size`` of the heads and of the MLP, and the outputs of o and down are
    all-reduced across the group (inside the CUDA graph, on a GPU).

    FP8 weights: with ``use_gemv`` up to :data:`fp8.GEMV_MAX_ROWS` rows through the FP8
    GEMV, else (and always without ``use_gemv``) the row-quantized W8A8 products of
    :func:`fp8.linear` (its batched kernel, then the library's scaled GEMM).
    """

    overlaps = True  # the engine may queue a step whose input tokens are still on the device
    sdpa_prefill = True
    use_gemv = True  # single-token steps through :mod:`pdserve.engine.kernels.gemv`
    fused_merge = False  # decode attention merges its context splits in the same kernel
    l2_prefetch = False
    pdl = False
    separate_rope = False  # decode-only steps rotate and store k, v in a kernel of their own

    def __init__(
        self,
        model: Any,
        pool: torch.Tensor,
        max_positions: int,
        tp: TPGroup | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        super().__init__(model, pool, max_positions, tp, kv_scales)
        device = self.embed.device
        self._counters: torch.Tensor | None = None  # fused_merge's per-(sequence, kv head) counters
        # (read by the runner as it packs a step: build_step's prefixed_rows)
        self.prefixed_sdpa_rows = PREFIXED_SDPA_ROWS if device.type == "cuda" and self.sdpa_prefill else 0
        if self.kv_scales is not None:  # the FP8 pool's key rotation, made before any graph is captured
            kv_key_rotation(self.head_dim, self.embed.dtype, device)
        if device.type == "cuda":
            gemv.reserve_counters(device)  # split-K counters, before any graph is captured
            self._side = torch.cuda.Stream(device)
            largest = max(_tensor(layer.o_weight).numel() for layer in self.layers)
            self._sink = torch.empty(-(-largest // 8192), dtype=torch.float32, device=device)

    @torch.inference_mode()
    def warm_up_decode(self, splits: Iterable[int]) -> None:
        """Compile decode attention as eager steps (a decode beside a prefill chunk) call it,
        once per split count: met first while serving, a compile stalls every stream for a
        second or more; and as eager decode-only steps call it (rotating and storing k, v
        itself). Reads one page, writes a scratch output and zeros into the first slot of
        the pool's last page (the runner's scratch page, which padded graph rows write)."""
        dtype, device = self.embed.dtype, self.embed.device
        nq, nkv, dim = self.num_q, self.num_kv, self.head_dim
        qkv = torch.zeros((1, (nq + 2 * nkv) * dim), dtype=dtype, device=device)
        q = qkv[:, : nq * dim].view(1, nq, dim)
        out = torch.empty((1, nq, dim), dtype=dtype, device=device)
        tables = torch.zeros((1, 1), dtype=torch.int32, device=device)
        ctx = torch.ones(1, dtype=torch.int32, device=device)
        scratch = torch.full((1,), (self.pool.shape[0] - 1) * self.pool.shape[4], dtype=torch.long, device=device)
        windows = sorted({layer.window or 0 for layer in self.layers})
        for count in sorted(set(splits)):
            for window in windows:
                for rotary in (None, (self.cos, self.sin, scratch)):
                    paged.decode_attention(
                        q,
                        self.pool,
                        0,
                        tables,
                        ctx,
                        self.scale,
                        count,
                        out,
                        window or None,
                        rope=rotary,
                        kv_scales=self.kv_scales,
                    )

    @torch.inference_mode()
    def warm_up_sdpa(self, max_tokens: int) -> None:
        """Whole prompts' attention once at each length :func:`causal_sdpa` pads to, up to
        ``max_tokens`` (a step's token budget), in the thread that will run the steps (a
        worker's engine thread builds the runner): the library's set-up for a shape (cuDNN's
        graph, cached per thread) is made here, not on a request's path."""
        if not self.sdpa_prefill:
            return
        nq, nkv, dim = self.num_q, self.num_kv, self.head_dim
        for length in sdpa_lengths(max_tokens):
            rows = torch.zeros((length, (nq + 2 * nkv) * dim), dtype=self.embed.dtype, device=self.embed.device)
            causal_sdpa(rows, nq, nkv, dim, self.scale)

    @torch.inference_mode()
    def warm_up_prefill(self) -> None:
        """Compile paged prefill attention (a chunk after a cached or earlier prefix), once per
        row tile it picks (:data:`PREFILL_WARM_ROWS`): met first while serving, a restarted
        worker's first prompt found in a KV tier paid it, a compile or a load from Triton's
        cache, before its first token. Reads the scratch page only (the pool's last, which
        padded graph rows write) and writes a scratch output."""
        dtype, device = self.embed.dtype, self.embed.device
        page = self.pool.shape[4]
        last = self.pool.shape[0] - 1
        for rows in PREFILL_WARM_ROWS:
            q = torch.zeros((rows, self.num_q, self.head_dim), dtype=dtype, device=device)
            starts = torch.zeros(1, dtype=torch.int32, device=device)
            tables = torch.full((1, -(-rows // page)), last, dtype=torch.int32, device=device)
            lens = torch.full((1,), rows, dtype=torch.int32, device=device)
            paged_prefill.prefill_attention(
                q, self.pool, 0, tables, starts, lens, lens, rows, self.scale, torch.empty_like(q),
                kv_scales=self.kv_scales,
            )  # fmt: skip

    @torch.inference_mode()
    def forward(self, step: StepBatch) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of ``step.sample_index`` (every row when it is ``None``)."""
        h = F.embedding(step.input_ids, self.embed)
        residual: torch.Tensor | None = None
        nq, nkv, dim = self.num_q, self.num_kv, self.head_dim
        tokens = rows = h.shape[0]  # rows: of the MLP (the last layer's: the sampled ones)
        last = len(self.layers) - 1
        pdl = self.pdl and tokens == 1 and self.use_gemv and h.is_cuda and not self.l2_prefetch
        # a decode-only step: decode attention rotates and stores its tokens' k, v itself
        fused_rope = step.prefill is None and not self.separate_rope and not step.kv_first
        for index, layer in enumerate(self.layers):
            w = layer.qkv_weight  # the library's GEMM at every size in 16 bits (as fast at batch 1)
            if isinstance(w, torch.Tensor):
                x, residual = elementwise.add_rms_norm(h, residual, layer.input_norm, self.eps)
                qkv = F.linear(x, w, layer.qkv_bias)
            else:
                qkv, residual = self._norm_fp8(h, residual, layer.input_norm, w, layer.qkv_bias)
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = qkv[:, : (nq + nkv) * dim]
                q = layer.q_norm(qk[:, : nq * dim].reshape(tokens, nq, dim))
                k = layer.k_norm(qk[:, nq * dim :].reshape(tokens, nkv, dim))
                qk.copy_(torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1)), dim=1))
            prefetch = tokens == 1 and self.use_gemv and self.l2_prefetch and h.is_cuda
            if prefetch:  # the o projection's weights into L2 while the attention runs
                main = torch.cuda.current_stream()
                self._side.wait_stream(main)
                with torch.cuda.stream(self._side):
                    gemv.l2_prefetch(_tensor(layer.o_weight), self._sink)
            if not fused_rope:
                rope.rope_store(
                    qkv, nq, nkv, self.cos, self.sin, step.positions, step.slots, self.pool, index, self.kv_scales
                )
            out = self._attend(index, layer, qkv, step, pdl, fused_rope).view(tokens, nq * dim)
            if prefetch:
                main.wait_stream(self._side)
            if index == last and step.sample_index is not None:
                # Past the last attention only the sampled rows matter (every row's K/V is
                # written): the o projection and the MLP run on them alone.
                out, residual = out[step.sample_index], residual[step.sample_index]  # type: ignore[index]
                rows = out.shape[0]
            h = self._linear(out, layer.o_weight, layer.o_bias, GEMV_O, pdl)
            if self.tp is not None:
                self.tp.all_reduce(h)
            h, residual = self._mlp(h, residual, layer, rows, pdl)
            if self.tp is not None:
                self.tp.all_reduce(h)
        h, _ = elementwise.add_rms_norm(h, residual, self.norm, self.eps, pdl)
        return self._linear(h, self.lm_head, None, GEMV_LM_HEAD, pdl)

    def _mlp(
        self, h: torch.Tensor, residual: torch.Tensor | None, layer: Layer, rows: int, pdl: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp(add_rms_norm(h, residual)), h + residual)``: gate/up, then down over SiLU·up."""
        if isinstance(layer.gate_up_weight, Fp8Weight):
            gate_up, residual = self._norm_fp8(h, residual, layer.post_norm, layer.gate_up_weight, layer.gate_up_bias)
        else:
            x, residual = elementwise.add_rms_norm(h, residual, layer.post_norm, self.eps, pdl)
            gate_up = self._linear(x, layer.gate_up_weight, layer.gate_up_bias, GEMV_GATE_UP, pdl)
        down = layer.down_weight
        if isinstance(down, Fp8Weight):
            return self._fp8(gate_up, down, layer.down_bias, silu_mul_input=True), residual
        if rows == 1 and self.use_gemv:
            out = gemv.gemv(gate_up, down, layer.down_bias, silu_mul_input=True, pdl=pdl, **gemv.model_tiles(GEMV_DOWN))
            return out, residual
        return F.linear(elementwise.silu_mul(gate_up), down, layer.down_bias), residual

    def _linear(
        self, x: torch.Tensor, w: Weight, b: torch.Tensor | None, tiles: dict[str, int], pdl: bool = False
    ) -> torch.Tensor:
        if isinstance(w, Fp8Weight):
            return self._fp8(x, w, b)
        if x.shape[0] == 1 and self.use_gemv:
            return gemv.gemv(x, w, b, False, pdl=pdl, **gemv.model_tiles(tiles))
        return F.linear(x, w, b)

    def _norm_fp8(
        self, h: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor, w: Fp8Weight, b: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(linear(add_rms_norm(h, residual)), h + residual)`` for an FP8 ``w``: where the
        product quantizes its rows per row, the norm hands them over quantized (one launch fewer)."""
        gemv_rows = fp8.GEMV_MAX_ROWS if self.use_gemv else 0
        if fp8.takes_quantized_rows(h.shape[0], gemv_rows):
            (xq, xs), residual = elementwise.add_rms_norm_fp8(h, residual, norm, self.eps)
            return fp8.linear(xq, w, b, gemv_max_rows=gemv_rows, x_scale=xs, out_dtype=h.dtype), residual
        x, residual = elementwise.add_rms_norm(h, residual, norm, self.eps)
        return self._fp8(x, w, b), residual

    def _fp8(self, x: torch.Tensor, w: Fp8Weight, b: torch.Tensor | None, silu_mul_input: bool = False) -> torch.Tensor:
        rows = fp8.GEMV_MAX_ROWS if self.use_gemv else 0
        return fp8.linear(x, w, b, silu_mul_input, gemv_max_rows=rows)

    def _attend(
        self, index: int, layer: Layer, qkv: torch.Tensor, step: StepBatch, pdl: bool = False, rope: bool = False
    ) -> torch.Tensor:
        """Attention output ``[tokens, heads, head_dim]`` (contiguous) of the step's rows."""
        nq, nkv, dim = self.num_q, self.num_kv, self.head_dim
        q = qkv[:, : nq * dim].view(-1, nq, dim)
        nd = step.num_decodes
        chunks = step.prefill
        sdpa = self.sdpa_prefill and chunks is not None and chunks.is_fresh and layer.window is None and q.is_cuda
        if sdpa and nd == 0 and len(chunks.spans) == 1:  # type: ignore[union-attr]
            # the library writes [tokens, heads, dim] memory: no copy (was 28 of 29 MB at 4,096 tokens)
            return self._sdpa(qkv)[0].transpose(0, 1).contiguous()
        out = torch.empty((q.shape[0], nq, dim), dtype=qkv.dtype, device=qkv.device)
        if nd:
            counters = None
            if self.fused_merge:
                if self._counters is None or self._counters.numel() < nd * nkv:
                    self._counters = torch.zeros(max(nd, 64) * nkv, dtype=torch.int32, device=q.device)
                counters = self._counters
            paged.decode_attention(
                q[:nd],
                self.pool,
                index,
                step.decode_tables,
                step.decode_ctx_lens,
                self.scale,
                step.decode_splits,
                out[:nd],
                layer.window,
                counters=counters,
                pdl=pdl,
                rope=(self.cos, self.sin, step.slots) if rope else None,
                kv_scales=self.kv_scales,
            )
        if chunks is None:
            return out
        if sdpa:  # each chunk is a whole prompt: the library's attention on its own q, k, v
            for start, n in chunks.spans:
                sl = slice(start, start + n)
                out[sl] = self._sdpa(qkv, sl)[0].transpose(0, 1)
            return out
        q_lens, max_q_len = chunks.q_lens, chunks.max_q_len
        if chunks.prefixed and layer.window is None and self.kv_scales is None:
            for span, start, n, ctx in chunks.prefixed:
                rows0 = chunks.prefixed_page_rows.get(span)
                if rows0 is None:  # (the step's first layer)
                    table = chunks.page_tables[span : span + 1, : -(-ctx // self.pool.shape[4])].long()
                    rows0 = chunks.prefixed_page_rows[span] = page_rows(self.pool, table)
                o = prefixed_sdpa(q[start : start + n], self.pool, index, rows0, ctx, self.scale)
                out[start : start + n] = o[0].transpose(0, 1)
            assert chunks.paged_q_lens is not None
            q_lens, max_q_len = chunks.paged_q_lens, chunks.paged_max_q_len
            if max_q_len == 0:
                return out
        paged_prefill.prefill_attention(
            q,
            self.pool,
            index,
            chunks.page_tables,
            chunks.q_starts,
            q_lens,
            chunks.ctx_lens,
            max_q_len,
            self.scale,
            out,
            layer.window,
            kv_scales=self.kv_scales,
        )
        return out

    def _sdpa(self, qkv: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """Causal attention of ``rows`` (one whole prompt) over themselves: ``[1, heads, rows, dim]``."""
        nq, nkv, dim = self.num_q, self.num_kv, self.head_dim
        if self.kv_scales is not None:
            # as the pool holds them (one launch for both), written over the step's own k, v
            # (which the pool already has: nothing reads them after), so that the prompt's rows
            # attend in place (a copy of q is ~37 MB a layer at 4,096 tokens)
            paged.round_kv_fp8(qkv[rows], nq * dim, nkv, dim, self.pool.shape[4], self.pool, in_place=True)
        return causal_sdpa(qkv[rows], nq, nkv, dim, self.scale)


def _tensor(w: Weight) -> torch.Tensor:
    """The tensor a weight's bytes are in (an FP8 weight's ``q``)."""
    return w.q if isinstance(w, Fp8Weight) else w
