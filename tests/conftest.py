"""Shared fixtures: a real nats-server per test, the tiny model built once per session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _interpret_triton_on_the_cpu() -> None:
    """With no GPU, Triton kernels run in Triton's interpreter (worker processes that the
    tests start do not inherit it)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is None or torch.cuda.is_available() or "triton" in sys.modules:
        return
    from pdserve.engine.kernels import use_interpreter

    use_interpreter()


_interpret_triton_on_the_cpu()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[object]:
    """A fresh ``nats-server -js`` on a free loopback port with its own store."""
    from pdserve.broker.server import start_nats_server

    server = start_nats_server(tmp_path / "nats")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default random-weight Qwen2 model (5.4M parameters), built once."""
    from pdserve.engine.tiny_model import ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("data"))
