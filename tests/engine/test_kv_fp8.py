"""FP8 KV pages (``--kv-cache-dtype fp8_e4m3``): the pool's layout and sizing, the stores bit
for bit against :func:`quant.store_kv_fp8_blocks` (blocks whose scale grows), both attention kernels against float64 over the
dequantized K/V, the torch passes' store and read, whole pages moved as bytes.

On the CPU the Triton kernels run in Triton's interpreter in float32 (``kernel_env``); on a GPU
in bf16 and float32, where the rotary of the fused decode store may round apart from
:func:`rope.rope_store`'s (fused multiply-adds), so there the two are compared dequantized.
"""

from __future__ import annotations

import ctypes
import itertools
import random

import pytest
import torch

from pdserve.engine import kv_blob, quant
from pdserve.engine.kv_host import HostTier
from pdserve.engine.kv_pool import (
    KV_FP8,
    KVPool,
    block_bytes,
    bytes_per_token,
    gather_fp8,
    kv_views,
    page_bytes,
    store_fp8,
)
from pdserve.schemas import KVLayout
from tests.engine.kernel_env import DEVICE, paged, paged_prefill, rope
from tests.engine.test_kernels import DTYPES, TOL, gather, ref_attention, rel_err, scattered_tables

# (page, num_q, num_kv, dim, context lengths, window), as test_kernels' CASES
CASES = [
    (16, 4, 2, 64, [1, 17, 40], None),
    (4, 8, 8, 16, [3, 33, 64, 9], None),
    (8, 6, 2, 32, [50, 7], 12),
    (16, 9, 3, 64, [1, 17, 70], None),  # SmolLM2-135M's heads
    (16, 28, 4, 128, [300], None),  # Qwen2.5-7B's
]


def fp8_pool(pages: int, layers: int, kv: int, page: int, dim: int) -> KVPool:
    """An FP8 pool whose every block is random vectors quantized, magnitudes spread over 2^-6 to
    2^6 so that the scales differ from block to block and the tokens of a block differ in size."""
    pool = KVPool(KVLayout(layers, kv, dim, page, KV_FP8), pages, DEVICE)
    assert pool.kv_scales is not None
    shape = pool.kv.shape
    x = torch.randn(shape, device=DEVICE) * torch.exp2(torch.randint(-6, 7, shape[:-1], device=DEVICE)).unsqueeze(-1)
    q, scale = quant.quantize_kv_fp8(x)
    pool.kv.view(torch.uint8).copy_(q.view(torch.uint8))
    pool.kv_scales.copy_(scale)
    return pool


def dequantized(pool: KVPool) -> torch.Tensor:
    """The pool's K/V ``[pages, layers, 2, heads, page, dim]`` in float64."""
    assert pool.kv_scales is not None
    return quant.dequantize_kv_fp8(pool.kv, pool.kv_scales, torch.float64)


def rope_tables(dim: int, dtype: torch.dtype, positions: int = 600) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    emb = torch.arange(positions, device=DEVICE).float()[:, None] * inv[None, :]
    emb = torch.cat((emb, emb), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def test_a_page_is_one_byte_range_of_values_then_a_scale_per_block() -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, page_size=4, dtype=KV_FP8)
    pool = KVPool(layout, 5, torch.device("cpu"))
    assert pool.tensor.dtype == torch.uint8 and pool.tensor.is_contiguous()
    assert block_bytes(layout) == 4 * 16 + 4 and pool.page_bytes == 3 * 2 * 2 * 68 == page_bytes(layout)
    assert pool.nbytes == 5 * pool.page_bytes and pool.page_address(3) == pool.data_ptr + 3 * pool.page_bytes
    assert pool.segments([1, 2, 4]) == [(pool.page_address(1), 2 * pool.page_bytes), (pool.page_address(4), 816)]
    assert pool.kv_scales is not None and pool.kv_scales.shape == (5, 3, 2, 2)
    # token 2 of (page 3, layer 1, V, head 1): its 16 bytes, and the block's scale after its values
    block = ((3 * 3 + 1) * 2 + 1) * 2 + 1
    pool.kv[3, 1, 1, 1, 2] = torch.arange(1, 17).to(torch.float8_e4m3fn)
    pool.kv_scales[3, 1, 1, 1] = 0.375
    raw = pool.tensor.view(-1)
    values = raw[block * 68 + 2 * 16 : block * 68 + 3 * 16]
    assert torch.equal(values.view(torch.float8_e4m3fn).float(), torch.arange(1, 17).float())
    scale = raw[block * 68 + 64 : block * 68 + 68]
    assert scale.view(torch.float32).item() == 0.375
    assert int((raw != 0).sum()) == int((values != 0).sum()) + int((scale != 0).sum())


def test_fp8_pages_hold_1_996x_bf16s_tokens() -> None:
    """Pool sizing: the pages per byte of Qwen2.5-7B's layout (28 layers, 4 KV heads of 128,
    16-token pages); bench/fp8_quality.py's kv_capacity (docs/data/fp8_quality.json) says the same."""
    bf16 = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, page_size=16, dtype="bfloat16")
    fp8 = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, page_size=16, dtype=KV_FP8)
    assert page_bytes(bf16) == quant.kv_bytes_per_page(28, 4, 128, 16, fp8=False) == 28 * 2 * 4 * 4096
    assert page_bytes(fp8) == quant.kv_bytes_per_page(28, 4, 128, 16, fp8=True) == 28 * 2 * 4 * 2052
    assert bytes_per_token(fp8) == 28 * 2 * 4 * 128.25
    assert page_bytes(bf16) / page_bytes(fp8) == pytest.approx(1.9961, abs=1e-4)
    assert (2**30 // page_bytes(bf16), 2**30 // page_bytes(fp8)) == (1170, 2336)
    smollm2 = [KVLayout(30, 3, 64, 16, dtype) for dtype in ("bfloat16", KV_FP8)]
    assert page_bytes(smollm2[0]) / page_bytes(smollm2[1]) == pytest.approx(2048 / 1028)


def run_slots(runs: list[tuple[int, int]]) -> list[int]:
    """The slots of a step's sequences, each a run ``(first slot, tokens)`` of consecutive slots."""
    return [first + i for first, n in runs for i in range(n)]


def torch_stored(pool: KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A copy of ``pool``'s bytes with ``k``, ``v`` ``[T, heads, dim]`` stored at ``slots`` by
    :func:`store_fp8` (:func:`quant.store_kv_fp8_blocks`)."""
    expected = pool.tensor.clone()
    values, scales = kv_views(expected, pool.layout)
    assert scales is not None
    _, layers, _, heads, page, _ = pool.kv.shape
    # rows numbered as a 16-bit pool's view(-1, head_dim): ((page, layer, k|v, head), offset)
    blocks = ((slots // page) * layers + layer)[:, None, None] * 2 * heads + torch.arange(
        2 * heads, device=slots.device
    ).view(1, 2, heads)
    rows = blocks * page + (slots % page)[:, None, None]
    store_fp8(values, scales, rows.reshape(-1), torch.stack((k, v), 1).reshape(-1, k.shape[-1]))
    return expected


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 32), (7, 1, 64), (28, 4, 128), (9, 3, 64)])
def test_rope_store_into_fp8_is_the_block_store_of_the_rotated_k_and_v(
    dtype: torch.dtype, heads: tuple[int, int, int], fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of tokens into blocks that hold tokens already (their scales grow, the tokens there
    re-encoded), blocks written from offset 0 (a reused page's scale ignored), runs across pages;
    every byte as the torch store writes it. The key rotation inside the rotary kernel
    (``fused``, the default) or as torch's passes after it: q and k rotated as the rotary for a
    16-bit pool then :func:`quant.rotate_qk_` rotate them (fused, within a rounding: a fused
    multiply-add or the product's order of sums may move a value by a bit, on a GPU and on a CPU
    whose matmul sums in another order than the interpreter's: equal bits on one CPU, not on
    another, 2026-12-07)."""
    monkeypatch.setattr(rope, "FUSED_KEY_ROTATION", fused)
    num_q, num_kv, dim = heads
    page, layers, layer = 4, 3, 2
    pool = fp8_pool(12, layers, num_kv, page, dim)
    # (first slot, tokens): from offset 1 across two pages; a whole page; one token at offset 3;
    # one at offset 0; two from offset 2
    slots_list = run_slots([(5, 6), (16, 4), (23, 1), (28, 1), (34, 2)])
    tokens = len(slots_list)
    qkv = torch.randn((tokens, (num_q + 2 * num_kv) * dim), dtype=dtype, device=DEVICE)
    qkv[0, num_q * dim : (num_q + 1) * dim] *= 1e3  # a block's scale grows far
    qkv[1, (num_q + num_kv) * dim :] *= 1e-3
    qkv[12, (num_q + num_kv) * dim : (num_q + num_kv + 1) * dim] = 0.0  # a zero vector keeps the floor's scale
    qkv[13:, num_q * dim :] *= 1e2
    plain_qkv = qkv.clone()
    positions = torch.tensor(random.Random(2).sample(range(100), tokens), device=DEVICE)
    slots = torch.tensor(slots_list, device=DEVICE)
    cos, sin = rope_tables(dim, dtype, 100)
    before = KVPool(pool.layout, 12, DEVICE)
    before.tensor.copy_(pool.tensor)
    rope.rope_store(qkv, num_q, num_kv, cos, sin, positions, slots, pool.kv, layer, pool.kv_scales)
    plain_pool = torch.zeros((12, layers, 2, num_kv, page, dim), dtype=dtype, device=DEVICE)
    rope.rope_store(plain_qkv, num_q, num_kv, cos, sin, positions, slots, plain_pool, layer)
    quant.rotate_qk_(plain_qkv[:, : (num_q + num_kv) * dim].view(tokens, num_q + num_kv, dim), num_q)
    if not fused:
        assert torch.equal(qkv, plain_qkv), "q and k rotated in place as for a 16-bit pool, then by the key rotation"
    else:
        assert rel_err(qkv, plain_qkv) < TOL[dtype], "q and k rotated as for a 16-bit pool, then by the key rotation"
    k = qkv[:, num_q * dim : (num_q + num_kv) * dim].view(tokens, num_kv, dim)
    v = qkv[:, (num_q + num_kv) * dim :].view(tokens, num_kv, dim)
    expected = torch_stored(before, layer, slots, k, v)
    assert torch.equal(pool.tensor, expected), "every byte: the new tokens, the grown blocks, nothing else"
    assert not torch.equal(pool.tensor[1, layer, 0, 0, :dim], before.tensor[1, layer, 0, 0, :dim]), "re-encoded"
    assert pool.kv_scales is not None and before.kv_scales is not None
    assert pool.kv_scales[1, layer, 0, 0] > before.kv_scales[1, layer, 0, 0]


@pytest.mark.parametrize("per_program", [3, 64])
def test_the_fused_rotation_takes_several_tokens_a_program_alike(
    per_program: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Programs of the fused rotation that take several tokens each (a long prefill's, the
    matrix read once a program), the last one short or the only one: the same bytes as a
    program a token."""
    num_q, num_kv, dim, page = 7, 1, 64, 4
    pool = fp8_pool(12, 2, num_kv, page, dim)
    slots_list = run_slots([(5, 6), (16, 4), (28, 1)])
    qkv = torch.randn((len(slots_list), (num_q + 2 * num_kv) * dim), device=DEVICE)
    positions = torch.tensor(random.Random(3).sample(range(100), len(slots_list)), device=DEVICE)
    slots = torch.tensor(slots_list, device=DEVICE)
    cos, sin = rope_tables(dim, qkv.dtype, 100)
    results = []
    for n in (1, per_program):
        monkeypatch.setattr(rope, "rotation_tokens", lambda tokens, n=n: n)
        into, rows = KVPool(pool.layout, 12, DEVICE), qkv.clone()
        into.tensor.copy_(pool.tensor)
        rope.rope_store(rows, num_q, num_kv, cos, sin, positions, slots, into.kv, 1, into.kv_scales)
        results.append((rows, into.tensor))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    monkeypatch.undo()
    assert [rope.rotation_tokens(t) for t in (1, 511, 1024, 4096, 65536)] == [1, 1, 2, 8, 8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_over_fp8_matches_float64_over_the_dequantized_kv(dtype: torch.dtype, case: tuple) -> None:
    page, num_q, num_kv, dim, lens, window = case
    rng = random.Random(str(case))
    layers, layer = 3, 1
    pool = fp8_pool(96, layers, num_kv, page, dim)
    before = pool.tensor.clone()
    kv64 = dequantized(pool)
    tables, table_t = scattered_tables(lens, page, 96, rng, spare=2)
    qkv = torch.randn((len(lens), (num_q + 2 * num_kv) * dim), dtype=dtype, device=DEVICE)
    q = qkv[:, : num_q * dim].view(len(lens), num_q, dim)
    counters = torch.zeros(len(lens) * num_kv, dtype=torch.int32, device=DEVICE)
    for splits, fused in ((1, False), (4, False), (4, True)):
        ctx = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
        out = torch.full((len(lens), num_q, dim), float("nan"), dtype=dtype, device=DEVICE)
        paged.decode_attention(
            q, pool.kv, layer, table_t, ctx, dim**-0.5, splits, out, window, block_n=16,
            counters=counters if fused else None, kv_scales=pool.kv_scales,
        )  # fmt: skip
        for i, n in enumerate(lens):
            k, v = gather(kv64, layer, tables[i], n)
            ref = ref_attention(q[i][:, None], k, v, torch.tensor([n - 1], device=DEVICE), window)[:, 0]
            assert rel_err(out[i], ref) < TOL[dtype], (splits, i)
    assert torch.equal(pool.tensor, before), "read in place, nothing written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks", [[(0, 20)], [(16, 9), (0, 5)], [(37, 1), (3, 30)]])
@pytest.mark.parametrize("window", [None, 10])
def test_prefill_attention_over_fp8_matches_float64_over_the_dequantized_kv(
    dtype: torch.dtype, chunks: list, window: int | None
) -> None:
    page, num_q, num_kv, dim, layers, layer = 8, 4, 2, 32, 2, 1
    pool = fp8_pool(40, layers, num_kv, page, dim)
    kv64 = dequantized(pool)
    ids = list(range(40))
    random.Random(1).shuffle(ids)
    tables, q_starts, row, start = [], [], 3, 0  # 3 rows before the chunks, as decode tokens
    for prefix, n in chunks:
        need = -(-(prefix + n) // page)
        tables.append(ids[start : start + need])
        start += need
        q_starts.append(row)
        row += n
    table_t = torch.zeros((len(chunks), max(map(len, tables))), dtype=torch.int32, device=DEVICE)
    for i, t in enumerate(tables):
        table_t[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn((row, num_q, dim), dtype=dtype, device=DEVICE)
    out = torch.full_like(q, float("nan"))

    def ints(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=DEVICE)

    paged_prefill.prefill_attention(
        q, pool.kv, layer, table_t, ints(q_starts), ints([n for _, n in chunks]), ints([p + n for p, n in chunks]),
        max(n for _, n in chunks), dim**-0.5, out, window, kv_scales=pool.kv_scales,
    )  # fmt: skip
    assert out[:3].isnan().all(), "rows outside the chunks were written"
    for i, (prefix, n) in enumerate(chunks):
        k, v = gather(kv64, layer, tables[i], prefix + n)
        qs = q[q_starts[i] : q_starts[i] + n].transpose(0, 1)
        ref = ref_attention(qs, k, v, torch.arange(prefix, prefix + n, device=DEVICE), window)
        assert rel_err(out[q_starts[i] : q_starts[i] + n].transpose(0, 1), ref) < TOL[dtype], i


# float16 queries: the tiles a bfloat16 model reads with paged.FP8_F16_TILES (on a GPU: bfloat16
# queries converted, f16=True, and bfloat16 tiles, f16=False); the CPU's interpreter runs
# float16 but not bfloat16 dots
def off_by(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``rel_err`` less what float16's subnormals cannot tell apart (a spacing of 2^-24 an
    element): a sequence of one small token has an output below float16's normal range."""
    err = (out.double() - ref.double()).norm() - 2.0**-24 * ref.numel() ** 0.5
    return max(0.0, err.item()) / max(ref.double().norm().item(), 1e-30)


F16_CASES = [(torch.float16, None)] + (
    [(torch.bfloat16, True), (torch.bfloat16, False)] if DEVICE.type == "cuda" else []
)


@pytest.mark.parametrize(("dtype", "f16"), F16_CASES)
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]])
def test_attention_over_fp8_in_float16_tiles_matches_float64(dtype: torch.dtype, f16: bool | None, case: tuple) -> None:
    """Decode (one split and four) and prefill over an FP8 pool read in float16 tiles, its value
    scales made small (2^-15 to 2^-20, where p times a scale would leave float16's normal range:
    each block's weights are taken relative to its largest value scale), against float64."""
    page, num_q, num_kv, dim, lens, window = case
    pool = fp8_pool(96, 3, num_kv, page, dim)
    assert pool.kv_scales is not None
    v_scales = pool.kv_scales[:, :, 1]  # 2^-15 to 2^-20 from block to block
    v_scales.copy_(torch.exp2(-15.0 - torch.arange(v_scales.numel(), device=DEVICE) % 6).view_as(v_scales))
    tol = 1e-3 if dtype == torch.float16 else TOL[dtype]
    kv64 = dequantized(pool)
    tables, table_t = scattered_tables(lens, page, 96, random.Random(str(case)), spare=2)
    q = torch.randn((len(lens), num_q, dim), dtype=dtype, device=DEVICE) * 4
    ctx = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    refs = []
    for i, n in enumerate(lens):
        k, v = gather(kv64, 1, tables[i], n)
        refs.append(ref_attention(q[i][:, None], k, v, torch.tensor([n - 1], device=DEVICE), window)[:, 0])
    for splits in (1, 4):
        out = torch.full((len(lens), num_q, dim), float("nan"), dtype=dtype, device=DEVICE)
        paged.decode_attention(
            q, pool.kv, 1, table_t, ctx, dim**-0.5, splits, out, window, block_n=16, kv_scales=pool.kv_scales, f16=f16
        )
        for i in range(len(lens)):
            assert off_by(out[i], refs[i]) < tol, (splits, i)
    ints = {"dtype": torch.int32, "device": DEVICE}
    rows = torch.tensor([0, *itertools.accumulate(lens)], **ints)
    out = torch.full((int(rows[-1]), num_q, dim), float("nan"), dtype=dtype, device=DEVICE)
    lens_t = torch.tensor(lens, **ints)
    qs = torch.cat([q[i : i + 1].expand(n, -1, -1) for i, n in enumerate(lens)])  # each row: the last position's q
    paged_prefill.prefill_attention(
        qs, pool.kv, 1, table_t, rows[:-1], lens_t, lens_t, max(lens), dim**-0.5, out, window, pool.kv_scales, f16
    )
    for i in range(len(lens)):
        assert off_by(out[int(rows[i + 1]) - 1], refs[i]) < tol, i


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES[:4])
def test_decode_attention_with_rope_stores_what_rope_store_stores(dtype: torch.dtype, case: tuple) -> None:
    """The decode kernel's own store (``rope=``) into an FP8 pool: the bytes
    :func:`rope.rope_store` writes, then the output of attention over them."""
    page, num_q, num_kv, dim, lens, window = case
    rng = random.Random(f"rope {case}")
    layers, layer = 3, 2
    pool = fp8_pool(96, layers, num_kv, page, dim)
    tables, table_t = scattered_tables(lens, page, 96, rng, spare=1)
    positions = torch.tensor([n - 1 for n in lens], device=DEVICE)
    slots = torch.tensor([t[(n - 1) // page] * page + (n - 1) % page for t, n in zip(tables, lens, strict=True)])
    slots = slots.to(DEVICE)
    cos, sin = rope_tables(dim, dtype)
    qkv = torch.randn((len(lens), (num_q + 2 * num_kv) * dim), dtype=dtype, device=DEVICE)
    qkv[-1, num_q * dim :] *= 1e3  # the last sequence's block scales grow, its page's tokens re-encoded
    ctx = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    separate_qkv, separate = qkv.clone(), KVPool(pool.layout, 96, DEVICE)
    separate.tensor.copy_(pool.tensor)
    rope.rope_store(separate_qkv, num_q, num_kv, cos, sin, positions, slots, separate.kv, layer, separate.kv_scales)
    for splits in (1, 4):
        fused = KVPool(pool.layout, 96, DEVICE)
        fused.tensor.copy_(pool.tensor)
        out = torch.full((len(lens), num_q, dim), float("nan"), dtype=dtype, device=DEVICE)
        paged.decode_attention(
            qkv[:, : num_q * dim].view(len(lens), num_q, dim), fused.kv, layer, table_t, ctx, dim**-0.5, splits,
            out, window, block_n=16, rope=(cos, sin, slots), kv_scales=fused.kv_scales,
        )  # fmt: skip
        if DEVICE.type == "cpu":
            assert torch.equal(fused.tensor, separate.tensor), splits
        else:  # a fused multiply-add may move a rotated k by a bit, and its FP8 rounding with it
            assert rel_err(dequantized(fused), dequantized(separate)) < 1e-2, splits
        assert fused.kv_scales is not None and pool.kv_scales is not None
        grown = fused.kv_scales[slots[-1] // page, layer] > pool.kv_scales[slots[-1] // page, layer]
        assert grown.all() or lens[-1] % page == 1, "a larger token grows its blocks' scales"
        expected = torch.empty_like(out)
        paged.decode_attention(
            separate_qkv[:, : num_q * dim].view(len(lens), num_q, dim), separate.kv, layer, table_t, ctx,
            dim**-0.5, splits, expected, window, block_n=16, kv_scales=separate.kv_scales,
        )  # fmt: skip
        assert rel_err(out, expected) < TOL[dtype], splits


@pytest.mark.parametrize("dim", [64, 128, 96, 24])
def test_the_key_rotation_leaves_every_score_and_spreads_a_keys_outliers(dim: int) -> None:
    h, p = quant.kv_key_rotation(dim, torch.float64, torch.device("cpu"))
    assert p == dim & -dim and torch.equal(h @ h, p * torch.eye(dim, dtype=torch.float64)) and torch.equal(h, h.T)
    assert set(h.unique().tolist()) <= {-1.0, 0.0, 1.0} and (h != 0).sum() == dim * p
    g = torch.Generator().manual_seed(dim)
    q, k = (
        torch.randn(5, 3, dim, generator=g, dtype=torch.float64),
        torch.randn(7, 3, dim, generator=g, dtype=torch.float64),
    )
    k[:, :, 1] *= 50  # an outlier channel
    rq, rk = quant.rotate_queries_keys(q, k)
    assert rq is not None and rk is not None
    assert torch.allclose(torch.einsum("qhd,khd->hqk", rq, rk), torch.einsum("qhd,khd->hqk", q, k))
    share = lambda x: (x.abs().amax(-1) / x.norm(dim=-1)).mean()  # noqa: E731
    assert share(rk) < share(k) / 2, "the outlier's share of each key, spread over p channels"
    qk = torch.cat((q, k[:5]), 1).to(torch.float32)
    qk_rotated = qk.clone()
    quant.rotate_qk_(qk_rotated, 3)
    want_q, want_k = quant.rotate_queries_keys(qk[:, :3], qk[:, 3:])
    assert want_q is not None and want_k is not None
    assert torch.equal(qk_rotated, torch.cat((want_q, want_k), 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "num_q", "num_kv", "dim", "page"),
    [(1, 4, 2, 64, 16), (37, 6, 2, 32, 8), (300, 28, 4, 128, 16), (20, 3, 1, 80, 16)],
)
def test_a_fresh_prompt_s_kv_rounded_in_one_launch_is_round_fp8_s(
    dtype: torch.dtype, n: int, num_q: int, num_kv: int, dim: int, page: int
) -> None:
    """A whole prompt attending over its own keys and values (the GPU's ``sdpa_prefill``)
    sees them as an FP8 pool holds them: :func:`paged.round_kv_fp8` reads them out of the
    step's qkv rows (K heads after the queries, V after them; blocks of ``page`` tokens from
    the prompt's first, magnitudes 2^-8 to 2^8 so that every block's scale differs) and gives
    back :func:`kv_pool.round_fp8` of each, bit for bit, for a head_dim no power of two too, into
    a buffer of its own or in place."""
    from pdserve.engine.kv_pool import round_fp8

    gen = torch.Generator().manual_seed(n * 7 + dim)
    width = (num_q + 2 * num_kv) * dim
    big = torch.randn(n, width + 8, generator=gen) * torch.exp2(torch.randint(-8, 9, (n, 1), generator=gen))
    rows = big.to(dtype).to(DEVICE)[:, :width]  # a row stride wider than the row, as a view of the step's qkv
    pool = torch.empty(1, dtype=quant.FP8, device=DEVICE)
    k, v = paged.round_kv_fp8(rows, num_q * dim, num_kv, dim, page, pool)
    want_k = round_fp8(rows[:, num_q * dim : (num_q + num_kv) * dim].reshape(n, num_kv, dim), page)
    want_v = round_fp8(rows[:, (num_q + num_kv) * dim :].reshape(n, num_kv, dim), page)
    assert k.dtype == dtype and k.shape == (n, num_kv, dim)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert not torch.equal(k, rows[:, num_q * dim : (num_q + num_kv) * dim].reshape(n, num_kv, dim))  # rounded
    # in place: the same bits over the rows' own K and V columns, the queries and the columns
    # beyond the row untouched, and k, v views of them
    before = big.to(dtype).to(DEVICE)
    k_in, v_in = paged.round_kv_fp8(before[:, :width], num_q * dim, num_kv, dim, page, pool, in_place=True)
    assert torch.equal(k_in, want_k) and torch.equal(v_in, want_v)
    assert k_in.data_ptr() == before[:, num_q * dim :].data_ptr()
    assert torch.equal(before[:, num_q * dim : (num_q + num_kv) * dim], want_k.reshape(n, -1))
    assert torch.equal(before[:, (num_q + num_kv) * dim : width], want_v.reshape(n, -1))
    untouched = big.to(dtype).to(DEVICE)
    assert torch.equal(before[:, : num_q * dim], untouched[:, : num_q * dim])
    assert torch.equal(before[:, width:], untouched[:, width:])


def test_the_torch_store_writes_the_kernels_bytes_and_the_read_dequantizes() -> None:
    """:func:`store_fp8` (the CPU pass and the stock-code path) writes the bytes
    :func:`rope.rope_store` writes for the same k, v: pools filled either way are
    interchangeable (PD between a CPU-pass worker and a Triton one); :func:`gather_fp8` reads
    blocks back as :func:`quant.dequantize_kv_fp8` does."""
    num_q, num_kv, dim, page, layers, layer = 4, 2, 32, 4, 2, 1
    layout = KVLayout(layers, num_kv, dim, page, KV_FP8)
    by_kernel, by_torch = KVPool(layout, 8, DEVICE), KVPool(layout, 8, DEVICE)
    slots = torch.tensor(run_slots([(2, 7), (13, 1), (20, 4)]), device=DEVICE)
    tokens = len(slots)
    qkv = torch.randn((tokens, (num_q + 2 * num_kv) * dim), device=DEVICE) * torch.rand(tokens, 1, device=DEVICE) * 9
    positions = torch.arange(tokens, device=DEVICE)
    cos, sin = rope_tables(dim, torch.float32, 16)
    rope.rope_store(qkv, num_q, num_kv, cos, sin, positions, slots, by_kernel.kv, layer, by_kernel.kv_scales)
    # rows of head_dim values, numbered as a 16-bit pool's view(-1, head_dim): (token, k|v, head)
    base = ((slots // page) * (layers * 2 * num_kv) + layer * 2 * num_kv)[:, None] + torch.arange(
        2 * num_kv, device=DEVICE
    )
    rows = (base * page + (slots % page)[:, None]).view(-1)
    assert by_torch.kv_scales is not None and by_kernel.kv_scales is not None
    store_fp8(by_torch.kv, by_torch.kv_scales, rows, qkv[:, num_q * dim :].reshape(-1, dim))
    assert torch.equal(by_torch.tensor, by_kernel.tensor)
    blocks = torch.tensor([5, 0, 17], device=DEVICE)
    got = gather_fp8(by_kernel.kv, by_kernel.kv_scales, blocks, torch.float32)
    whole = quant.dequantize_kv_fp8(by_kernel.kv, by_kernel.kv_scales, torch.float32).view(-1, page * dim)
    assert torch.equal(got, whole[blocks])


def test_fp8_pages_move_as_bytes_between_pools_tiers_and_blobs() -> None:
    """Whatever moves whole pages moves FP8 ones unchanged: a transfer's byte copy of the
    segments, copy_page, the host tier and a disk/store blob."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype=KV_FP8)
    src = KVPool(layout, 6, torch.device("cpu"))
    src.tensor.copy_(torch.randint(0, 255, src.tensor.shape, dtype=torch.uint8))
    dst = KVPool(layout, 6, torch.device("cpu"))
    (address, nbytes), *_ = src.segments([2, 3])
    ctypes.memmove(dst.page_address(4), address, nbytes)  # what a transfer backend does
    assert torch.equal(dst.tensor[4:6], src.tensor[2:4])
    assert dst.kv_scales is not None and src.kv_scales is not None
    # as bits: random bytes read as float32 scales hold NaNs (unequal to themselves)
    assert torch.equal(dst.kv_scales[4:6].view(torch.int32), src.kv_scales[2:4].view(torch.int32))
    assert torch.equal(dst.kv[4:6].view(torch.uint8), src.kv[2:4].view(torch.uint8))
    src.copy_page(1, 0)
    assert torch.equal(src.tensor[0], src.tensor[1])
    host = HostTier(src, 3 * src.page_bytes)
    host.store(b"k", 5)
    host.load(b"k", 0)
    assert torch.equal(src.tensor[0], src.tensor[5])
    ident = kv_blob.identity(b"model", layout, 2)
    assert ident != kv_blob.identity(b"model", KVLayout(2, 2, 16, 4, "bfloat16"), 2), "a blob names its dtype"
    blob = kv_blob.encode(ident, bytes(16), src.tensor[[3, 1]])
    assert torch.equal(kv_blob.decode(blob, ident, bytes(16), layout), src.tensor[[3, 1]])
