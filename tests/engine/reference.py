"""Greedy output against ``transformers``, token for token, ties aside.

Two correct float32 implementations can order their additions differently, so where
the model's two best tokens are within rounding of each other either may win. Outputs
must agree up to their first difference, and there the reference's logits (teacher
forced on the common prefix) must show a near tie between the two tokens chosen.
"""

from __future__ import annotations

import torch

TIE = 1e-3  # logits closer than this are a tie in float32 through dozens of layers


def assert_greedy_equal(
    model: torch.nn.Module, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]
) -> None:
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        assert len(a) == len(b)
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if at is None:
            continue
        ids = torch.tensor([prompt + b[:at]], device=next(model.parameters()).device)
        with torch.inference_mode():
            logits = model(ids).logits[0, -1].double()
        gap = (logits[b[at]] - logits[a[at]]).abs().item()
        assert gap < TIE, f"output {at} differs: {a[at]} against {b[at]}, logit gap {gap:.2e} is no tie"
