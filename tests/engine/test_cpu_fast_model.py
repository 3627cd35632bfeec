"""pdserve's CPU forward pass (torch ops, no Triton) against ``transformers``.

In float32 greedy output must equal ``generate``'s token for token (near ties aside,
``tests/engine/reference.py``), and in bfloat16 ``generate``'s in bfloat16 (ties within a
few roundings): prompts in small chunks over a cached or earlier prefix, decodes batched
beside prefill chunks, decodes of very different lengths grouped.
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
from pdserve.engine.models.llama_cpu import LlamaFamilyCPU, can_pack, length_groups
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


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="no bfloat16 matmuls in this torch's oneDNN")
@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "smollm2"])
@pytest.mark.parametrize("chunk", [16, 2048])
def test_cpu_pass_in_bfloat16_equals_transformers_in_bfloat16(kind: str, chunk: int) -> None:
    quiet_transformers()
    model = shapes.small_model(kind, CPU).to(torch.bfloat16)
    rng = random.Random(kind)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 23, 40, 70)]
    prompts.append(prompts[2][:32] + [1, 2, 3])
    expected = hf_greedy(model, prompts, NEW)
    engine = cpu_engine(model, chunked_prefill_size=chunk)
    assert engine.runner.pool.tensor.dtype == torch.bfloat16
    ours = run(engine, prompts[:4], NEW) + run(engine, prompts[4:], NEW)
    assert_greedy_equal(model, prompts, ours, expected)


@pytest.mark.parametrize("lengths", [(3, 90, 17, 33, 8, 64, 16, 49), (3, 90, 17, 33, 8, 64, 16, 49, 200, 5, 180)])
def test_cpu_pass_batched_decodes_of_different_lengths(lengths: tuple[int, ...]) -> None:
    """Sequences of 3 to 200 tokens decode together: one padded, masked gather, or (eleven of
    them) two groups by length."""
    quiet_transformers()
    model = shapes.small_model("llama", CPU)
    rng = random.Random(8)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in lengths]
    expected = hf_greedy(model, prompts, 12)
    engine = cpu_engine(model)
    assert_greedy_equal(model, prompts, run(engine, prompts, 12), expected)


def test_decodes_group_by_length_at_most_twice_padded_beyond_eight() -> None:
    assert length_groups([5, 300, 40], 16) == [[1, 2, 0]]  # fewer than eight: one group
    lens = [1000, 990, 900, 800, 700, 600, 520, 510, 500, 260, 20, 16]
    assert length_groups(lens, 16) == [[0, 1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    assert length_groups([], 16) == []


@pytest.mark.slow
def test_the_default_model_as_auto_serves_it_equals_transformers_in_its_dtype(smollm2_dir: Path) -> None:
    """SmolLM2 under ``--dtype auto`` and ``--model-impl auto`` (bfloat16 on a CPU with native
    bfloat16, else float32; pdserve's pass) against ``generate`` in the same dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    config = EngineConfig(device="cpu", max_total_tokens=4096)
    runner = ModelRunner(ModelSpec(smollm2_dir), config, allow_interpreter=False)
    assert isinstance(runner.fast, LlamaFamilyCPU)
    dtype = runner.pool.tensor.dtype
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The Roman Empire was one of the largest empires in history. It", "def fibonacci(n):\n", "中国的首都是"]
    prompts = [tokenizer.encode(t) for t in texts]
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=dtype).eval()
    expected = hf_greedy(reference, prompts, 24)
    assert_greedy_equal(reference, prompts, run(Engine(runner, config), prompts, 24), expected)


def test_the_cpu_pass_is_chosen_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """``auto`` takes it on a CPU (a Llama-family model); ``transformers`` still forces the stock code."""
    model = shapes.small_model("qwen2", CPU)
    for impl in ("pdserve", "auto"):
        config = EngineConfig(device="cpu", max_total_tokens=256, model_impl=impl)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pdserve.engine.model_runner"):
            runner = ModelRunner(ModelSpec(Path("m")), config, model=model, allow_interpreter=False)
        assert isinstance(runner.fast, LlamaFamilyCPU)
        chosen = [r for r in caplog.records if r.getMessage() == "pdserve forward pass"]
        assert len(chosen) == 1 and chosen[0].__dict__["pass"] == "LlamaFamilyCPU"
    config = EngineConfig(device="cpu", max_total_tokens=256, model_impl="transformers")
    runner = ModelRunner(ModelSpec(Path("m")), config, model=shapes.small_model("qwen2", CPU))
    assert runner.fast is None and runner.model_impl == "transformers"
