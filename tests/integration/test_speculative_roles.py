"""Speculative decoding in every role layout: the decode worker of a PD pair and a unified
worker speculate (n-gram drafts verified in one pass) and stream exactly the greedy tokens
of ``transformers``' ``generate``; a request whose speculating decode worker is killed moves to
another with no gap and no repeat. Workers in this process, a real nats-server and real Mooncake."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.client import Client
from pdserve.engine.config import EngineConfig

pytestmark = pytest.mark.slow

# drafts at every match (the tiny model's greedy output soon repeats, so they hit)
SPECULATING = EngineConfig(max_total_tokens=16 * 512, speculative_algorithm="ngram", speculative_cost_ratio=0.0)
NEW = 48


def prompts() -> list[list[int]]:
    rng = random.Random("roles")
    text = [rng.randrange(3, 4000) for _ in range(10)]
    return [text * 3, [rng.randrange(3, 4000) for _ in range(25)]]


def reference(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


async def stream(url: str, model: str, prompt: list[int], n: int) -> list[int]:
    tokens: list[int] = []
    async with await Client.connect(url, model) as client:
        async for piece in client.stream(prompt, max_new_tokens=n, temperature=0, ignore_eos=True):
            tokens += piece.token_ids
    return tokens


@pytest.mark.parametrize("layout", ["pd", "unified"])
async def test_a_speculating_worker_streams_the_greedy_tokens(
    nats_server: Any, workers: Any, tiny_model_dir: Path, layout: str
) -> None:
    if layout == "pd":
        prefill = await workers("prefill")
        speculating = await workers("decode", engine=SPECULATING)
    else:
        speculating = await workers("unified", engine=SPECULATING)
    for prompt in prompts():
        assert await stream(nats_server.url, tiny_model_dir.name, prompt, NEW) == reference(tiny_model_dir, prompt, NEW)
    spec = speculating.engine.stats.spec
    assert spec is not None and spec.verifies > 0 and spec.accepted > 0
    if layout == "pd":  # the prefill role computes prompts only: nothing of it speculates
        assert prefill.engine.stats.spec is None


async def test_a_request_moves_off_a_killed_speculating_decode_worker_with_no_gap(
    nats_server: Any, workers: Any, kill: Any, tiny_model_dir: Path
) -> None:
    await workers("prefill")
    first = await workers("decode", engine=SPECULATING)
    prompt, n = prompts()[0], 160
    tokens: list[int] = []
    second = None
    async with await Client.connect(nats_server.url, tiny_model_dir.name, stall_timeout=1.5) as client:
        async for piece in client.stream(prompt, max_new_tokens=n, temperature=0, ignore_eos=True):
            tokens += piece.token_ids
            if len(tokens) >= 30 and second is None:
                second = await workers("decode", engine=SPECULATING)
                await kill(first)  # kill -9: silence, nothing handed back
            last = piece
    assert tokens == reference(tiny_model_dir, prompt, n)
    assert last.finish_reason == "length" and last.attempt == 1
    assert second is not None and second.counters["migrations"] == 1
    spec = first.engine.stats.spec
    assert spec is not None and spec.verifies > 0  # it speculated before it died
