"""The CPU pass's fused element-wise kernels (``engine/kernels/cpu_elementwise.c``) against
the torch ops they replace, bit for bit where the order of operations is the same, and how
the pass chooses them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.bench import shapes
from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels import native
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.models.llama_cpu import LlamaFamilyCPU

CPU = torch.device("cpu")


def bf16(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 16, 700])
def test_silu_mul_equals_torchs_ops_bit_for_bit(rows: int) -> None:
    gate_up = bf16(rows, 2 * 1536 + 64, scale=4.0)[:, : 2 * 1536]  # strided rows
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, float("inf")])  # the tails of exp
    n = 1536
    ours = native.silu_mul(gate_up)
    expected = F.silu(gate_up[:, :n]) * gate_up[:, n:]
    assert ours.shape == expected.shape
    assert torch.equal(ours, expected)


def stock_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype), x


@pytest.mark.parametrize("rows", [1, 16, 700])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_equals_the_stock_norm(rows: int, with_residual: bool) -> None:
    """The sum and the residual bit for bit; the norm too but where the float32 sum of squares,
    taken in another order, lands its row's scale on the other side of a bfloat16 rounding:
    at most one element in 10,000 and one bfloat16 step."""
    x = bf16(rows, 576, scale=3.0, seed=1)
    residual = bf16(rows, 576, seed=2) if with_residual else None
    weight = (torch.rand(576, generator=torch.Generator().manual_seed(3)) + 0.5).to(torch.bfloat16)
    expected_norm, expected_sum = stock_rms_norm(x, residual, weight, 1e-5)
    norm, total = native.add_rms_norm(x, None if residual is None else residual.clone(), weight, 1e-5)
    assert torch.equal(total, expected_sum)
    differ = norm != expected_norm
    assert int(differ.sum()) <= max(1, norm.numel() // 10_000)
    if differ.any():  # one bfloat16 step apart
        a = norm[differ].view(torch.int16).int()
        b = expected_norm[differ].view(torch.int16).int()
        assert bool(((a - b).abs() <= 1).all())


def test_add_rms_norm_writes_the_sum_over_the_residual() -> None:
    x, residual = bf16(4, 64, seed=4), bf16(4, 64, seed=5)
    weight = torch.ones(64, dtype=torch.bfloat16)
    expected = x + residual
    _, total = native.add_rms_norm(x, residual, weight, 1e-6)
    assert total.data_ptr() == residual.data_ptr() and torch.equal(residual, expected)


@pytest.mark.parametrize(("heads", "dim"), [(12, 64), (6, 128), (3, 80)])
def test_rope_equals_the_stock_rotation_bit_for_bit(heads: int, dim: int) -> None:
    """In place over the first ``heads`` heads of each row (q's, then k's), at each row's own
    position; the rest of the row (v) untouched."""
    tokens, positions_total = 37, 4096
    qkv = bf16(tokens, (heads + 2) * dim, scale=2.0, seed=6)
    cos, sin = bf16(positions_total, dim, seed=7), bf16(positions_total, dim, seed=8)
    positions = torch.randint(0, positions_total, (tokens,), generator=torch.Generator().manual_seed(9))
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    half = dim // 2
    expected = qk * c + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * s
    ours = qkv.clone()
    native.rope(ours, heads, dim, cos, sin, positions)
    assert torch.equal(ours[:, : heads * dim], expected.reshape(tokens, -1))
    assert torch.equal(ours[:, heads * dim :], qkv[:, heads * dim :])


def test_the_element_wise_kernels_refuse_what_they_cannot_read() -> None:
    with pytest.raises(ValueError, match="bfloat16 rows"):
        native.silu_mul(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="weight"):
        native.add_rms_norm(bf16(2, 8), None, torch.ones(4, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="residual's shape"):
        native.add_rms_norm(bf16(2, 8), bf16(3, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)
    table = bf16(16, 8)
    with pytest.raises(ValueError, match="int64 position"):
        native.rope(bf16(2, 32), 2, 8, table, table, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="heads of"):
        native.rope(bf16(2, 32), 5, 8, table, table, torch.zeros(2, dtype=torch.int64))


def test_the_cpu_pass_fuses_a_bfloat16_models_element_wise_ops() -> None:
    """The normal path for the default model (bfloat16 on a CPU with AVX512-BF16, a C compiler
    at hand); a float32 model keeps torch's ops."""
    model = shapes.small_model("smollm2", CPU).to(torch.bfloat16)
    runner = ModelRunner(ModelSpec(Path("m")), EngineConfig(device="cpu", max_total_tokens=256), model=model)
    assert isinstance(runner.fast, LlamaFamilyCPU) and runner.fast.fused
    float32 = shapes.small_model("smollm2", CPU)
    runner = ModelRunner(ModelSpec(Path("m")), EngineConfig(device="cpu", max_total_tokens=256), model=float32)
    assert isinstance(runner.fast, LlamaFamilyCPU) and not runner.fast.fused
