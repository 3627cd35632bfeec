"""Placement over the queues, end to end (real nats-server, real Mooncake, workers in this
process): conditional disaggregation sends a short prompt to a decode worker's local
prefill and a long one down the disaggregated path, both equal to transformers; a local
request whose decode worker dies is finished elsewhere."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.api.gateway import Gateway
from pdserve.api.placement import PlacementConfig
from pdserve.broker import streams
from pdserve.schemas import SamplingParams, TokenChunk

pytestmark = pytest.mark.slow

SHORT = list(range(7, 70))  # 63 tokens
LONG = [(i * 7 + 3) % 250 + 3 for i in range(200)]
ON = PlacementConfig(conditional_disagg=True, local_prefill_max_tokens=128, local_prefill_max_tokens_busy=128)


def reference(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


async def until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.fixture
async def gateway(nats_server, tiny_model_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Gateway]:
    options = {"stall_timeout": 1.5, "gap_timeout": 0.5, **getattr(request, "param", {})}
    broker = options.pop("broker", streams.BrokerConfig())
    gw = Gateway(nats_server.url, tiny_model_dir.name, broker, placement=ON, **options)
    await gw.start()
    yield gw
    await gw.stop()


async def run(
    gw: Gateway, prompt: list[int], n: int, rid: str, on_chunk: Any = None, limit: float = 120
) -> tuple[list[int], list[str]]:
    tokens: list[int] = []
    seen: list[str] = []

    async def consume() -> None:
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        async for chunk in gw.generate(prompt, params, rid=rid):
            tokens.extend(chunk.token_ids)
            if chunk.worker_id and (not seen or seen[-1] != chunk.worker_id):
                seen.append(chunk.worker_id)
            if on_chunk is not None:
                await on_chunk(tokens, chunk)

    await asyncio.wait_for(consume(), limit)
    return tokens, seen


async def test_a_short_prompt_is_prefilled_on_the_decode_worker_a_long_one_is_disaggregated(
    workers, gateway: Gateway, tiny_model_dir: Path
) -> None:
    prefill = await workers("prefill")
    decode = await workers("decode")
    await until(lambda: len(gateway.load.decode) == 1 and gateway.load.prefill_workers == 1)

    tokens, seen = await run(gateway, SHORT, 24, "short")
    assert tokens == reference(tiny_model_dir, SHORT, 24)
    assert seen == [decode.worker_id]
    assert decode.counters["local_prefills"] == 1 and decode.counters["kv_pulls"] == 0
    assert prefill.engine.stats.prompt_tokens == 0, "the prefill worker never saw the short prompt"

    tokens, seen = await run(gateway, LONG, 24, "long")
    assert tokens == reference(tiny_model_dir, LONG, 24)
    assert seen == [prefill.worker_id, decode.worker_id]
    assert decode.counters["local_prefills"] == 1 and decode.counters["kv_pulls"] == 1
    assert decode.counters["recomputes"] == 0
    assert gateway.metrics.placed_by_path == {"disaggregated": 1, "local": 1}
    exposition = gateway.metrics.exposition().decode()
    assert 'pdserve_placement_decisions_total{path="local"} 1.0' in exposition


async def test_a_local_request_whose_decode_worker_dies_moves_on(
    workers, kill, gateway: Gateway, tiny_model_dir: Path
) -> None:
    await workers("prefill")
    first = await workers("decode")
    await until(lambda: len(gateway.load.decode) == 1)
    state: dict[str, Any] = {}

    async def on_chunk(tokens: list[int], chunk: TokenChunk) -> None:
        if len(tokens) >= 20 and "second" not in state:
            assert chunk.worker_id == first.worker_id
            state["second"] = await workers("decode")
            await kill(first)

    tokens, seen = await run(gateway, SHORT, 160, "local-killed", on_chunk)
    assert tokens == reference(tiny_model_dir, SHORT, 160)  # no gap, no repeat, same tokens
    assert first.counters["local_prefills"] == 1
    assert seen[-1] == state["second"].worker_id
    assert gateway.stats.migrations == 1


@pytest.mark.parametrize(
    "gateway", [{"stall_timeout": 60.0, "broker": streams.BrokerConfig(ack_wait=2.0)}], indirect=True
)
async def test_a_local_request_is_redelivered_to_another_decode_worker(
    workers, kill, gateway: Gateway, tiny_model_dir: Path
) -> None:
    """With the API's stall timeout out of the way, JetStream itself hands the local
    request to the other decode worker after ``ack_wait``, as any work message."""
    broker = streams.BrokerConfig(ack_wait=2.0)
    first = await workers("decode", broker=broker)
    await until(lambda: len(gateway.load.decode) == 1)
    state: dict[str, Any] = {}

    async def on_chunk(tokens: list[int], chunk: TokenChunk) -> None:
        if len(tokens) >= 20 and "second" not in state:
            state["second"] = await workers("decode", broker=broker)
            await kill(first)

    tokens, seen = await run(gateway, SHORT, 120, "local-redelivered", on_chunk)
    assert tokens == reference(tiny_model_dir, SHORT, 120)
    second = state["second"]
    assert seen == [first.worker_id, second.worker_id]
    assert second.counters["redeliveries"] == 1 and second.counters["local_prefills"] == 1
    assert gateway.stats.migrations == 0
