"""Fast forward passes, chosen per architecture; every other model runs the stock
``transformers`` code with pdserve's paged attention plugged in.

:func:`fast_path_reason` says whether the fast path can serve a loaded model (and why
not); :func:`create_fast_model` builds it. On a CUDA device it is :class:`.llama.LlamaFamily`
(Triton kernels, CUDA graphs); on a CPU :class:`.llama_cpu.LlamaFamilyCPU` (torch ops, no
Triton), or, when a test asks, the Triton pass under Triton's interpreter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.engine.models.llama import LlamaFamily
    from pdserve.engine.models.llama_cpu import LlamaFamilyCPU
    from pdserve.engine.parallel import TPGroup


def uses_triton(device: torch.device, allow_interpreter: bool = False) -> bool:
    """Whether the fast path on ``device`` is the Triton one: on CUDA, or on a CPU under
    Triton's interpreter when ``allow_interpreter`` (a test asked for the Triton kernels)."""
    from pdserve.engine import kernels

    return device.type == "cuda" or (allow_interpreter and kernels.interpreting())


def fast_path_reason(model: torch.nn.Module, device: torch.device, allow_interpreter: bool = False) -> str | None:
    """Why ``model`` on ``device`` cannot take the fast path, or ``None`` if it can."""
    from pdserve.engine import kernels
    from pdserve.engine.models.llama_weights import unsupported_reason

    if device.type not in ("cuda", "cpu"):
        return f"the fast path runs on CUDA devices and CPUs, not {device.type}"
    if uses_triton(device, allow_interpreter) and not kernels.available():
        return "Triton is not installed"
    return unsupported_reason(model)


# FP8 weights need Ada or Hopper: Triton's float8_e4m3 conversions and torch._scaled_mm.
FP8_MIN_CAPABILITY = (8, 9)


def fp8_reason(
    model: torch.nn.Module, device: torch.device, model_impl: str, allow_interpreter: bool = False
) -> str | None:
    """Why ``--quantization fp8`` cannot serve ``model`` on ``device``, or ``None`` if it can:
    its matmuls are in pdserve's Triton pass alone (never a silent fallback to 16 bits)."""
    if model_impl == "transformers":
        return "it runs on pdserve's own forward pass; model_impl 'transformers' (the stock code) has no FP8 matmuls"
    reason = fast_path_reason(model, device, allow_interpreter)
    if reason is not None:
        return f"it runs on pdserve's own forward pass, which cannot serve this model: {reason}"
    if not uses_triton(device, allow_interpreter):
        return "pdserve's CPU pass has no FP8 matmuls (FP8 weights run on a GPU of compute capability 8.9 or above)"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            return (
                f"{name} has compute capability {capability[0]}.{capability[1]}; FP8 matmuls need 8.9 or above "
                "(Ada, Hopper and later)"
            )
    return None


def create_fast_model(
    model: torch.nn.Module,
    pool: torch.Tensor,
    max_positions: int,
    tp: TPGroup | None = None,
    allow_interpreter: bool = False,
    kv_scales: torch.Tensor | None = None,
    cpu_attention: str = "auto",
) -> LlamaFamily | LlamaFamilyCPU:
    """The fast forward pass for ``model`` over ``pool`` (check :func:`fast_path_reason`
    first); ``tp``: ``model`` is this rank's shard, and the pass all-reduces across ``tp``.
    ``kv_scales``: ``pool`` is an FP8 pool's values and these its scales."""
    if uses_triton(pool.device, allow_interpreter):
        from pdserve.engine.models.llama import LlamaFamily

        return LlamaFamily(model, pool, max_positions, tp, kv_scales)
    from pdserve.engine.models.llama_cpu import LlamaFamilyCPU

    return LlamaFamilyCPU(model, pool, max_positions, tp, kv_scales, cpu_attention)
