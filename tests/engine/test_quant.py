"""FP8 helpers of ``engine/quant.py``: the KV cache's block scales (and the store that grows
them) and FP8 checkpoints' weights as per-channel :class:`Fp8Weight`, on small synthetic tensors."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.quant import (
    FP8,
    FP8_MAX,
    dequantize_kv_fp8,
    fp8_weight_from_checkpoint,
    fp8_weight_from_scaled,
    kv_block_scale,
    kv_bytes_per_page,
    quantize_kv_fp8,
    store_kv_fp8_blocks,
)

# e4m3 keeps 3 mantissa bits: rounding to nearest is within 2**-4 of a normal value.
REL = 2.0**-4


def kv(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Tokens of very different magnitudes inside a block: one scale covers them all.
    magnitudes = torch.logspace(-3, 2, shape[-2])[:, None]
    return torch.randn(*shape, generator=g) * magnitudes


def test_the_block_scale_is_amax_over_448_rounded_up_to_a_power_of_two() -> None:
    amax = torch.tensor([448.0, 449.0, 1.0, 3e-5, 0.0, 1e30, 896.0 * 1.5])
    scale = kv_block_scale(amax)
    assert scale.tolist() == [1.0, 2.0, 2.0**-8, 2.0**-23, 2.0**-48, 2.0**91, 4.0]
    t = amax.clamp_min(1e-12) / 448
    assert (scale >= t).all() and (scale < 2 * t).all()
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all(), "powers of two"


def test_kv_round_trip_is_within_half_an_e4m3_step_of_each_value() -> None:
    x = kv(5, 3, 16, 64).to(torch.bfloat16)  # [..., tokens, head_dim]: any leading shape
    q, scale = quantize_kv_fp8(x)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-2]
    back = dequantize_kv_fp8(q, scale, torch.float32)
    x32 = x.float()
    assert torch.equal(scale, kv_block_scale(x32.abs().amax(dim=(-2, -1))))
    # Normal values within 2**-4 relative; the smallest (e4m3 subnormals) within half its smallest step.
    bound = torch.maximum(REL * x32.abs(), scale[..., None, None] * 2.0**-10)
    assert ((back - x32).abs() <= bound + 1e-30).all()
    top = q.float().abs().amax(dim=(-2, -1))
    assert (top > FP8_MAX / 2 - 16).all() and (top <= FP8_MAX).all(), "each block's amax maps into (224, 448]"


def stored(blocks: int, page: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty blocks (garbage bytes and scales, as a reused page holds)."""
    g = torch.Generator().manual_seed(7)
    values = torch.randint(0, 120, (blocks, page, dim), dtype=torch.uint8, generator=g)
    return values, torch.rand(blocks, generator=g) * 100


def test_storing_a_block_token_by_token_equals_storing_it_at_once() -> None:
    """The scale grows as larger tokens arrive and the earlier ones are shifted by the ratio, a
    power of two: exact for normal values, so the order of stores does not matter."""
    page, dim = 8, 16
    g = torch.Generator().manual_seed(3)
    # every value within a factor 2 of its token's magnitude: normal at every scale the block takes
    signs = torch.randint(0, 2, (page, dim), generator=g) * 2 - 1
    x = signs * (1 + torch.rand(page, dim, generator=g)) * torch.tensor([1, 0.5, 8, 2, 300, 1, 0.25, 40])[:, None]
    at_once, one_by_one = stored(3, page, dim), stored(3, page, dim)
    offsets = torch.arange(page)
    store_kv_fp8_blocks(*at_once, torch.full((page,), 1), offsets, x)
    for t in range(page):
        store_kv_fp8_blocks(*one_by_one, torch.tensor([1]), offsets[t : t + 1], x[t : t + 1])
        held = dequantize_kv_fp8(one_by_one[0][1, : t + 1].view(FP8), one_by_one[1][1], torch.float32)
        assert torch.equal(held, dequantize_kv_fp8(*quantize_kv_fp8(x[: t + 1]), torch.float32)), t
    q, scale = quantize_kv_fp8(x)
    for values, scales in (at_once, one_by_one):
        assert torch.equal(values[1].view(FP8).float(), q.float()) and scales[1] == scale
    assert torch.equal(at_once[0][[0, 2]], stored(3, page, dim)[0][[0, 2]]), "other blocks untouched"
    # in chunks (3 then 5 rows), two blocks in one call
    chunks = stored(3, page, dim)
    store_kv_fp8_blocks(*chunks, torch.tensor([1, 1, 1, 2]), torch.tensor([0, 1, 2, 0]), torch.cat([x[:3], x[:1]]))
    store_kv_fp8_blocks(*chunks, torch.full((5,), 1), offsets[3:], x[3:])
    assert torch.equal(chunks[0][1], at_once[0][1]) and chunks[1][1] == at_once[1][1]
    assert torch.equal(chunks[0][2, 0].view(FP8).float(), quantize_kv_fp8(x[:1])[0][0].float())


def test_a_block_written_from_offset_0_takes_no_scale_from_before() -> None:
    values, scales = stored(2, 4, 8)
    scales[0] = 2.0**20  # a freed page's old scale
    x = torch.randn(2, 8)
    store_kv_fp8_blocks(values, scales, torch.tensor([0, 0]), torch.tensor([0, 1]), x)
    q, scale = quantize_kv_fp8(x)
    assert scales[0] == scale and torch.equal(values[0, :2].view(FP8).float(), q.float())
    # from offset 2 the block's scale stays where the new rows are smaller
    small = x[:1] / 64
    store_kv_fp8_blocks(values, scales, torch.tensor([0]), torch.tensor([2]), small)
    assert scales[0] == scale and torch.equal(values[0, :2].view(FP8).float(), q.float())
    assert torch.equal(values[0, 2].view(FP8).float(), (small[0] / scale).to(FP8).float())


def test_kv_zero_blocks_come_back_zero_with_finite_scales() -> None:
    x = torch.zeros(2, 3, 8)
    x[1, 2] = torch.tensor([-4.0, -2.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0])
    q, scale = quantize_kv_fp8(x)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    back = dequantize_kv_fp8(q, scale, torch.float32)
    assert torch.equal(back[0], torch.zeros(3, 8)) and torch.equal(back[1, :2], torch.zeros(2, 8))
    assert torch.equal(back[1, 2], x[1, 2]), "powers of two survive a power-of-two scale"


def test_kv_errors_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"\[\.\.\., tokens, head_dim\], got shape \[4\]"):
        quantize_kv_fp8(torch.ones(4))
    q, scale = quantize_kv_fp8(kv(2, 3, 8))
    with pytest.raises(ValueError, match=r"not torch\.bfloat16"):
        dequantize_kv_fp8(q.to(torch.bfloat16), scale)
    with pytest.raises(ValueError, match=r"float32 \[2\], got torch.float32 \[\]"):
        dequantize_kv_fp8(q, scale[0])
    with pytest.raises(ValueError, match=r"rows \[N, head_dim\] with N blocks and offsets"):
        store_kv_fp8_blocks(*stored(1, 4, 8), torch.tensor([0]), torch.tensor([0, 1]), torch.ones(1, 8))


def test_kv_bytes_per_page_counts_the_scales() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64: bf16 2 * 16 * 64 bytes a block, FP8 16 * 64 and a 4-byte scale.
    assert kv_bytes_per_page(30, 3, 64, 16, fp8=False) == 30 * 2 * 3 * 2048
    assert kv_bytes_per_page(30, 3, 64, 16, fp8=True) == 30 * 2 * 3 * 1028


def scaled(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * FP8_MAX / 4).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_a_per_tensor_scale_is_kept_exactly_as_per_channel_scales(shape: tuple[int, ...]) -> None:
    q = scaled(6, 10)
    w = fp8_weight_from_scaled(q, torch.full(shape, 0.03, dtype=torch.bfloat16))
    assert same(w.q, q) and w.scale.dtype == torch.float32
    assert torch.equal(w.scale, torch.full((6,), torch.tensor(0.03, dtype=torch.bfloat16).item()))


@pytest.mark.parametrize("shape", [(6,), (6, 1)])
def test_per_channel_scales_are_kept(shape: tuple[int, ...]) -> None:
    q, scale = scaled(6, 10), torch.rand(6) + 0.1
    w = fp8_weight_from_scaled(q, scale.reshape(shape))
    assert same(w.q, q) and torch.equal(w.scale, scale)


def test_block_scales_become_each_rows_largest_and_the_other_blocks_round_again() -> None:
    # 5 x 7 in blocks of 2 x 4: [3, 2] scales, the last block row and column partial.
    q, block = scaled(5, 7, seed=2), torch.tensor([[1.0, 0.3], [2.0, 2.0], [0.25, 0.01]])
    w = fp8_weight_from_scaled(q, block, block_size=(2, 4))
    full = block.repeat_interleave(2, 0)[:5].repeat_interleave(4, 1)[:, :7]
    original = q.float() * full
    assert w.shape == (5, 7) and torch.equal(w.scale, torch.tensor([1.0, 1.0, 2.0, 2.0, 0.25]))
    back = w.dequantize(torch.float32)
    # Rows 2-3 share one scale; the first block of every row holds its row's largest: unchanged.
    assert torch.equal(back[2:4], original[2:4]) and torch.equal(back[:, :4], original[:, :4])
    # Rows 0-1's second block (0.3 of 1.0) rounds again: within half a step, or half the
    # smallest subnormal step at the row's scale.
    err = (back - original).abs()[:2, 4:]
    assert (err > 0).any() and (err <= REL * original[:2, 4:].abs() + 2.0**-10).all()


def test_a_zero_row_in_a_block_scaled_weight_stays_zero() -> None:
    q = scaled(4, 4)
    q[1] = torch.zeros(4).to(FP8)
    w = fp8_weight_from_scaled(q, torch.ones(2, 1), block_size=(2, 4))
    assert torch.equal(w.dequantize(torch.float32)[1], torch.zeros(4)) and torch.isfinite(w.scale).all()


def test_checkpoint_scales_of_the_wrong_shape_or_dtype_are_refused() -> None:
    q = scaled(6, 10)
    with pytest.raises(ValueError, match=r"per channel \(\[6\] or \[6, 1\]\), or a block_size, got \[3\]"):
        fp8_weight_from_scaled(q, torch.ones(3))
    with pytest.raises(ValueError, match=r"blocks of \[4, 4\] needs scales \[2, 3\], got \[1, 1\]"):
        fp8_weight_from_scaled(q, torch.ones(1, 1), block_size=(4, 4))
    with pytest.raises(ValueError, match="float8_e5m2 weights are not supported"):
        fp8_weight_from_scaled(q.float().to(torch.float8_e5m2), torch.ones(1))
    with pytest.raises(ValueError, match=r"matrices, got shape \[60\]"):
        fp8_weight_from_scaled(q.reshape(60), torch.ones(1))


def test_hf_fp8_checkpoints_block_scaled_and_per_tensor() -> None:
    q, inv = scaled(256, 384), torch.rand(2, 3) + 0.5
    tensors = {
        "m.up.weight": q,
        "m.up.weight_scale_inv": inv,
        "m.down.weight": q,
        "m.down.weight_scale": torch.tensor(2.0),
    }
    config = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    up = fp8_weight_from_checkpoint(tensors, "m.up", config)
    assert same(up.q, fp8_weight_from_scaled(q, inv, (128, 128)).q)
    full = inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    err = (up.dequantize(torch.float32) - q.float() * full).abs()
    assert (err <= REL * (q.float() * full).abs() + up.scale[:, None] * 2.0**-10).all()
    down = fp8_weight_from_checkpoint(tensors, "m.down", config)
    assert same(down.q, q) and torch.equal(down.scale, torch.full((256,), 2.0))
    # Without weight_block_size, DeepSeek's and Qwen's 128 x 128.
    assert torch.equal(fp8_weight_from_checkpoint(tensors, "m.up", {"quant_method": "fp8"}).scale, up.scale)


def compressed_tensors(strategy: str, **extra: object) -> dict[str, object]:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, **extra}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"weights": weights}},
    }


def test_compressed_tensors_fp8_per_tensor_channel_and_block() -> None:
    q = scaled(8, 16)
    channel = torch.rand(8, 1, dtype=torch.bfloat16) + 0.5
    w = fp8_weight_from_checkpoint({"l.weight": q, "l.weight_scale": channel}, "l", compressed_tensors("channel"))
    assert same(w.q, q) and torch.equal(w.scale, channel.float().reshape(8))
    w = fp8_weight_from_checkpoint({"l.weight": q, "l.weight_scale": torch.ones(1)}, "l", compressed_tensors("tensor"))
    assert same(w.q, q) and torch.equal(w.scale, torch.ones(8))
    block = fp8_weight_from_checkpoint(
        {"l.weight": q, "l.weight_scale": torch.ones(2, 2)}, "l", compressed_tensors("block", block_structure=[4, 8])
    )
    assert same(block.q, q) and torch.equal(block.scale, torch.ones(8)), "one scale a row: unchanged"


def test_checkpoint_errors_name_the_tensor_or_the_format() -> None:
    q = scaled(4, 4)
    with pytest.raises(ValueError, match=r"the checkpoint has no tensor l\.weight_scale$"):
        fp8_weight_from_checkpoint({"l.weight": q}, "l", {"quant_method": "fp8"})
    with pytest.raises(ValueError, match=r"l\.weight is torch.bfloat16, not float8_e4m3fn: not an FP8 layer"):
        fp8_weight_from_checkpoint({"l.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}, "l", {"quant_method": "fp8"})
    with pytest.raises(
        ValueError, match=r"quant_method 'gptq' is not an FP8 checkpoint format \(fp8, compressed-tensors\)"
    ):
        fp8_weight_from_checkpoint({"l.weight": q}, "l", {"quant_method": "gptq"})
    int8 = compressed_tensors("channel", type="int")
    with pytest.raises(ValueError, match="weights of type 'int' with 8 bits are not FP8"):
        fp8_weight_from_checkpoint({"l.weight": q, "l.weight_scale": torch.ones(4, 1)}, "l", int8)
