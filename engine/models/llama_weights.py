"""The weights of a Llama-family decoder as pdserve's forward passes hold them: Llama,
Qwen2, Qwen3, Mistral; q/k/v fused into one projection and gate/up into another.

Imports no kernels: the GPU pass (:mod:`.llama`, Triton) and the CPU pass
(:mod:`.llama_cpu`, torch ops) share it.

With ``--quantization fp8``, :func:`quantize_fp8_` turns the four linear weights of each
decoder layer into :class:`~pdserve.engine.quant.Fp8Weight` before the KV pool is sized and
drops their 16-bit copies; :func:`fused_layer` then holds those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.quant import Fp8Weight, quantize_fp8

if TYPE_CHECKING:
    from pdserve.engine.parallel import TPGroup

ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"})
# Rotary variants whose tables depend only on the position (not on the running sequence length).
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


def unsupported_reason(model: Any) -> str | None:
    """Why this model (a ``transformers`` causal LM) cannot take the fast path, or ``None``."""
    arch = type(model).__name__
    if arch not in ARCHITECTURES:
        return f"architecture {arch} has no fast path"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rotary type {rope!r} has no fast path"
    config = model.config.get_text_config()
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} has no fast path"
    return None


# A linear layer's weight: the model's own tensor, or FP8 with per-output-channel scales.
Weight = torch.Tensor | Fp8Weight


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv_weight: Weight
    qkv_bias: torch.Tensor | None
    q_norm: torch.nn.Module | None  # Qwen3: RMSNorm of each head before rotary
    k_norm: torch.nn.Module | None
    o_weight: Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: Weight
    gate_up_bias: torch.Tensor | None
    down_weight: Weight
    down_bias: torch.Tensor | None
    window: int | None


def _already_fused(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The fused tensor ``parts`` are consecutive row slices of (a second forward pass built
    over the same model, as the two engines of a co-located process are), else ``None``."""
    first = parts[0]
    if any(p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for p in parts):
        return None
    offset = first.storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.storage_offset() != offset or p.shape[1:] != first.shape[1:]:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    fused = first.new_empty(0)
    fused.set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]), first.stride())
    return fused


def _fuse(modules: list[Any], name: str) -> torch.Tensor | None:
    """Concatenate the modules' ``name`` tensors and point each module at its slice (or the
    fused tensor they already are slices of: weights are never held twice)."""
    parts = [getattr(m, name) for m in modules]
    if parts[0] is None:
        return None
    shared = _already_fused([p.data for p in parts])
    if shared is not None:
        return shared
    fused = torch.cat([p.data for p in parts])
    start = 0
    for part in parts:
        n = part.shape[0]
        part.data = fused[start : start + n]
        start += n
    return fused


def _fused_weight(modules: list[Any]) -> torch.Tensor:
    fused = _fuse(modules, "weight")
    assert fused is not None
    return fused


# The attribute that holds a quantized module's FP8 weight (see :func:`quantize_fp8_`).
FP8_ATTR = "pdserve_fp8"


def projection_groups(layer: Any) -> list[tuple[Any, list[Any]]]:
    """A decoder layer's four products: (the module that holds their weight, its modules):
    self_attn for q/k/v fused, o_proj, mlp for gate/up fused, down_proj."""
    attn, mlp = layer.self_attn, layer.mlp
    return [
        (attn, [attn.q_proj, attn.k_proj, attn.v_proj]),
        (attn.o_proj, [attn.o_proj]),
        (mlp, [mlp.gate_proj, mlp.up_proj]),
        (mlp.down_proj, [mlp.down_proj]),
    ]


def is_fp8(model: Any) -> bool:
    """Whether :func:`quantize_fp8_` has run on ``model``."""
    return getattr(model.model.layers[0].self_attn, FP8_ATTR, None) is not None


def quantize_fp8_(model: Any) -> tuple[int, int]:
    """Quantize each decoder layer's linear weights (q/k/v fused, o, gate/up fused, down; not
    the embeddings or the LM head) to FP8 with a scale per output channel, in place and one
    layer at a time: each FP8 weight is kept on the module as ``pdserve_fp8`` and the 16-bit
    weights become meta tensors (their memory is freed; the stock ``transformers`` forward
    pass cannot run any more, and raises if asked to). Returns the bytes of the weights
    before and after (scales included); ``(0, 0)`` when the model was quantized already (a
    second pass over one model: the two engines of a co-located process)."""
    if is_fp8(model):
        return 0, 0
    before = after = 0
    with torch.no_grad():
        for layer in model.model.layers:
            for owner, modules in projection_groups(layer):
                parts = [quantize_fp8(m.weight) for m in modules]
                if len(parts) == 1:
                    fp8 = parts[0]
                else:  # per output channel: the fused weight's quantization is its parts'
                    fp8 = Fp8Weight(q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]))
                setattr(owner, FP8_ATTR, fp8)
                for m in modules:
                    w = m.weight
                    before += w.numel() * w.element_size()
                    m.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), False)
                after += fp8.q.numel() * fp8.q.element_size() + fp8.scale.numel() * fp8.scale.element_size()
    return before, after


def fused_layer(layer: Any) -> Layer:
    """The tensors of one decoder layer (q/k/v and gate/up fused in place, see :func:`_fuse`;
    the FP8 weights of a model :func:`quantize_fp8_` has quantized)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_proj, mlp.up_proj]
    fp8 = [getattr(owner, FP8_ATTR, None) for owner, _ in projection_groups(layer)]
    return Layer(
        input_norm=layer.input_layernorm.weight,
        qkv_weight=fp8[0] if fp8[0] is not None else _fused_weight(qkv),
        qkv_bias=_fuse(qkv, "bias"),
        q_norm=getattr(attn, "q_norm", None),
        k_norm=getattr(attn, "k_norm", None),
        o_weight=fp8[1] if fp8[1] is not None else attn.o_proj.weight,
        o_bias=attn.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up_weight=fp8[2] if fp8[2] is not None else _fused_weight(gate_up),
        gate_up_bias=_fuse(gate_up, "bias"),
        down_weight=fp8[3] if fp8[3] is not None else mlp.down_proj.weight,
        down_bias=mlp.down_proj.bias,
        window=getattr(attn, "sliding_window", None),
    )


def rope_tables(model: Any, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [max_positions, head_dim]`` (halves repeated) of the model's own rotary
    embedding, in its dtype: each position's row equals what the stock code computes for it."""
    inner = model.model
    embed = inner.embed_tokens.weight
    with torch.no_grad():
        positions = torch.arange(max_positions, device=embed.device)[None, :]
        probe = torch.empty((), dtype=embed.dtype, device=embed.device)
        cos, sin = inner.rotary_emb(probe, positions)
    assert cos.shape[-1] == inner.layers[0].self_attn.head_dim, "partial rotary has no fast path"
    return cos[0].contiguous(), sin[0].contiguous()


class FusedDecoder:
    """What both forward passes hold of a Llama-family model: its shape (heads of this rank,
    head size, scale, norm epsilon), embedding, final norm, LM head, fused layers and rotary
    tables, over the page pool ``pool``. ``tp``: the weights are this rank's shard.
    ``kv_scales``: ``pool`` is an FP8 pool's values and these its block scales
    (:class:`pdserve.engine.kv_pool.KVPool`'s ``kv`` and ``kv_scales``)."""

    def __init__(
        self,
        model: Any,
        pool: torch.Tensor,
        max_positions: int,
        tp: TPGroup | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        config = model.config.get_text_config()
        inner = model.model
        ranks = 1 if tp is None else tp.size
        self.pool = pool
        self.kv_scales = kv_scales
        self.tp = tp
        self.num_q = config.num_attention_heads // ranks
        self.num_kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // ranks
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scale = first.scaling
        self.eps = config.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers: list[Layer] = [fused_layer(layer) for layer in inner.layers]
        self.cos, self.sin = rope_tables(model, max_positions)
