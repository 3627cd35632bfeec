"""What to load (:class:`ModelSpec`) and loading it: the dtype chosen, a quantized checkpoint
served as it is or refused with what would serve it, random weights for ``dummy``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine import attention
from pdserve.engine.cpu_dtype import auto_cpu_dtype
from pdserve.engine.kv_pool import dtype_name
from pdserve.engine.quant import CHECKPOINT_FORMATS

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelSpec:
    """What to load: a local Hugging Face directory (or random weights from its config)."""

    path: Path
    dtype: str = "auto"
    trust_remote_code: bool = False
    load_format: str = "auto"  # "auto" (weights from disk) or "dummy" (random weights)
    seed: int = 0


def resolve_dtype(name: str, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name == "half":
            return torch.float16
        if name not in _DTYPES:
            raise ValueError(f"unsupported dtype {name!r}; use auto, float32, float16 or bfloat16")
        return _DTYPES[name]
    if device.type == "cpu":  # a 16-bit checkpoint in bfloat16 where the CPU has it natively
        dtype, why = auto_cpu_dtype(config_dtype)
        log.info("cpu dtype", extra={"dtype": dtype_name(dtype), "reason": why})
        return dtype
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_model(spec: ModelSpec, device: torch.device, quantization: str | None = None) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    impl = attention.register()
    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    method = checkpoint_quantization(getattr(config, "quantization_config", None))
    if method is not None:
        refuse_quantized_checkpoint(method, quantization)
    dtype = resolve_dtype(spec.dtype, getattr(config, "dtype", None), device)
    if method is not None and spec.load_format == "auto":  # an FP8 checkpoint, served as it is
        from pdserve.engine.fp8_checkpoint import load_fp8_checkpoint

        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"an FP8 checkpoint is served in a 16- or 32-bit dtype, not {dtype}")
        model, _ = load_fp8_checkpoint(spec.path, config, dtype, device, impl)
        return model
    if spec.load_format == "dummy":
        torch.manual_seed(spec.seed)
        with device:  # initialise on the device: a 7B model's random init on the CPU takes minutes
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=impl, trust_remote_code=spec.trust_remote_code
            )
    elif spec.load_format == "auto":
        model = AutoModelForCausalLM.from_pretrained(
            spec.path,
            dtype=dtype,
            attn_implementation=impl,
            trust_remote_code=spec.trust_remote_code,
            device_map=None if device.type == "cpu" else device,
        )
    else:
        raise ValueError(f"unknown load format {spec.load_format!r}")
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' wrapped .to


def checkpoint_quantization(quantization_config: object) -> str | None:
    """config.json's ``quantization_config`` ``quant_method`` (None: a plain checkpoint)."""
    if quantization_config is None:
        return None
    method = (
        quantization_config.get("quant_method")
        if isinstance(quantization_config, dict)
        else getattr(quantization_config, "quant_method", None)
    )
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    return str(method)


def refuse_quantized_checkpoint(method: str, quantization: str | None) -> None:
    """A quantized checkpoint pdserve cannot serve as asked, refused with what would serve it:
    an FP8 one (``fp8``, compressed-tensors) needs ``--quantization fp8``; other methods
    (GPTQ, AWQ, bitsandbytes, ...) are not supported."""
    if method in CHECKPOINT_FORMATS:
        if quantization != "fp8":
            raise ValueError(
                f"this checkpoint is quantized to FP8 (quantization_config quant_method {method!r}): "
                "serve it with --quantization fp8 (a GPU of compute capability 8.9 or above)"
            )
        return
    raise ValueError(
        f"this checkpoint is quantized with {method!r}, which pdserve does not load; serve a 16-bit checkpoint "
        "(with --quantization fp8 to quantize it at load) or an FP8 one"
    )
