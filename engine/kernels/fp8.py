"""Linear layers over FP8 weights (:class:`pdserve.engine.quant.Fp8Weight`).

Up to ``GEMV_MAX_ROWS`` rows of input (decode), the product is bound by reading the
weights: the GEMV kernel reads the FP8 weights in place, converts them in registers and
applies each output channel's scale to the sum (activations stay in bf16: W8A16). Above
that (prefill), the tensor cores' FP8 rate pays: activations are quantized per token and
``torch._scaled_mm`` multiplies with row-wise scales (W8A8).
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels import elementwise, gemv
from pdserve.engine.quant import FP8, FP8_MAX, Fp8Weight

# Above this many rows the W8A8 library GEMM beats the GEMV kernel (bench/probes/fp8_probe.py).
GEMV_MAX_ROWS = 64
# Output channels per program that leave at least two programs per SM without cutting along K.
_SMS = 132


def gemv_tiles(rows: int, n: int, k: int) -> dict[str, int]:
    """Tiles of the FP8 GEMV for ``rows`` of input against an ``[n, k]`` weight."""
    if rows < gemv.DOT_FROM_ROWS:
        tiles = {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 3}
    else:
        tiles = {"block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 3}
    programs = -(-n // tiles["block_n"])
    split = 1
    while programs * split < 2 * _SMS and split < 8 and k // (split * 2) >= tiles["block_k"]:
        split *= 2
    tiles["split_k"] = split
    return tiles


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as FP8 with one float32 scale per row (``[M, 1]``)."""
    amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32).clamp_min(1e-12)
    scale = amax / FP8_MAX
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def linear(
    x: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None = None,
    silu_mul_input: bool = False,
    gemv_max_rows: int = GEMV_MAX_ROWS,
) -> torch.Tensor:
    """``x @ (w.q * w.scale).T + bias`` in ``x``'s dtype (``x`` read as ``silu(gate) * up``
    with ``silu_mul_input``: ``[M, 2K]``)."""
    rows = x.shape[0]
    n, k = w.shape
    if 0 < rows <= gemv_max_rows:
        return gemv.gemv(x, w.q, bias, silu_mul_input, scale=w.scale, **gemv_tiles(rows, n, k))  # type: ignore[arg-type]
    if silu_mul_input:
        x = elementwise.silu_mul(x)
    xq, x_scale = quantize_rows(x)
    out = torch._scaled_mm(xq, w.q.t(), scale_a=x_scale, scale_b=w.scale[None, :], out_dtype=x.dtype)
    return out if bias is None else out + bias
