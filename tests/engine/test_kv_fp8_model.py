"""``--kv-cache-dtype fp8_e4m3`` end to end: greedy tokens of each forward pass (the Triton one,
interpreted on the CPU; pdserve's CPU pass; the stock ``transformers`` code) against
``transformers`` whose every attention sees K and V rounded as the FP8 pool holds them
(keys rotated, :func:`quant.kv_key_rotation`, then :func:`kv_pool.round_fp8`: 16-token blocks
of a head from the first token, each at its scale so far, and rotated back), prompts in chunks over cached prefixes; the pool's
sizing and the refusals.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from pdserve.bench import shapes
from pdserve.engine import attention, quant
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv_pool import KV_FP8, page_bytes, round_fp8
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.models.llama_cpu import LlamaFamilyCPU
from pdserve.engine.quant import rotate_queries_keys
from tests.engine.kernel_env import DEVICE, llama
from tests.engine.reference import assert_greedy_equal, hf_greedy, run

NEW = 6


def rounded_kv(sdpa: Callable[..., Any]) -> Callable[..., Any]:
    """``sdpa`` over K and V rounded to FP8 as the pool holds them: the keys so far in blocks of
    a page's tokens per head, each block at the scale of its tokens so far (a block filled over
    several steps holds the bytes of one store of its tokens: its scale grew by powers of two)."""
    page = EngineConfig().page_size

    def attend(
        module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kw: Any
    ) -> Any:
        # [batch, heads, tokens, dim]; keys as the pool holds them, k @ H, read back as (k @ H) @ H / p
        h, p = quant.kv_key_rotation(key.shape[-1], key.dtype, key.device)
        rotated = rotate_queries_keys(None, key)[1]
        assert rotated is not None
        key = (round_fp8(rotated, page, 2) @ h) / p
        value = round_fp8(value, page, 2)
        return sdpa(module, query, key, value, *args, **kw)

    return attend


def engine_for(model: torch.nn.Module, forward: str, kv_cache_dtype: str = "fp8_e4m3") -> Engine:
    config = EngineConfig(
        device=str(DEVICE),
        max_total_tokens=1024,
        model_impl="transformers" if forward == "transformers" else "pdserve",
        chunked_prefill_size=16,
        cuda_graph_max_batch=0 if DEVICE.type == "cpu" else 8,
        kv_cache_dtype=kv_cache_dtype,
    )
    if forward == "transformers":
        model.set_attn_implementation(attention.register())
    runner = ModelRunner(ModelSpec(Path("m")), config, model=model, allow_interpreter=forward == "triton")
    assert runner.layout.dtype == (KV_FP8 if kv_cache_dtype == "fp8_e4m3" else "float32")
    expected = {"triton": llama.LlamaFamily, "cpu": LlamaFamilyCPU, "transformers": type(None)}[forward]
    assert isinstance(runner.fast, expected)
    return Engine(runner, config)


FORWARDS = [("triton", "qwen2"), ("triton", "smollm2-2l"), ("transformers", "llama")]
if DEVICE.type == "cpu":
    FORWARDS.append(("cpu", "llama"))


@pytest.mark.parametrize(("forward", "kind"), FORWARDS)
def test_fp8_kv_greedy_equals_transformers_over_fp8_rounded_kv(
    forward: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    quiet_transformers()
    model = shapes.small_model(kind, DEVICE)
    rng = random.Random(kind)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (4, 21, 40)]
    prompts.append(prompts[2][:32] + [7, 8])  # two cached pages of FP8 KV, read by another request
    # The cached prefix's request runs alone: batch-1 GEMV steps, seconds each interpreted at
    # the default model's width (576). Two tokens (one such step over the FP8 pages) as six.
    alone = 2 if (forward, kind) == ("triton", "smollm2-2l") else NEW
    engine = engine_for(model, forward)
    ours = run(engine, prompts[:3], NEW) + run(engine, prompts[3:], alone)
    assert engine.stats.cached_tokens >= 32
    engine.pages.check_invariants()
    model.set_attn_implementation("sdpa")  # the reference's (the stock path's engine set pdserve's)
    ids = torch.tensor([prompts[2] + ours[2]], device=DEVICE)
    with torch.inference_mode():
        plain_logits = model(ids).logits
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", rounded_kv(ALL_ATTENTION_FUNCTIONS["sdpa"]))
    expected = hf_greedy(model, prompts[:3], NEW) + hf_greedy(model, prompts[3:], alone)
    assert_greedy_equal(model, prompts, ours, expected)
    with torch.inference_mode():
        rounded_logits = model(ids).logits
    # the reference is not the model itself: FP8 KV moves the logits, a little
    error = (rounded_logits - plain_logits).abs().max().item()
    assert 1e-4 < error < 0.1 * plain_logits.abs().max().item(), error
    assert all(0 <= t < model.config.vocab_size for out in ours for t in out)


@pytest.mark.parametrize("n", [40, 64])
def test_a_whole_prompt_attends_over_its_fp8_rounded_kv_in_the_step_s_rows(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's whole-prompt attention over an FP8 pool (``sdpa_prefill``): k and v rounded as
    the pool holds them are written over the step's own (the pool already has them), so that a
    prompt at one of :func:`llama.sdpa_length`'s lengths attends in place, its q not copied;
    equal to the library's attention over the rounded k, v either way."""
    import torch.nn.functional as F

    from pdserve.engine.kernels import paged

    quiet_transformers()
    fast = engine_for(shapes.small_model("qwen2", DEVICE), "triton").runner.fast
    assert isinstance(fast, llama.LlamaFamily) and fast.kv_scales is not None
    nq, nkv, dim = fast.num_q, fast.num_kv, fast.head_dim
    gen = torch.Generator().manual_seed(n)
    qkv = (torch.randn(n, (nq + 2 * nkv) * dim, generator=gen) * 3).to(fast.embed.dtype).to(DEVICE)
    q = qkv[:, : nq * dim].view(n, nq, dim)
    k, v = paged.round_kv_fp8(qkv, nq * dim, nkv, dim, fast.pool.shape[4], fast.pool)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=fast.scale, enable_gqa=True,
    )  # fmt: skip
    read: list[int] = []
    library = F.scaled_dot_product_attention

    def spy(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        read.append(query.data_ptr())
        return library(query, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    got = fast._sdpa(qkv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, nq * dim :], torch.cat((k.reshape(n, -1), v.reshape(n, -1)), 1))  # written over
    in_place = read == [qkv.data_ptr()]
    assert in_place == (n == llama.sdpa_length(n))  # 64: a length's own; 40: padded into a copy


def test_the_pool_holds_more_pages_in_fp8() -> None:
    """The same bytes, more pages: the runner sizes the pool by FP8's bytes per page (values
    and a scale per block), about 4x a float32 pool's."""
    model = shapes.small_model("qwen2", torch.device("cpu"))
    pages = {}
    for dtype in ("auto", "fp8_e4m3"):
        config = EngineConfig(device="cpu", cpu_kv_bytes=8 << 20, model_impl="pdserve", kv_cache_dtype=dtype)
        runner = ModelRunner(ModelSpec(Path("m")), config, model=model, allow_interpreter=False)
        pages[dtype] = runner.num_pages
        assert runner.num_pages == (8 << 20) // page_bytes(runner.layout)
        assert runner.pool.nbytes == (runner.num_pages + 1) * runner.pool.page_bytes
    dim = model.config.hidden_size // model.config.num_attention_heads
    assert pages["fp8_e4m3"] / pages["auto"] == pytest.approx(4 * 16 * dim / (16 * dim + 4), rel=0.01)


def test_bf16_kv_beside_a_float32_model_is_refused_naming_the_flag() -> None:
    model = shapes.small_model("qwen2", torch.device("cpu"))
    config = EngineConfig(device="cpu", max_total_tokens=256, kv_cache_dtype="bf16")
    with pytest.raises(ValueError, match="--kv-cache-dtype bf16: the model runs in float32"):
        ModelRunner(ModelSpec(Path("m")), config, model=model, allow_interpreter=False)
    with pytest.raises(ValueError, match="kv_cache_dtype is one of auto, bf16, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
