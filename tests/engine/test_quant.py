"""FP8 helpers of ``engine/quant.py``: the KV cache's per-token scales and FP8 checkpoints'
weights as per-channel :class:`Fp8Weight`, on small synthetic tensors."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.quant import (
    FP8,
    FP8_MAX,
    dequantize_kv_fp8,
    fp8_weight_from_checkpoint,
    fp8_weight_from_scaled,
    kv_bytes_per_token,
    quantize_kv_fp8,
)

# e4m3 keeps 3 mantissa bits: rounding to nearest is within 2**-4 of a normal value.
REL = 2.0**-4


def kv(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Heads of very different magnitudes, as real keys have: one scale each keeps them all.
    magnitudes = torch.logspace(-3, 2, shape[-2])[:, None]
    return torch.randn(*shape, generator=g) * magnitudes


def test_kv_round_trip_is_within_half_an_e4m3_step_of_each_vectors_amax() -> None:
    x = kv(5, 3, 7, 64).to(torch.bfloat16)  # [tokens, heads, ..., head_dim]: any leading shape
    q, scale = quantize_kv_fp8(x)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    back = dequantize_kv_fp8(q, scale, torch.float32)
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    assert torch.allclose(scale, amax[..., 0] / FP8_MAX)
    # Normal values within 2**-4 relative; the smallest (e4m3 subnormals) within half its smallest step.
    bound = torch.maximum(REL * x32.abs(), amax / FP8_MAX * 2.0**-10)
    assert ((back - x32).abs() <= bound + 1e-30).all()
    assert torch.equal(q.float().abs().amax(dim=-1), torch.full(x.shape[:-1], FP8_MAX)), "each amax maps to 448"


def test_kv_scale_is_per_vector_so_appended_tokens_do_not_change_stored_ones() -> None:
    first, later = kv(4, 3, 16), 1000 * kv(2, 3, 16, seed=1)
    q_first, s_first = quantize_kv_fp8(first)
    q_all, s_all = quantize_kv_fp8(torch.cat([first, later]))
    assert torch.equal(q_all[:4].view(torch.uint8), q_first.view(torch.uint8)) and torch.equal(s_all[:4], s_first)


def test_kv_zero_vectors_come_back_zero_with_finite_scales() -> None:
    x = torch.zeros(2, 3, 8)
    x[1, 2] = torch.tensor([-4.0, -2.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0])
    q, scale = quantize_kv_fp8(x)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    back = dequantize_kv_fp8(q, scale, torch.float32)
    assert torch.equal(back[0], torch.zeros(3, 8)) and torch.equal(back[1, :2], torch.zeros(2, 8))
    assert torch.allclose(back[1, 2], x[1, 2], rtol=1e-6, atol=0), "powers of two survive a scale of 4 / 448"


def test_kv_errors_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"last \(head_dim\) dimension, got shape \[\]"):
        quantize_kv_fp8(torch.tensor(1.0))
    q, scale = quantize_kv_fp8(kv(2, 3, 8))
    with pytest.raises(ValueError, match=r"not torch\.bfloat16"):
        dequantize_kv_fp8(q.to(torch.bfloat16), scale)
    with pytest.raises(ValueError, match=r"float32 \[2, 3\], got torch.float32 \[3\]"):
        dequantize_kv_fp8(q, scale[0])


def test_kv_bytes_per_token_counts_the_scales() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64: bf16 128 bytes a vector, FP8 64 + a 4-byte scale.
    assert kv_bytes_per_token(30, 3, 64, fp8=False) == 30 * 2 * 3 * 128
    assert kv_bytes_per_token(30, 3, 64, fp8=True) == 30 * 2 * 3 * 68


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
