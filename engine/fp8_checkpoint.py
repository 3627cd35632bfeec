"""FP8 checkpoints served as they are: ``--quantization fp8`` over a model whose config.json
has a ``quantization_config`` of ``quant_method`` ``fp8`` (transformers' fine-grained FP8,
AutoFP8, vLLM's) or ``compressed-tensors`` with FP8 weights.

The model is built on the meta device (no 16-bit copy of the projections is ever made), every
tensor that is not a decoder projection (embeddings, norms, biases, the LM head) is read from
the safetensors files in the model's dtype, and each projection's FP8 weight and scale become
the same :class:`~pdserve.engine.quant.Fp8Weight` that quantizing at load would have left
(:func:`pdserve.engine.models.llama_weights.quantize_fp8_`): per-tensor and per-channel
scales exactly, block scales rounded to per-channel ones
(:func:`pdserve.engine.quant.fp8_weight_from_scaled`). A projection the checkpoint left in 16
bits (its ``ignore`` list) is quantized here as at load, and counted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.models.llama_weights import FP8_ATTR, projection_groups
from pdserve.engine.quant import FP8, Fp8Weight, fp8_weight_from_checkpoint, quantize_fp8

log = logging.getLogger("pdserve.engine")


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """The tensors of a model directory's safetensors files by name, read on access."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (path / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise ValueError(f"{path}: an FP8 checkpoint is read from safetensors files, and none is there")
        self._handles = [safe_open(str(path / f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._where[name].get_tensor(name)
        except KeyError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_fp8_checkpoint(
    path: Path, config: Any, dtype: torch.dtype, device: torch.device, attn_implementation: str
) -> tuple[torch.nn.Module, dict[str, int]]:
    """The model of the FP8 checkpoint at ``path`` on ``device``: its projections as
    :class:`Fp8Weight` on their modules (the 16-bit weights meta tensors), everything else in
    ``dtype``. Returns the model and counts: ``fp8`` projections read as stored, ``quantized``
    ones the checkpoint kept in 16 bits."""
    from transformers import AutoModelForCausalLM

    qc = config.quantization_config
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    config = _without_quantization(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    tensors = CheckpointTensors(path)
    counts = {"fp8": 0, "quantized": 0}
    projections: set[str] = set()
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for owner, modules in projection_groups(layer):
                parts = []
                for module in modules:
                    name = f"model.layers.{index}.{_relative(layer, module)}"
                    projections.update({f"{name}.weight", f"{name}.weight_scale", f"{name}.weight_scale_inv"})
                    projections.add(f"{name}.input_scale")
                    stored = tensors[f"{name}.weight"]
                    if stored.dtype == FP8:
                        parts.append(fp8_weight_from_checkpoint(tensors, name, qc))
                        counts["fp8"] += 1
                    else:  # left in 16 bits by the checkpoint: quantized here as at load
                        parts.append(quantize_fp8(stored.to(torch.float32)))
                        counts["quantized"] += 1
                    module.weight = torch.nn.Parameter(
                        torch.empty(module.weight.shape, dtype=dtype, device="meta"), requires_grad=False
                    )
                fp8 = parts[0] if len(parts) == 1 else Fp8Weight(
                    q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts])
                )  # fmt: skip
                setattr(owner, FP8_ATTR, Fp8Weight(q=fp8.q.to(device), scale=fp8.scale.to(device)))
        state = {}
        for name, param in model.state_dict().items():
            if name in projections:
                continue
            if name not in tensors:
                if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
                    continue
                raise ValueError(f"{path}: the checkpoint has no tensor {name}")
            value = tensors[name]
            if value.dtype == FP8:  # an FP8 tensor outside the projections: served in dtype
                scale = tensors.get(name.removesuffix(".weight") + ".weight_scale")
                value = value.to(torch.float32) * (scale.to(torch.float32) if scale is not None else 1.0)
            if value.shape != param.shape:
                raise ValueError(
                    f"{path}: {name} is {list(value.shape)} in the checkpoint, the model wants {list(param.shape)}"
                )
            state[name] = value.to(dtype=dtype, device=device)
        model.load_state_dict(state, strict=False, assign=True)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        _rebuild_meta_buffers(model, config, device)
    leftover = [n for n, p in model.named_parameters() if p.is_meta and n not in projections]
    if leftover:
        raise ValueError(f"{path}: no value for {leftover[:4]}")
    log.info("fp8 checkpoint", extra={"fp8_projections": counts["fp8"], "quantized_at_load": counts["quantized"]})
    return model.eval(), counts


def _without_quantization(config: Any) -> Any:
    """A copy of ``config`` without its ``quantization_config`` (the model is built plain)."""
    config = type(config).from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _relative(layer: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, m in layer.named_modules() if m is module)


def _rebuild_meta_buffers(model: torch.nn.Module, config: Any, device: torch.device) -> None:
    """Buffers computed at construction (the rotary tables) built again on ``device``: on the
    meta device they hold no values."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if any(b.is_meta for b in child.buffers(recurse=False)) and "rotary" in type(child).__name__.lower():
                with torch.device(device):
                    setattr(parent, child_name, type(child)(config=config))
    meta = [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ValueError(f"buffers still without values after loading: {meta[:4]}")
