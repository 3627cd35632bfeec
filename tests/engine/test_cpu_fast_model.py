"""pdserve's CPU forward pass (torch ops, no Triton) against ``transformers``.

In float32 greedy output must equal ``generate``'s token for token (near ties aside,
``tests/engine/reference.py``), and in bfloat16 ``generate``'s in bfloat16 (ties within a
few roundings): prompts in small chunks over a cached or earlier prefix, decodes batched
beside prefill chunks, decodes of very different lengths grouped.
"""

from __future__ import annotations

import functools
import logging
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.bench import shapes
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.models.batch import StepBatch, build_step
from pdserve.engine.models.cpu_plan import MATMUL_MIN_BATCH, can_pack, length_groups, page_rows
from pdserve.engine.models.llama_cpu import LlamaFamilyCPU
from pdserve.schemas import SamplingParams
from tests.engine.reference import assert_greedy_equal, hf_greedy, run

NEW = 6
CPU = torch.device("cpu")


def cpu_engine(model: torch.nn.Module, **knobs: object) -> Engine:
    config = EngineConfig(device="cpu", max_total_tokens=2048, model_impl="pdserve", **knobs)  # type: ignore[arg-type]
    runner = ModelRunner(ModelSpec(Path("m")), config, model=model, allow_interpreter=False)
    assert runner.model_impl == "pdserve" and isinstance(runner.fast, LlamaFamilyCPU)
    return Engine(runner, config)


@functools.cache
def model_and_reference(kind: str, dtype: torch.dtype) -> tuple[torch.nn.Module, list[list[int]], list[list[int]]]:
    """A model of ``kind`` in ``dtype``, its prompts (the last over a cached prefix of two full
    pages) and ``generate``'s greedy tokens for them: made once for both chunk sizes (each
    engine over the model shares its weights, as engines do)."""
    quiet_transformers()
    model = shapes.small_model(kind, CPU).to(dtype)
    rng = random.Random(kind)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 23, 40, 70)]
    prompts.append(prompts[2][:32] + [1, 2, 3])
    return model, prompts, hf_greedy(model, prompts, NEW)


# smollm2: the default model's shapes (30 layers, 9 heads over 3 KV heads of 64, tied)
@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "llama3-rope", "smollm2"])
@pytest.mark.parametrize("chunk", [16, 2048])
def test_cpu_pass_greedy_equals_transformers(kind: str, chunk: int) -> None:
    model, prompts, expected = model_and_reference(kind, torch.float32)
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
    model, prompts, expected = model_and_reference(kind, torch.bfloat16)
    engine = cpu_engine(model, chunked_prefill_size=chunk)
    assert engine.runner.pool.tensor.dtype == torch.bfloat16
    ours = run(engine, prompts[:4], NEW) + run(engine, prompts[4:], NEW)
    assert_greedy_equal(model, prompts, ours, expected)


@pytest.mark.parametrize(
    ("dtype", "attention"), [(torch.float32, "auto"), (torch.bfloat16, "native"), (torch.bfloat16, "torch")]
)
@pytest.mark.parametrize("lengths", [(3, 90, 17, 33, 8, 64, 16, 49), (3, 90, 17, 33, 8, 64, 16, 49, 200, 5, 180)])
def test_cpu_pass_batched_decodes_of_different_lengths(
    lengths: tuple[int, ...], dtype: torch.dtype, attention: str
) -> None:
    """Sequences of 3 to 200 tokens decode together: through torch ops one padded, masked
    gather, or (eleven of them) two groups by length, in bfloat16 groups of eight and more
    as two matmuls; through the native kernel each row over its own pages."""
    if dtype == torch.bfloat16 and not can_pack(dtype):
        pytest.skip("no bfloat16 matmuls in this torch's oneDNN")
    quiet_transformers()
    model = shapes.small_model("llama", CPU).to(dtype)
    rng = random.Random(8)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in lengths]
    expected = hf_greedy(model, prompts, 12)
    engine = cpu_engine(model, cpu_attention=attention)
    fast = engine.runner.fast
    assert isinstance(fast, LlamaFamilyCPU) and fast.native == (attention == "native")
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
    assert runner.fast.decode_matmuls == (dtype == torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The Roman Empire was one of the largest empires in history. It", "def fibonacci(n):\n", "中国的首都是"]
    # eight at once: in bfloat16 the decodes attend as two matmuls (MATMUL_MIN_BATCH)
    texts += ["Water boils at", "The capital of France is", "1, 2, 3, 4,", "Dear team,", "import numpy as np\n"]
    prompts = [tokenizer.encode(t) for t in texts]
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=dtype).eval()
    expected = hf_greedy(reference, prompts, 24, batched=True)
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


def decode_step_of(engine: Engine, prompts: list[list[int]]) -> StepBatch:
    """The engine's first step that decodes every prompt (and nothing else), packed."""
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while True:
        batch = engine.schedule()
        if len(batch.decodes) == len(prompts) and not batch.prefills:
            return build_step(batch, engine.config.page_size, CPU, 2)[0]
        engine.postprocess(batch, engine.execute(batch))


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="no bfloat16 matmuls in this torch's oneDNN")
def test_bfloat16_decodes_read_pages_a_layer_at_a_time_and_round_as_stock_sdpa() -> None:
    """A bfloat16 pool is gathered a page's layer at a time (K and V of every head in one row,
    then put in order by the cast): the same K and V as gathering each head's block. Decode
    attention over them (two matmuls, the probabilities rounded to bfloat16) stays within
    twice the error against float64 of torch's bfloat16 SDPA kernel, which the stock code
    runs, on the same inputs (it rounds the probabilities before normalizing them, we after:
    at most one more rounding of the output); padding is masked (5 to 130 tokens in a group)."""
    quiet_transformers()
    model = shapes.small_model("smollm2", CPU).to(torch.bfloat16)
    engine = cpu_engine(model, cpu_attention="torch")
    fast = engine.runner.fast
    assert isinstance(fast, LlamaFamilyCPU) and fast.blocks and fast.decode_matmuls and not fast.native
    rng = random.Random(3)
    sizes = (130, 5, 40, 70, 17, 33, 90, 64)  # MATMUL_MIN_BATCH of them: one group
    step = decode_step_of(engine, [[rng.randrange(300) for _ in range(n)] for n in sizes])
    plan = fast.plan(step)
    (group,) = plan.groups
    batch, heads, dim = len(sizes), fast.num_kv, fast.head_dim
    assert batch == MATMUL_MIN_BATCH
    assert group.gather is not None
    for index in (0, len(fast.layers) - 1):
        k, v = fast._gather(group.gather[index], batch, group.pages, torch.bfloat16)
        k, v = k.clone(), v.clone()
        assert k.dtype == torch.float32 and v.dtype == torch.bfloat16
        fast.blocks = False  # each head's K or V block a row, in order already
        tables = step.decode_tables[:, : group.pages]
        k_heads, v_heads = fast._gather(page_rows(fast.pool, tables, False)[index], batch, group.pages)
        fast.blocks = True
        assert torch.equal(k, k_heads) and torch.equal(v.float(), v_heads)
        assert k.abs().amax() > 0 and v.abs().amax() > 0

        q = torch.randn(batch, fast.num_q * dim).to(torch.bfloat16)
        ours = fast._decode(index, fast.layers[index], q, group, plan)
        assert ours.dtype == torch.bfloat16
        mask = fast._decode_mask(group, k.shape[2], None)
        assert mask is not None
        qg = q.view(batch, heads, -1, dim)
        exact = F.scaled_dot_product_attention(
            qg.double(), k.double(), v.double(), attn_mask=mask.double(), scale=fast.scale
        ).view(batch, -1)
        stock = F.scaled_dot_product_attention(
            qg, k.to(torch.bfloat16), v, attn_mask=mask.to(torch.bfloat16), scale=fast.scale
        ).view(batch, -1)
        ours_error, stock_error = ((o.double() - exact).abs() for o in (ours, stock))
        assert ours_error.max() <= 2 * stock_error.max() and ours_error.mean() <= 1.5 * stock_error.mean()
        ours_error = ours_error.max().item()
        # each sequence attends to its own tokens only (its context: its prompt and one token)
        lens = step.decode_ctx_lens.tolist()
        assert sorted(lens) == sorted(n + 1 for n in sizes)
        for row, n in enumerate(lens):
            alone = F.scaled_dot_product_attention(
                qg[row : row + 1].double(),
                k[row : row + 1, :, :n].double(),
                v[row : row + 1, :, :n].double(),
                scale=fast.scale,
            ).view(1, -1)
            assert (ours[row : row + 1].double() - alone).abs().max().item() <= ours_error + 1e-12
