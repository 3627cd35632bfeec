"""Down's input quantized in gate/up's epilogue (:mod:`pdserve.engine.kernels.fp8_act`): the
bits of the two-launch path's gate/up product, SiLU·up and per-block quantization, and down's
product over those blocks against float64. In Triton's interpreter on the CPU (tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import quant
from pdserve.engine.kernels import fp8, fp8_act
from tests.engine.kernel_env import DEVICE, elementwise


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "i", "k", "block_k"), [(3, 200, 96, 32), (17, 128, 64, 64)])
def test_gate_up_act_is_the_two_launch_path_bit_for_bit(
    rows: int, i: int, k: int, block_k: int, dtype: torch.dtype
) -> None:
    """A partial last block of columns (200 = 128 + 72), two row blocks (17 rows of 16), K in
    several tiles: the same FP8 bits and block scales as gate/up's product in bf16, then
    ``elementwise.silu_mul``, then ``quant.quantize_groups_fp8``; a row of zeros keeps the
    floor's scale."""
    x = torch.randn((rows, k), device=DEVICE) * 2
    x[rows // 2] = 0
    # (gate within the interpreter's exp: its float32 overflow is an error there)
    w = quant.quantize_fp8(torch.randn((2 * i, k), device=DEVICE) * torch.rand((2 * i, 1), device=DEVICE) * 0.3)
    xq, xs = fp8.quantize_rows(x)
    q, scale = fp8_act.gate_up_act(xq, xs, w, block_m=16, block_k=block_k, act_dtype=dtype)
    gate_up = fp8.matmul(xq, w, None, xs, dtype, block_m=16, block_n=quant.GROUP, block_k=block_k)
    q_ref, scale_ref = quant.quantize_groups_fp8(elementwise.silu_mul(gate_up))
    assert q.shape == (rows, i) and scale.shape == (rows, -(-i // quant.GROUP))
    assert torch.equal(scale, scale_ref)
    assert same_bits(q, q_ref)
    assert (q[rows // 2].float() == 0).all() and (scale[rows // 2] > 0).all()
    empty_q, empty_s = fp8_act.gate_up_act(xq[:0], xs[:0], w)
    assert empty_q.shape == (0, i) and empty_s.shape == (0, scale.shape[1])


@pytest.mark.parametrize(("rows", "n", "k", "block_k"), [(3, 40, 256, 128), (17, 33, 200, 64)])
def test_matmul_over_blocks_of_x_matches_float64(rows: int, n: int, k: int, block_k: int) -> None:
    """W8A8 over rows quantized a scale per ``block_k`` columns (a last block short of it),
    split along K or not, against float64 over the same FP8 values and scales."""
    x = torch.randn((rows, k), device=DEVICE) * torch.logspace(-2, 2, k, device=DEVICE)[None, :]
    w = quant.quantize_fp8(torch.randn((n, k), device=DEVICE))
    b = torch.randn(n, device=DEVICE)
    xq, xs = quant.quantize_groups_fp8(x, block_k)
    x64 = xq.double() * xs.double().repeat_interleave(block_k, dim=1)[:, :k]
    ref = x64 @ w.dequantize(torch.float64).T + b.double()
    tol = 2e-5 if DEVICE.type == "cpu" else 1e-3
    for split in (1, 2):
        out = fp8.matmul(
            xq, w, b, None, torch.float32, block_m=16, block_n=16, block_k=block_k, split_k=split, x_group_scale=xs
        )
        assert out.shape == (rows, n) and rel_err(out, ref) < tol, split
    with pytest.raises(AssertionError, match="a scale per row per block_k columns"):
        fp8.matmul(xq, w, b, None, torch.float32, block_k=block_k * 2, x_group_scale=xs)


def test_the_fused_mlp_is_the_per_row_path_within_the_rounding() -> None:
    """gate/up's blocks then down over them against the two-launch path (gate/up in bf16,
    SiLU·up quantized a scale per row, down): both near float64 over the unquantized SiLU·up,
    the blocks (each rounded to its own range) no further from it."""
    rows, i, k, n = 5, 256, 64, 48
    x = torch.randn((rows, k), device=DEVICE)
    w_gu = quant.quantize_fp8(torch.randn((2 * i, k), device=DEVICE) * 0.3)
    # columns of very different scales within a row: a row's one scale rounds its small ones coarsely
    w_down = quant.quantize_fp8(torch.randn((n, i), device=DEVICE))
    xq, xs = fp8.quantize_rows(x)
    gate_up = fp8.matmul(xq, w_gu, None, xs, torch.bfloat16, block_m=16, block_n=64, block_k=64)
    gate_up[:, :128] *= 1e-2  # (one block of gate small: silu·up small there)
    act = elementwise.silu_mul(gate_up)
    exact = act.double() @ w_down.dequantize(torch.float64).T
    per_row = fp8.linear(gate_up, w_down, silu_mul_input=True, gemv_max_rows=0)
    aq, as_ = quant.quantize_groups_fp8(act)
    blocks = fp8.matmul(
        aq, w_down, None, None, torch.bfloat16, block_m=16, block_n=16, block_k=quant.GROUP, x_group_scale=as_
    )
    assert rel_err(blocks, exact) < 0.05 and rel_err(per_row, exact) < 0.05
    assert rel_err(blocks, exact) <= rel_err(per_row, exact) * 1.05
