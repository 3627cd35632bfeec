"""Model shapes the benchmarks build with random weights (Qwen2 configuration keywords)."""

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
