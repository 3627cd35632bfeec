"""The Triton kernels against plain-torch references, over many shapes.

On the CPU they run in Triton's interpreter in float32 (bf16 does not survive it); on a
GPU in bf16 and float32. Fresh random inputs per case; outputs are poisoned first.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import quant
from pdserve.engine.kernels import fp8
from tests.engine.kernel_env import DEVICE, elementwise, gemv, paged, paged_prefill, rope

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_pool(pages: int, layers: int, kv: int, page: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn((pages, layers, 2, kv, page, dim), dtype=dtype, device=DEVICE)


def scattered_tables(
    lens: list[int], page: int, pages: int, rng: random.Random, spare: int = 0
) -> tuple[list[list[int]], torch.Tensor]:
    """Page tables for sequences of ``lens`` tokens, their pages drawn at random from
    ``pages``: as lists, and as an int32 tensor with ``spare`` zero columns past the widest."""
    ids = list(range(pages))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in lens:
        need = -(-n // page)
        tables.append(ids[start : start + need])
        start += need
    table_t = torch.zeros((len(lens), max(map(len, tables)) + spare), dtype=torch.int32, device=DEVICE)
    for i, t in enumerate(tables):
        table_t[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return tables, table_t


def gather(pool: torch.Tensor, layer: int, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[kv, n, dim]`` of the first ``n`` tokens in pages ``table``."""
    pages = pool[torch.tensor(table, device=DEVICE), layer]  # [P, 2, kv, page, dim]
    kv = pages.permute(1, 2, 0, 3, 4).reshape(2, pool.shape[3], -1, pool.shape[5])
    return kv[0, :, :n], kv[1, :, :n]


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int | None):
    """q [Hq, m, D] at positions q_pos; k/v [Hkv, n, D] at positions 0..n-1."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, 0).double()
    v = v.repeat_interleave(group, 0).double()
    kpos = torch.arange(k.shape[1], device=DEVICE)[None, :]
    mask = kpos <= q_pos[:, None]
    if window:
        mask &= kpos > q_pos[:, None] - window
    s = (q.double() @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.softmax(s, -1) @ v


CASES = [
    # (page, num_q, num_kv, dim, context lengths, window)
    (16, 4, 2, 64, [1, 17, 40], None),
    (16, 7, 1, 32, [5, 100], None),
    (4, 8, 8, 16, [3, 33, 64, 9], None),
    (8, 6, 2, 32, [50, 7], 12),
    (32, 28, 4, 128, [512], None),
    (16, 9, 3, 64, [1, 17, 70], None),  # SmolLM2-135M, the default model: 9 heads over 3 KV heads
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_matches_reference(dtype: torch.dtype, case: tuple) -> None:
    page, num_q, num_kv, dim, lens, window = case
    rng = random.Random(str(case))
    layers, layer = 3, 1
    pool = make_pool(64, layers, num_kv, page, dim, dtype)
    tables, table_t = scattered_tables(lens, page, 64, rng, spare=2)
    qkv = torch.randn((len(lens), (num_q + 2 * num_kv) * dim), dtype=dtype, device=DEVICE)
    q = qkv[:, : num_q * dim].view(len(lens), num_q, dim)  # strided rows, as in the model
    counters = torch.zeros(len(lens) * num_kv, dtype=torch.int32, device=DEVICE)
    # graphs pass int64 lengths; splits merge in a second kernel or inside the first; one
    # split writes the output directly (the counters untouched)
    cases = ((1, torch.int32, False), (1, torch.int64, True), (4, torch.int64, False), (4, torch.int32, True))
    for splits, ctx_dtype, fused in cases:
        ctx = torch.tensor(lens, dtype=ctx_dtype, device=DEVICE)
        out = torch.full((len(lens), num_q, dim), float("nan"), dtype=dtype, device=DEVICE)
        paged.decode_attention(
            q,
            pool,
            layer,
            table_t,
            ctx,
            dim**-0.5,
            splits,
            out,
            window,
            block_n=16,
            counters=counters if fused else None,
        )
        assert not counters.any(), "the counters are left for the next launch"
        for i, n in enumerate(lens):
            k, v = gather(pool, layer, tables[i], n)
            ref = ref_attention(q[i][:, None], k, v, torch.tensor([n - 1], device=DEVICE), window)[:, 0]
            assert rel_err(out[i], ref) < TOL[dtype], (splits, i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 20)],  # fresh prompt
        [(16, 9), (0, 5)],  # a chunk after a cached prefix, and a fresh one
        [(37, 1), (3, 30)],
    ],
)
@pytest.mark.parametrize("window", [None, 10])
def test_prefill_attention_matches_reference(dtype: torch.dtype, chunks: list, window: int | None) -> None:
    page, num_q, num_kv, dim, layers, layer = 8, 4, 2, 32, 2, 0
    pool = make_pool(40, layers, num_kv, page, dim, dtype)
    ids = list(range(40))
    random.Random(1).shuffle(ids)
    decode_rows = 3  # rows before the chunks in the packed batch, as decode tokens would be
    tables, q_starts, row, start = [], [], decode_rows, 0
    for prefix, n in chunks:
        need = -(-(prefix + n) // page)
        tables.append(ids[start : start + need])
        start += need
        q_starts.append(row)
        row += n
    total = row
    width = max(len(t) for t in tables)
    table_t = torch.zeros((len(chunks), width), dtype=torch.int32, device=DEVICE)
    for i, t in enumerate(tables):
        table_t[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn((total, num_q, dim), dtype=dtype, device=DEVICE)
    out = torch.full_like(q, float("nan"))

    def ints(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=DEVICE)

    paged_prefill.prefill_attention(
        q,
        pool,
        layer,
        table_t,
        ints(q_starts),
        ints([n for _, n in chunks]),
        ints([p + n for p, n in chunks]),
        max(n for _, n in chunks),
        dim**-0.5,
        out,
        window,
    )
    assert out[:decode_rows].isnan().all(), "rows outside the chunks were written"
    for i, (prefix, n) in enumerate(chunks):
        k, v = gather(pool, layer, tables[i], prefix + n)
        qs = q[q_starts[i] : q_starts[i] + n].transpose(0, 1)
        ref = ref_attention(qs, k, v, torch.arange(prefix, prefix + n, device=DEVICE), window)
        assert rel_err(out[q_starts[i] : q_starts[i] + n].transpose(0, 1), ref) < TOL[dtype], i


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 32), (7, 1, 64), (28, 4, 128), (9, 3, 64)])
def test_rope_store_rotates_in_place_and_writes_slots(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    num_q, num_kv, dim = heads
    page, layers, layer, tokens = 4, 3, 2, 9
    pool = make_pool(12, layers, num_kv, page, dim, dtype)
    before = pool.clone()
    qkv = torch.randn((tokens, (num_q + 2 * num_kv) * dim), dtype=dtype, device=DEVICE)
    original = qkv.clone()
    positions = torch.tensor(random.Random(2).sample(range(100), tokens), device=DEVICE)
    slots = torch.tensor(random.Random(3).sample(range(12 * page), tokens), device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    freqs = torch.arange(100, device=DEVICE).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    rope.rope_store(qkv, num_q, num_kv, cos, sin, positions, slots, pool, layer)
    qk = original[:, : (num_q + num_kv) * dim].view(tokens, -1, dim).float()
    c, s = cos[positions].float()[:, None], sin[positions].float()[:, None]
    ref = (qk * c + rotate_half(qk) * s).view(tokens, -1)
    tol = TOL[dtype]
    assert rel_err(qkv[:, : (num_q + num_kv) * dim], ref) < tol
    assert torch.equal(qkv[:, (num_q + num_kv) * dim :], original[:, (num_q + num_kv) * dim :])
    k = ref.view(tokens, -1, dim)[:, num_q:]
    v = original[:, (num_q + num_kv) * dim :].view(tokens, num_kv, dim)
    expected = before.clone()
    for t in range(tokens):
        p, o = divmod(int(slots[t]), page)
        expected[p, layer, 0, :, o] = k[t].to(dtype)
        expected[p, layer, 1, :, o] = v[t]
    assert rel_err(pool, expected) < tol
    untouched = torch.ones(pool.shape[:1] + pool.shape[1:2], dtype=torch.bool)
    untouched[:, layer] = False
    assert torch.equal(pool[untouched.to(DEVICE)], before[untouched.to(DEVICE)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 3584 // 8, 576, 1000])
def test_add_rms_norm_and_silu_mul_match_transformers_rounding(dtype: torch.dtype, n: int) -> None:
    rows = 5
    x = torch.randn((rows, n), dtype=dtype, device=DEVICE)
    res = torch.randn((rows, n), dtype=dtype, device=DEVICE)
    w = torch.randn(n, dtype=dtype, device=DEVICE)
    out, new_res = elementwise.add_rms_norm(x, res, w, 1e-6)
    s = x + res
    ref = w * (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(new_res, s)
    assert rel_err(out, ref) < TOL[dtype] / 4
    out0, res0 = elementwise.add_rms_norm(x, None, w, 1e-6)
    assert torch.equal(res0, x)
    ref0 = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert rel_err(out0, ref0) < TOL[dtype] / 4
    gu = torch.randn((rows, 2 * n), dtype=dtype, device=DEVICE)
    ref = F.silu(gu[:, :n]) * gu[:, n:]
    assert rel_err(elementwise.silu_mul(gu), ref) < TOL[dtype] / 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (3, 17, 1000), (4, 64, 512), (2, 48, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    x = torch.randn((m, k), dtype=dtype, device=DEVICE)
    w = torch.randn((n, k), dtype=dtype, device=DEVICE)
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    ref = F.linear(x.double(), w.double(), b.double() if b is not None else None)
    assert rel_err(gemv.gemv(x, w, b, block_n=8, block_k=128), ref) < TOL[dtype]
    gate_up = torch.randn((m, 2 * k), dtype=dtype, device=DEVICE)
    act = elementwise.silu_mul(gate_up)
    ref_act = F.linear(act.double(), w.double())
    assert rel_err(gemv.gemv(gate_up, w, silu_mul_input=True, block_n=16, block_k=256), ref_act) < TOL[dtype]
    # cut along K too (k=96 leaves the third split empty): partial sums added by the last
    # program of each row block, the counters left at zero for the next launch
    counters = gemv.split_counters(torch.device(DEVICE), -(-n // 8))
    for split in (2, 3):
        assert rel_err(gemv.gemv(x, w, b, block_n=8, block_k=64, split_k=split), ref) < TOL[dtype], split
        got = gemv.gemv(gate_up, w, silu_mul_input=True, block_n=8, block_k=64, split_k=split)
        assert rel_err(got, ref_act) < TOL[dtype], split
        assert not counters.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(3, 40, 96), (9, 17, 1000), (16, 64, 512), (33, 48, 576)])
@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_on_tensor_cores_and_fp8_weights_match_linear(
    dtype: torch.dtype, m: int, n: int, k: int, fp8: bool
) -> None:
    # The tensor-core path (x padded to 16 rows and up) and FP8 weights with a scale per
    # output channel, read in place: against the product with the dequantized weights.
    x = torch.randn((m, k), dtype=dtype, device=DEVICE)
    w = torch.randn((n, k), dtype=dtype, device=DEVICE) * torch.rand((n, 1), dtype=dtype, device=DEVICE) * 4
    b = torch.randn(n, dtype=dtype, device=DEVICE)
    scale = None
    if fp8:
        q = quant.quantize_fp8(w)
        w, scale, dense = q.q, q.scale, q.dequantize(torch.float64)
    else:
        dense = w.double()
    ref = F.linear(x.double(), dense, b.double())
    # tensor cores take float32 as tf32 on a GPU
    tol = TOL[torch.bfloat16] if DEVICE.type == "cuda" else TOL[dtype]
    for dot in (False, True):
        assert rel_err(gemv.gemv(x, w, b, block_n=16, block_k=128, scale=scale, dot=dot), ref) < tol, dot
    gate_up = torch.randn((m, 2 * k), dtype=dtype, device=DEVICE)
    ref_act = F.linear(elementwise.silu_mul(gate_up).double(), dense)
    got = gemv.gemv(gate_up, w, silu_mul_input=True, block_n=16, block_k=64, split_k=3, scale=scale, dot=True)
    assert rel_err(got, ref_act) < tol
    assert not gemv.split_counters(torch.device(DEVICE), 1).any()


def test_gemv_refuses_weights_of_another_dtype_without_a_scale() -> None:
    x = torch.randn((2, 64), device=DEVICE)
    with pytest.raises(AssertionError, match="need a scale"):
        gemv.gemv(x, quant.quantize_fp8(torch.randn((16, 64), device=DEVICE)).q)


@pytest.mark.parametrize("rows", [1, 9, 70, 130])
def test_fp8_linear_matches_its_reference_by_rows(rows: int) -> None:
    # Up to GEMV_MAX_ROWS rows: the GEMV on FP8 weights (activations in bf16); above: the
    # activations quantized per token too, then the batched W8A8 kernel up to
    # BATCHED_MAX_ROWS rows and the library's scaled GEMM above (tests/engine/test_fp8_kernels.py).
    n, k = 48, 256
    x = torch.randn((rows, 2 * k), dtype=torch.bfloat16, device=DEVICE)
    w = quant.quantize_fp8(torch.randn((n, k), device=DEVICE))
    b = torch.randn(n, dtype=torch.bfloat16, device=DEVICE)
    for silu in (False, True):
        inp = x if silu else x[:, :k].contiguous()
        act = elementwise.silu_mul(inp) if silu else inp
        if rows > fp8.GEMV_MAX_ROWS:
            aq, a_scale = quant.quantize_rows_fp8(act)
            act = aq.to(torch.float32) * a_scale[:, None]
        ref = F.linear(act.double(), w.dequantize(torch.float64), b.double())
        assert rel_err(fp8.linear(inp, w, b, silu_mul_input=silu), ref) < TOL[torch.bfloat16], silu


def test_l2_prefetch_reads_every_element() -> None:
    # The prefetch is kept by the values it sums into the sink: one block per program,
    # the last one partial.
    t = torch.randn(10_000, dtype=torch.float32, device=DEVICE)
    sink = torch.zeros(24, dtype=torch.float32, device=DEVICE)
    gemv.l2_prefetch(t, sink, block=512)
    want = torch.stack([t[i * 512 : (i + 1) * 512].sum() for i in range(math.ceil(10_000 / 512))])
    assert torch.allclose(sink[:20], want, rtol=1e-4, atol=1e-3)
    assert not sink[20:].any()


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16] if DEVICE.type == "cuda" else DTYPES)
@pytest.mark.parametrize("rows,n,block", [(1, 5000, 1024), (3, 152064, 4096), (2, 700, 4096), (2, 49152, 4096)])
def test_argmax_rows_equals_torch_first_of_ties(dtype: torch.dtype, rows: int, n: int, block: int) -> None:
    x = torch.randn((rows, n), device=DEVICE).to(dtype)
    top = x.max()
    x[0, n // 3] = x[0, n - 1] = top + 1  # a tie across chunks: the first wins
    if rows > 1:
        x[1, 17] = x[1, 18] = top + 2  # a tie inside a chunk
    wide = torch.empty((rows, n + 64), device=DEVICE, dtype=dtype)
    wide[:, :n] = x  # rows with a stride past their length (logits views)
    for t in (x, wide[:, :n]):
        out = elementwise.argmax_rows(t, block=block)
        assert out.dtype == torch.long
        assert out.tolist() == t.argmax(dim=-1).tolist()
    assert elementwise.argmax_rows(x, block=block)[0].item() == n // 3


def test_feed_takes_device_tokens_where_asked() -> None:
    ids = torch.tensor([5, 6, 7, 8, 9], dtype=torch.long, device=DEVICE)
    src = torch.tensor([-1, 2, -1, 0, 1], dtype=torch.long, device=DEVICE)
    tokens = torch.tensor([100, 101, 102], dtype=torch.long, device=DEVICE)
    elementwise.feed(ids, src, tokens)
    assert ids.tolist() == [5, 102, 7, 100, 101]
    elementwise.feed(ids[:0], src[:0], tokens)  # an empty batch launches nothing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_with_rope_is_rope_store_then_decode_attention(dtype: torch.dtype, case: tuple) -> None:
    """``rope=``: the attention kernel rotates q and the new token's k and stores k, v
    itself. Against :func:`rope_store` then the plain kernel on the same inputs: the pools
    end equal (only the new tokens' slots of the layer written) and the outputs agree, at
    one split and several, merged apart or inside."""
    page, num_q, num_kv, dim, lens, window = case
    rng = random.Random(f"rope {case}")
    layers, layer = 3, 2
    pool = make_pool(64, layers, num_kv, page, dim, dtype)
    tables, table_t = scattered_tables(lens, page, 64, rng, spare=1)
    positions = torch.tensor([n - 1 for n in lens], device=DEVICE)
    slots = torch.tensor(
        [t[(n - 1) // page] * page + (n - 1) % page for t, n in zip(tables, lens, strict=True)], device=DEVICE
    )
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    emb = torch.arange(600, device=DEVICE).float()[:, None] * inv[None, :]
    cos, sin = torch.cat((emb, emb), -1).cos().to(dtype), torch.cat((emb, emb), -1).sin().to(dtype)
    qkv = torch.randn((len(lens), (num_q + 2 * num_kv) * dim), dtype=dtype, device=DEVICE)
    counters = torch.zeros(len(lens) * num_kv, dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    for splits, fused in ((1, False), (4, False), (4, True), (32, False)):
        separate_pool, separate_qkv = pool.clone(), qkv.clone()
        rope.rope_store(separate_qkv, num_q, num_kv, cos, sin, positions, slots, separate_pool, layer)
        expected = torch.empty((len(lens), num_q, dim), dtype=dtype, device=DEVICE)
        paged.decode_attention(
            separate_qkv[:, : num_q * dim].view(len(lens), num_q, dim),
            separate_pool, layer, table_t, ctx, dim**-0.5, splits, expected, window, block_n=16,
        )  # fmt: skip
        fused_pool, fused_qkv = pool.clone(), qkv.clone()
        out = torch.full((len(lens), num_q, dim), float("nan"), dtype=dtype, device=DEVICE)
        paged.decode_attention(
            fused_qkv[:, : num_q * dim].view(len(lens), num_q, dim),
            fused_pool, layer, table_t, ctx, dim**-0.5, splits, out, window, block_n=16,
            counters=counters if fused else None, rope=(cos, sin, slots),
        )  # fmt: skip
        assert torch.equal(fused_qkv, qkv), "the qkv rows are read, not rotated in place"
        assert rel_err(fused_pool, separate_pool) < TOL[dtype] / 10, splits
        assert torch.equal(fused_pool[:, :layer], pool[:, :layer]) and torch.equal(
            fused_pool[:, layer + 1 :], pool[:, layer + 1 :]
        )
        assert rel_err(out, expected) < TOL[dtype], splits


def test_decode_attention_with_rope_leaves_a_row_without_context_alone() -> None:
    """A row with no context (``ctx_lens`` 0: a graph row that a smaller bucket's upload
    left zeroed) reads no table position before the start and stores nothing."""
    num_q, num_kv, dim, page = 4, 2, 32, 8
    pool = make_pool(4, 2, num_kv, page, dim, torch.float32)
    before = pool.clone()
    qkv = torch.randn((2, (num_q + 2 * num_kv) * dim), device=DEVICE)
    cos, sin = torch.ones((16, dim), device=DEVICE), torch.zeros((16, dim), device=DEVICE)
    out = torch.zeros((2, num_q, dim), device=DEVICE)
    tables = torch.tensor([[1], [2]], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([0, 3], device=DEVICE)
    slots = torch.tensor([1 * page + 5, 2 * page + 2], device=DEVICE)
    paged.decode_attention(
        qkv[:, : num_q * dim].view(2, num_q, dim), pool, 1, tables, ctx, dim**-0.5, 1, out, rope=(cos, sin, slots)
    )
    changed = (pool != before).nonzero()[:, 0].unique().tolist()
    assert changed == [2], "only the row with context stored its token"
    assert torch.equal(pool[2, 1, 0, :, 2], qkv[1, num_q * dim : (num_q + num_kv) * dim].view(num_kv, dim))
