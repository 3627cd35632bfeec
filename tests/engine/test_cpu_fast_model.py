"""pdserve's CPU forward pass (torch ops, no Triton) against ``transformers``.

Float32 throughout, so greedy output must equal ``generate`` token for token (near ties
aside, ``tests/engine/reference.py``): prompts in small chunks over a cached or earlier
prefix, decodes batched beside prefill chunks.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from pdserve.bench import shapes
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.models.llama_cpu import LlamaFamilyCPU
from tests.engine.reference import assert_greedy_equal, hf_greedy, run

NEW = 6
CPU = torch.device("cpu")


def cpu_engine(model: torch.nn.Module, **knobs: object) -> Engine:
    config = EngineConfig(device="cpu", max_total_tokens=2048, model_impl="pdserve", **knobs)  # type: ignore[arg-type]
    runner = ModelRunner(ModelSpec(Path("m")), config, model=model, allow_interpreter=False)
    assert runner.model_impl == "pdserve" and isinstance(runner.fast, LlamaFamilyCPU)
    return Engine(runner, config)


# smollm2: the default model's shapes (30 layers, 9 heads over 3 KV heads of 64, tied)
@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "llama3-rope", "smollm2"])
@pytest.mark.parametrize("chunk", [16, 2048])
def test_cpu_pass_greedy_equals_transformers(kind: str, chunk: int) -> None:
    quiet_transformers()
    model = shapes.small_model(kind, CPU)
    rng = random.Random(kind)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 23, 40, 70)]
    prompts.append(prompts[2][:32] + [1, 2, 3])  # a cached prefix of two full pages
    expected = hf_greedy(model, prompts, NEW)
    # chunk 16: prompts computed in pieces over a cached or earlier prefix, beside decodes
    engine = cpu_engine(model, chunked_prefill_size=chunk)
    assert not engine.overlap
    ours = run(engine, prompts[:4], NEW) + run(engine, prompts[4:], NEW)
    assert_greedy_equal(model, prompts, ours, expected)
    assert engine.stats.cached_tokens >= 32
    engine.pages.check_invariants()
    # the stock modules still work on views of the fused weights
    assert hf_greedy(model, prompts[:1], NEW) == expected[:1]


def test_cpu_pass_batched_decodes_of_different_lengths() -> None:
    """Eight sequences of 3 to 90 tokens decode together (one padded, masked gather)."""
    quiet_transformers()
    model = shapes.small_model("llama", CPU)
    rng = random.Random(8)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (3, 90, 17, 33, 8, 64, 16, 49)]
    expected = hf_greedy(model, prompts, 12)
    engine = cpu_engine(model)
    assert_greedy_equal(model, prompts, run(engine, prompts, 12), expected)


def test_the_cpu_pass_is_chosen_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    model = shapes.small_model("qwen2", CPU)
    config = EngineConfig(device="cpu", max_total_tokens=256, model_impl="pdserve")
    with caplog.at_level(logging.INFO, logger="pdserve.engine.model_runner"):
        runner = ModelRunner(ModelSpec(Path("m")), config, model=model, allow_interpreter=False)
    assert isinstance(runner.fast, LlamaFamilyCPU)
    chosen = [r for r in caplog.records if r.getMessage() == "pdserve forward pass"]
    assert len(chosen) == 1 and chosen[0].__dict__["pass"] == "LlamaFamilyCPU"
