"""Greedy output against ``transformers``, token for token, ties aside.

Outputs must equal ``generate``'s up to their first difference. From there each of our
tokens must be the best (within float32 rounding of the best; in bfloat16, within a few
roundings) under the reference model's own forward pass over our tokens: two correct implementations may order their
additions differently and so break a near tie differently, and ``generate`` (with its
KV cache) has been seen to leave its own forward pass (Llama 3 rotary scaling, float32,
on an H200: the forward pass and pdserve agreed, ``generate`` did not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.schemas import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine

TIE = 1e-3  # logits closer than this are a tie in float32 through dozens of layers
# In bfloat16 (8 bits of mantissa) a tie is within a few roundings of the best logit: this
# fraction of it (2 ** -6, four units of its last place), and never under TIE.
BF16_TIE = 2**-6


def tie_of(dtype: torch.dtype, best: float) -> float:
    """How far below the reference's best logit ``best`` a token still ties, in ``dtype``."""
    return max(TIE, abs(best) * BF16_TIE) if dtype == torch.bfloat16 else TIE


def assert_greedy_equal(
    model: torch.nn.Module, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]
) -> None:
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        assert len(a) == len(b)
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if at is None:
            continue
        ids = torch.tensor([prompt + a], device=next(model.parameters()).device)
        with torch.inference_mode():
            logits = model(ids).logits[0].double()
        dtype = next(model.parameters()).dtype
        for i in range(at, len(a)):
            row = logits[len(prompt) + i - 1]
            gap = (row.max() - row[a[i]]).item()
            tie = tie_of(dtype, row.max().item())
            assert gap < tie, f"output {i} is {a[i]}, {gap:.2e} below the reference's best {row.argmax().item()}"


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], n: int, batched: bool = False) -> list[list[int]]:
    """``generate``'s ``n`` greedy tokens for each prompt alone (SDPA attention), on the model's
    device; ``batched``: all prompts in one call, left padded and masked (several times faster
    on a CPU; its additions in other orders break near ties differently, which
    :func:`assert_greedy_equal` allows for)."""
    model.set_attn_implementation("sdpa")
    device = next(model.parameters()).device
    with torch.inference_mode():
        if batched:
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
            return [row[width:].tolist() for row in out]
        outs = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            outs.append(model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p) :].tolist())
    return outs


def run(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The engine's ``n`` greedy tokens for each prompt, all added at once and stepped to the end."""
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
    return [outs[str(i)] for i in range(len(prompts))]
