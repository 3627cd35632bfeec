"""Fast forward passes, chosen per architecture; every other model runs the stock
``transformers`` code with pdserve's paged attention plugged in.

:func:`fast_path_reason` says whether the fast path can serve a loaded model (and why
not); :func:`create_fast_model` builds it. The fast path needs Triton, so it runs where
Triton does: on a CUDA device, or under Triton's interpreter in the CPU tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.engine.models.llama import LlamaFamily
    from pdserve.engine.parallel import TPGroup


def fast_path_reason(model: torch.nn.Module, device: torch.device, allow_interpreter: bool = False) -> str | None:
    """Why ``model`` on ``device`` cannot take the fast path, or ``None`` if it can.

    On a CPU it can only under Triton's interpreter, and only when ``allow_interpreter``
    (a test asked for it): the interpreter is far too slow to serve.
    """
    from pdserve.engine import kernels

    if device.type != "cuda" and not (allow_interpreter and kernels.interpreting()):
        return f"the fast path runs on CUDA devices, not {device.type}"
    if not kernels.available():
        return "Triton is not installed"
    from pdserve.engine.models.llama import unsupported_reason

    return unsupported_reason(model)


def create_fast_model(
    model: torch.nn.Module, pool: torch.Tensor, max_positions: int, tp: TPGroup | None = None
) -> LlamaFamily:
    """The fast forward pass for ``model`` over ``pool`` (check :func:`fast_path_reason`
    first); ``tp``: ``model`` is this rank's shard, and the pass all-reduces across ``tp``."""
    from pdserve.engine.models.llama import LlamaFamily

    return LlamaFamily(model, pool, max_positions, tp)
