"""The client library moves a request when its worker is lost, as the HTTP API does: the
stream goes on from the tokens it has, with no gap and no repeat (workers in this process,
a real nats-server and real Mooncake)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.client import Client

pytestmark = pytest.mark.slow

PROMPT = [11, 22, 33, 44, 55, 66, 77]


def reference(model_dir: Path, n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


async def test_a_killed_decode_worker_the_client_moves_on(
    nats_server: Any, workers: Any, kill: Any, tiny_model_dir: Path
) -> None:
    await workers("prefill")
    first = await workers("decode")
    n = 200
    tokens: list[int] = []
    second = None
    async with await Client.connect(nats_server.url, tiny_model_dir.name, stall_timeout=1.5) as client:
        async for piece in client.stream(PROMPT, max_new_tokens=n, temperature=0, ignore_eos=True):
            tokens += piece.token_ids
            if len(tokens) >= 30 and second is None:
                second = await workers("decode")
                await kill(first)  # kill -9: silence, nothing handed back
            last = piece
    assert tokens == reference(tiny_model_dir, n)  # no gap, no repeat, the same tokens
    assert last.finish_reason == "length" and last.attempt == 1
    assert second is not None and second.counters["migrations"] == 1


async def test_a_draining_decode_worker_hands_back_and_the_client_resumes_at_once(
    nats_server: Any, workers: Any, tiny_model_dir: Path
) -> None:
    await workers("prefill")
    first = await workers("decode", drain_seconds=0.0)
    n = 160
    tokens: list[int] = []
    gaps: list[float] = []
    drained = False
    async with await Client.connect(nats_server.url, tiny_model_dir.name) as client:  # stall timeout 10 s
        stamp = time.monotonic()
        async for piece in client.stream(PROMPT, max_new_tokens=n, temperature=0, ignore_eos=True):
            tokens += piece.token_ids
            now = time.monotonic()
            if drained:
                gaps.append(now - stamp)
            stamp = now
            if len(tokens) >= 30 and not drained:
                await workers("decode")
                await first.shutdown()  # SIGTERM: hands the request back with a handed_back chunk
                drained, stamp = True, time.monotonic()
            last = piece
    assert tokens == reference(tiny_model_dir, n)
    assert first.counters["handed_back"] == 1 and last.attempt == 1
    assert max(gaps) < 5.0  # moved on the hand-back, not after the 10 s stall timeout
