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


# The built-in model's LM head is its embedding scaled, so its greedy output mostly repeats
# the last token whatever the context: a test of moved or split KV learns little from it.
MIXING_SCALE = 4.0


@pytest.fixture(scope="session")
def mixing_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (2 KV heads, 4 query heads) with every decoder layer's projections
    scaled by :data:`MIXING_SCALE`: attention and MLP then dominate the residual stream, so
    each greedy token depends on the KV of the whole context (the outputs vary)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("mixing") / "pdserve-tiny-mixing"
    shutil.copytree(tiny_model_dir, out)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (
                attn.q_proj,
                attn.k_proj,
                attn.v_proj,
                attn.o_proj,
                mlp.gate_proj,
                mlp.up_proj,
                mlp.down_proj,
            ):
                linear.weight.mul_(MIXING_SCALE)
    model.save_pretrained(out, safe_serialization=True)
    return out
