"""The Triton kernels for a test: compiled on a GPU, interpreted on the CPU (the
interpreter is switched on in ``tests/conftest.py``, before anything imports Triton)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

from pdserve.engine.kernels import elementwise, gemv, paged, paged_prefill, rope  # noqa: E402
from pdserve.engine.models import llama  # noqa: E402

__all__ = ["DEVICE", "elementwise", "gemv", "llama", "paged", "paged_prefill", "rope"]
