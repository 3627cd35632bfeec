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


def create_fast_model(
    model: torch.nn.Module,
    pool: torch.Tensor,
    max_positions: int,
    tp: TPGroup | None = None,
    allow_interpreter: bool = False,
) -> LlamaFamily | LlamaFamilyCPU:
    """The fast forward pass for ``model`` over ``pool`` (check :func:`fast_path_reason`
    first); ``tp``: ``model`` is this rank's shard, and the pass all-reduces across ``tp``."""
    if uses_triton(pool.device, allow_interpreter):
        from pdserve.engine.models.llama import LlamaFamily

        return LlamaFamily(model, pool, max_positions, tp)
    from pdserve.engine.models.llama_cpu import LlamaFamilyCPU

    return LlamaFamilyCPU(model, pool, max_positions, tp)
