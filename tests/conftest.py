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
    """With no GPU, Triton kernels run in Triton's interpreter: it must be on before
    anything imports Triton (its own library functions are decorated at import), and it
    is kept in Triton's settings rather than the environment, so that worker processes
    the tests start do not inherit it. Triton 3.6's interpreter also turns scalars into
    ints with ``int(array)``, which NumPy 2.4 refuses for one-element arrays."""
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is None or torch.cuda.is_available() or "triton" in sys.modules:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
        from triton.runtime import interpreter
    finally:
        del os.environ["TRITON_INTERPRET"]
    triton.knobs.runtime.interpret = True
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


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
