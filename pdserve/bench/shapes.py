"""Model shapes the benchmarks build with random weights (Qwen2 configuration keywords), and
the small Llama-family models the fast-path tests and ``bench/probes/gpu_diag.py`` share."""

from __future__ import annotations

from typing import Any

QWEN2_5_7B: dict[str, Any] = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=False,
)

QWEN2_5_0_5B: dict[str, Any] = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


# SmolLM2-135M-Instruct, the default model: 9 query heads (an odd count) over 3 KV heads of 64.
SMOLLM2_135M: dict[str, Any] = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


SMALL: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
LLAMA3_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SMALL_KINDS = ("llama", "qwen2", "qwen3", "llama3-rope", "smollm2", "smollm2-2l")


def small_model(kind: str, device: Any) -> Any:
    """A 2-layer float32 model of family ``kind`` (one of :data:`SMALL_KINDS`) on ``device``,
    seeded, with wider weights than the default init (distinct logits: a real comparison).
    ``smollm2`` has all of :data:`SMOLLM2_135M`'s dimensions (30 layers, tied embeddings);
    ``smollm2-2l`` its attention's (9 heads over 3 KV heads of 64, hidden 576, tied) in 2
    layers, a narrow MLP and 512 tokens, for Triton's interpreter on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    families: dict[str, tuple[Any, dict[str, Any]]] = {
        "llama": (LlamaConfig, {"rope_theta": 10000.0}),
        "qwen2": (Qwen2Config, {"rope_theta": 1e6}),
        "qwen3": (Qwen3Config, {"head_dim": 16, "rope_theta": 1e6}),
        "llama3-rope": (LlamaConfig, {"rope_scaling": LLAMA3_SCALING}),
        "smollm2": (LlamaConfig, SMOLLM2_135M),
        "smollm2-2l": (
            LlamaConfig,
            {**SMOLLM2_135M, "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 512},
        ),
    }
    family, extra = families[kind]
    config = family(**{**SMALL, **extra})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model.eval()
