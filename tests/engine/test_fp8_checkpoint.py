"""FP8 checkpoints served as stored (``engine/fp8_checkpoint.py``): written here in the formats
users have (``quant_method`` ``fp8`` with per-channel ``weight_scale`` or 16x16 blocks of
``weight_scale_inv``, compressed-tensors with one scale per tensor), one projection left in 16
bits as a checkpoint's ``ignore`` list leaves it; loaded with ``--quantization fp8``; greedy
output through pdserve's Triton pass (interpreted on the CPU) equals ``transformers`` on the
very weights the checkpoint holds."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from pdserve.bench import shapes
from pdserve.engine import quant
from pdserve.engine.checkpoint import load_model
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kernels import fp8
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.models.llama_weights import FP8_ATTR, is_fp8, projection_groups
from tests.engine.kernel_env import DEVICE
from tests.engine.reference import assert_greedy_equal, hf_greedy, run

PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight")
LEFT_16_BIT = "model.layers.1.mlp.down_proj"
FORMATS = {
    "fp8-channel": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}}},
        "ignore": ["lm_head", LEFT_16_BIT],
    },
}


def quantized(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """``w`` as the format stores it: the FP8 weight and its scale tensor."""
    w = w.float()
    if fmt == "fp8-channel":
        q = quant.quantize_fp8(w)
        return {"weight": q.q, "weight_scale": q.scale[:, None]}
    if fmt == "compressed-tensors":
        scale = w.abs().amax() / 448
        return {"weight": (w / scale).to(quant.FP8), "weight_scale": scale.reshape(1)}
    n, k = w.shape  # blocks of 16 x 16, each its own scale (the last ones partial)
    blocks = torch.zeros((-(-n // 16), -(-k // 16)))
    q = torch.empty_like(w, dtype=quant.FP8)
    for i in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            block = w[i * 16 : (i + 1) * 16, j * 16 : (j + 1) * 16]
            blocks[i, j] = block.abs().amax() / 448
            q[i * 16 : (i + 1) * 16, j * 16 : (j + 1) * 16] = (block / blocks[i, j]).to(quant.FP8)
    return {"weight": q, "weight_scale_inv": blocks}


def write_checkpoint(model: torch.nn.Module, fmt: str, path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        prefix = name.removesuffix(".weight")
        if PROJECTION.fullmatch(name) and prefix != LEFT_16_BIT:
            tensors.update({f"{prefix}.{k}": v.contiguous() for k, v in quantized(value, fmt).items()})
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    model.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = FORMATS[fmt]
    (path / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_fp8_checkpoint_is_served_as_stored(fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_transformers()
    source = shapes.small_model("qwen2", "cpu")
    stored = write_checkpoint(source, fmt, tmp_path)
    spec = ModelSpec(tmp_path, dtype="float32")
    model = load_model(spec, DEVICE, "fp8")
    assert is_fp8(model)
    qc = FORMATS[fmt]
    for index, layer in enumerate(model.model.layers):
        for owner, modules in projection_groups(layer):
            got = getattr(owner, FP8_ATTR)
            assert all(m.weight.is_meta for m in modules), "no 16-bit projection is held"
            parts = []
            for module in modules:
                relative = next(n for n, m in layer.named_modules() if m is module)
                name = f"model.layers.{index}.{relative}"
                if name == LEFT_16_BIT:  # quantized at load, as --quantization fp8 does
                    parts.append(quant.quantize_fp8(source.state_dict()[f"{name}.weight"]))
                else:
                    parts.append(quant.fp8_weight_from_checkpoint(stored, name, qc))
            assert torch.equal(got.q.view(torch.uint8).cpu(), torch.cat([p.q for p in parts]).view(torch.uint8))
            assert torch.equal(got.scale.cpu(), torch.cat([p.scale for p in parts]))
    if fmt == "fp8-channel":  # per-channel scales are taken as they are: the stored bytes
        name = "model.layers.0.self_attn.o_proj"
        assert torch.equal(getattr(model.model.layers[0].self_attn.o_proj, FP8_ATTR).q.cpu().view(torch.uint8),
                           stored[f"{name}.weight"].view(torch.uint8))  # fmt: skip
    # everything else as stored
    assert torch.equal(model.model.embed_tokens.weight.cpu(), source.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight.cpu(), source.lm_head.weight)
    assert torch.equal(model.model.layers[1].self_attn.q_proj.bias.cpu(), source.model.layers[1].self_attn.q_proj.bias)

    # served: greedy equals transformers on the weights the checkpoint holds (dequantized)
    reference = shapes.small_model("qwen2", DEVICE)
    with torch.no_grad():
        for ours, ref in zip(model.model.layers, reference.model.layers, strict=True):
            for (owner, _), (_, modules) in zip(projection_groups(ours), projection_groups(ref), strict=True):
                dense = getattr(owner, FP8_ATTR).dequantize(torch.float32)
                for module, part in zip(modules, dense.split([m.out_features for m in modules]), strict=True):
                    module.weight.copy_(part)
    monkeypatch.setattr(fp8, "GEMV_MAX_ROWS", 64)  # W8A16 every step: the reference is the dequantized model
    rng = random.Random(fmt)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 19)]
    expected = hf_greedy(reference, prompts, 5)
    config = EngineConfig(
        device=str(DEVICE), max_total_tokens=512, model_impl="pdserve", chunked_prefill_size=16,
        cuda_graph_max_batch=0, quantization="fp8",
    )  # fmt: skip
    runner = ModelRunner(spec, config, model=model)
    assert runner.fp8_bytes == (0, 0), "nothing quantized a second time"
    ours = run(Engine(runner, config), prompts, 5)
    assert_greedy_equal(reference, prompts, ours, expected)


def test_quantized_checkpoints_are_refused_with_what_would_serve_them(tmp_path: Path) -> None:
    quiet_transformers()
    source = shapes.small_model("llama", "cpu")
    write_checkpoint(source, "fp8-channel", tmp_path)
    with pytest.raises(ValueError, match=r"quantized to FP8 .* serve it with --quantization fp8"):
        load_model(ModelSpec(tmp_path), torch.device("cpu"), None)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for quantization in (None, "fp8"):
        with pytest.raises(ValueError, match="quantized with 'gptq', which pdserve does not load"):
            load_model(ModelSpec(tmp_path), torch.device("cpu"), quantization)
