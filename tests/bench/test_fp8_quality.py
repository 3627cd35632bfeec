"""``bench/fp8_quality.py`` on the tiny random-weight model: the FP8 simulations round what
they should and nothing else, the chunked cache reads as one pass, the JSON has its fields."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pdserve.engine.kv_pool import round_fp8
from pdserve.engine.quant import (
    kv_key_rotation,
    quantize_fp8,
    quantize_groups_fp8,
    quantize_rows_fp8,
)


@pytest.fixture(scope="module")
def fq() -> ModuleType:
    return importlib.import_module("fp8_quality")


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_fp8_linear_is_the_kernels_arithmetic_and_keep_matches_whole_name_parts(
    fq: ModuleType, model: torch.nn.Module
) -> None:
    linear = torch.nn.Linear(256, 8, bias=True)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    x[0, 1, 200] = 40.0  # an outlier: its row's scale, and only its group's with "group"
    w = quantize_fp8(linear.weight)
    bias = linear.bias.detach()
    a16 = (x.float() @ w.q.float().T * w.scale + bias).to(torch.bfloat16)
    assert torch.equal(fq.Fp8Linear(linear, "none")(x), a16), "W8A16: the batch-1 GEMV"
    q, scale = quantize_rows_fp8(x.reshape(6, 256))
    rows = (q.float() * scale[:, None]).view(2, 3, 256)
    w8a8 = (rows @ w.q.float().T * w.scale + bias).to(torch.bfloat16)
    assert torch.equal(fq.Fp8Linear(linear)(x), w8a8), "W8A8 with a scale per row is the default"
    assert not torch.equal(w8a8, a16)
    qg, scales = quantize_groups_fp8(x.reshape(6, 256), 128)
    assert scales.shape == (6, 2)
    groups = (qg.float().view(6, 2, 128) * scales[:, :, None]).view(2, 3, 256)
    assert torch.equal(fq.Fp8Linear(linear, "group")(x), (groups @ w.q.float().T * w.scale + bias).to(torch.bfloat16))
    with pytest.raises(ValueError, match="activations"):
        fq.Fp8Linear(linear, "int8")

    layers = len(model.model.layers)
    every = fq.build_variants(model, ["bf16"])["bf16"][0]
    assert fq.quantize_weights(every) == 7 * layers, "q k v o gate up down in each layer"
    some = fq.build_variants(model, ["bf16"])["bf16"][0]
    assert fq.quantize_weights(some, ["0", "down_proj"]) == 7 * layers - 7 - (layers - 1)
    first, second = some.model.layers[0].mlp, some.model.layers[1].mlp
    assert type(first.up_proj) is torch.nn.Linear and type(second.down_proj) is torch.nn.Linear
    assert isinstance(second.up_proj, fq.Fp8Linear) and type(some.lm_head) is torch.nn.Linear
    assert next(model.parameters()).dtype == torch.float32, "the model measured is copied, not changed"
    # "a16:NAMES": those projections read their inputs as they are, the others round them per row
    parts = fq.build_variants(model, ["bf16"])["bf16"][0]
    assert fq.quantize_weights(parts, activations="a16:gate_proj,up_proj") == 7 * layers
    mlp, attn = parts.model.layers[1].mlp, parts.model.layers[1].self_attn
    assert mlp.gate_proj.activations == mlp.up_proj.activations == "none"
    assert mlp.down_proj.activations == attn.q_proj.activations == attn.o_proj.activations == "token"


def test_fp8_kv_cache_stores_the_rounded_keys_and_values_only_where_asked(
    fq: ModuleType, model: torch.nn.Module
) -> None:
    """Two updates (5 tokens, then 3) into 4-token pages: each read is the K/V so far as the
    pool holds them, blocks of a page's tokens per head at the scale of their largest (values
    within a factor 2 of their token's size: normal in e4m3 at every scale a block takes, so the
    stores in two steps equal one store of them all)."""
    g = torch.Generator().manual_seed(0)

    def kv() -> torch.Tensor:
        sizes = torch.tensor([1.0, 40, 0.5, 3, 300, 1, 8, 2])[:, None]
        return (
            (torch.randint(0, 2, (1, 2, 8, 16), generator=g) * 2 - 1)
            * (1 + torch.rand(1, 2, 8, 16, generator=g))
            * sizes
        )

    k, v = kv(), kv()
    h, p = kv_key_rotation(16, torch.float32, torch.device("cpu"))
    rotated_k = (round_fp8(k @ h, 4, 2) @ h) / p  # keys stored rotated, read back
    for fp8 in ("kv", "k", ""):
        cache = fq.Fp8KVCache(model.config, fp8, page_size=4)
        cache.update(k[:, :, :5], v[:, :, :5], 0)
        keys, values = cache.update(k[:, :, 5:], v[:, :, 5:], 0)
        want_v = round_fp8(v, 4, 2) if "v" in fp8 else v
        assert torch.equal(values, want_v), fp8
        if "k" in fp8:  # rotated keys are not all within a factor 2: a subnormal may round apart
            assert torch.allclose(keys, rotated_k, rtol=0, atol=1e-3) and not torch.equal(keys, k)
        else:
            assert torch.equal(keys, k)
    assert not torch.equal(round_fp8(v, 4, 2), v)
    assert isinstance(fq.Fp8KVCache(model.config), DynamicCache)


def test_evaluate_measures_each_variant_against_bf16_and_chunks_do_not_change_it(
    fq: ModuleType, model: torch.nn.Module, tiny_model_dir: Path
) -> None:
    tokens = fq.load_tokens(tiny_model_dir, 96)
    names = ["bf16", "float32", "fp8_weights", "fp8_weights_a16", "fp8_kv", "fp8_both", "fp8_k_only", "fp8_both_g128"]
    result = fq.evaluate(model, tokens, window=64, chunk=16, names=names)
    assert list(result) == names
    ref = result["bf16"]
    assert (
        ref["ppl_ratio_to_bf16"] == 1.0 and ref["mean_kl_nats_vs_bf16"] == 0.0 and ref["top1_agreement_vs_bf16"] == 1.0
    )
    assert ref["mean_kl_nats_vs_float32"] > 0, "bf16's own distance from float32"
    for name in names[1:]:
        r = result[name]
        assert (
            0 < r["mean_kl_nats_vs_bf16"] < 0.5
            and 0 < r["mean_abs_logit_err_vs_bf16"] <= r["max_abs_logit_err_vs_bf16"]
        )
        assert 0.5 < r["ppl_ratio_to_bf16"] < 2
    assert result["fp8_weights"]["mean_kl_nats_vs_bf16"] != result["fp8_weights_a16"]["mean_kl_nats_vs_bf16"]
    # One pass of each 64-token window against four chunks of 16 through the cache: the same
    # perplexity up to float rounding.
    whole = fq.evaluate(model, tokens, window=64, chunk=64, names=["bf16"])
    assert whole["bf16"]["perplexity"] == pytest.approx(ref["perplexity"], rel=2e-3)


def test_main_writes_the_json_with_the_kv_capacity(fq: ModuleType, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp8_quality.json"
    args = ["--model", str(tiny_model_dir), "--tokens", "40", "--window", "32", "--chunk", "16"]
    assert fq.main([*args, "--variants", "fp8_both", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == tiny_model_dir.name and report["tokens"] == 40 and report["scored_positions"] == 31 + 7
    assert report["text_source"]["path"] == "engine/data/tiny_corpus.txt" and report["commit"] is not None
    assert list(report["variants"]) == ["bf16", "fp8_both"]
    # SmolLM2's shapes: 30 layers, 3 KV heads of 64; FP8 with a float32 scale per 16-token block.
    smollm2 = fq.kv_capacity(30, 3, 64, 16)
    assert smollm2["page_bytes"] == {"bf16": 30 * 2 * 3 * 2048, "fp8": 30 * 2 * 3 * 1028}
    assert smollm2["ratio_fp8_to_bf16"] == pytest.approx(2048 / 1028, abs=1e-4)
    assert smollm2["ratio_with_a_scale_per_token"] == pytest.approx(128 / 68, abs=1e-4)
