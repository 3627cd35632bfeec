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
    assert gateway.metrics.placed_by_path == {"disaggregated": 1, "local": 1, "placed": 0}
    exposition = gateway.metrics.exposition().decode()
    assert 'pdserve_placement_decisions_total{path="local"} 1.0' in exposition


async def test_a_local_request_whose_decode_worker_dies_moves_on(
    workers, kill, gateway: Gateway, tiny_model_dir: Path
) -> None:
    await workers("prefill")
    # Both decode workers up before the request: the one it lands on is killed the moment 20
    # tokens have arrived (starting the second one then gave the first, on a loaded machine,
    # the time to finish all 160 tokens first: nothing left to move).
    decodes = [await workers("decode"), await workers("decode")]
    await until(lambda: len(gateway.load.decode) == 2)
    state: dict[str, Any] = {}

    async def on_chunk(tokens: list[int], chunk: TokenChunk) -> None:
        if len(tokens) >= 20 and "killed" not in state:
            state["killed"] = next(w for w in decodes if w.worker_id == chunk.worker_id)
            await kill(state["killed"])

    tokens, seen = await run(gateway, SHORT, 160, "local-killed", on_chunk)
    assert tokens == reference(tiny_model_dir, SHORT, 160)  # no gap, no repeat, same tokens
    killed = state["killed"]
    (other,) = [w for w in decodes if w is not killed]
    assert killed.counters["local_prefills"] == 1
    assert seen[0] == killed.worker_id and seen[-1] == other.worker_id  # (its prompt may pass a prefill worker)
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
    # Both up before the request, the one streaming it killed at 20 tokens (starting the second
    # then, the first finished all 120 tokens meanwhile on a loaded machine: nothing redelivered)
    decodes = [await workers("decode", broker=broker), await workers("decode", broker=broker)]
    await until(lambda: len(gateway.load.decode) == 2)
    state: dict[str, Any] = {}

    async def on_chunk(tokens: list[int], chunk: TokenChunk) -> None:
        if len(tokens) >= 20 and "killed" not in state:
            state["killed"] = next(w for w in decodes if w.worker_id == chunk.worker_id)
            await kill(state["killed"])

    tokens, seen = await run(gateway, SHORT, 120, "local-redelivered", on_chunk)
    assert tokens == reference(tiny_model_dir, SHORT, 120)
    killed = state["killed"]
    (second,) = [w for w in decodes if w is not killed]
    assert seen == [killed.worker_id, second.worker_id]
    assert second.counters["redeliveries"] == 1 and second.counters["local_prefills"] == 1
    assert gateway.stats.migrations == 0


# ---- prefix-aware placement ---------------------------------------------------------------
PREFIX = [(i * 11 + 5) % 240 + 4 for i in range(160)]  # ten pages of 16
PREFIX_ON = PlacementConfig(prefix_min_workers=1, prefix_min_tokens=64, placed_deadline=1.0)


@pytest.fixture
async def placing(nats_server, tiny_model_dir: Path) -> AsyncIterator[Gateway]:
    gw = Gateway(nats_server.url, tiny_model_dir.name, streams.BrokerConfig(), placement=PREFIX_ON)
    await gw.start()
    yield gw
    await gw.stop()


async def cached_on_one(workers: Any, gw: Gateway, tiny_model_dir: Path) -> tuple[Any, Any]:
    """Two prefill workers and a decode worker; the prefix computed once (placed on the
    worker caching least: nobody caches it yet). Returns (the worker that holds it, the other)."""
    a = await workers("prefill", prefix_placement=True)
    b = await workers("prefill", prefix_placement=True)
    await workers("decode", prefix_placement=True)
    await until(lambda: len(gw.placeable) == 2 and len(gw.decoders) == 1)
    tokens, seen = await run(gw, [*PREFIX, 1, 2, 3], 8, "first")
    assert tokens == reference(tiny_model_dir, [*PREFIX, 1, 2, 3], 8)
    holder, other = (a, b) if seen[0] == a.worker_id else (b, a)
    await until(lambda: gw.index.matches(tuple(PREFIX)).get(holder.worker_id, 0) == len(PREFIX))
    assert gw.metrics.placed_by_path["placed"] == 1 and holder.counters["placed_taken"] == 1
    return holder, other


async def test_a_request_goes_to_the_worker_that_caches_its_prefix(
    workers, placing: Gateway, tiny_model_dir: Path
) -> None:
    holder, other = await cached_on_one(workers, placing, tiny_model_dir)
    cached_before = holder.engine.stats.cached_tokens
    prompt = [*PREFIX, 9, 8, 7, 6]
    tokens, seen = await run(placing, prompt, 16, "second")
    assert tokens == reference(tiny_model_dir, prompt, 16)
    assert seen[0] == holder.worker_id
    assert placing.metrics.placed_by_path["placed"] == 2 and placing.stats.placement_fallbacks == 0
    assert holder.counters["placed_taken"] == 2
    assert holder.engine.stats.cached_tokens - cached_before == len(PREFIX)
    assert other.engine.stats.prompt_tokens == 0


async def test_auto_places_only_while_two_prefill_workers_serve(nats_server, workers, tiny_model_dir: Path) -> None:
    """`--prefix-aware-placement auto` (the default): with one prefill worker every request
    takes the shared queue (it reaches that worker anyway), though the worker's announcements
    fill the index; once a second one serves, a cached prefix is placed on its holder."""
    auto = PlacementConfig(prefix_min_tokens=64, placed_deadline=1.0)  # the default: at least two workers
    gw = Gateway(nats_server.url, tiny_model_dir.name, streams.BrokerConfig(), placement=auto)
    await gw.start()
    try:
        a = await workers("prefill", prefix_placement=True)
        await workers("decode", prefix_placement=True)
        await until(lambda: len(gw.placeable) == 1 and len(gw.decoders) == 1)
        for i, tail in enumerate(([1, 2, 3], [9, 8, 7, 6])):
            tokens, seen = await run(gw, [*PREFIX, *tail], 8, f"one-{i}")
            assert tokens == reference(tiny_model_dir, [*PREFIX, *tail], 8) and seen[0] == a.worker_id
            await until(lambda: gw.index.matches(tuple(PREFIX)).get(a.worker_id, 0) == len(PREFIX))
        assert gw.metrics.placed_by_path.get("placed", 0) == 0 and a.counters["placed_taken"] == 0
        assert a.engine.stats.cached_tokens == len(PREFIX)  # the second found the first's pages
        b = await workers("prefill", prefix_placement=True)
        await until(lambda: len(gw.placeable) == 2)
        tokens, seen = await run(gw, [*PREFIX, 4, 4], 8, "two")
        assert tokens == reference(tiny_model_dir, [*PREFIX, 4, 4], 8) and seen[0] == a.worker_id
        assert gw.metrics.placed_by_path["placed"] == 1 and a.counters["placed_taken"] == 1
        assert b.engine.stats.prompt_tokens == 0
    finally:
        await gw.stop()


async def test_a_busy_worker_s_placed_request_falls_back_to_the_shared_queue_and_runs_once(
    workers, placing: Gateway, tiny_model_dir: Path
) -> None:
    holder, other = await cached_on_one(workers, placing, tiny_model_dir)
    room = holder.room_for_requests
    holder.room_for_requests = lambda: 0  # busy: it fetches nothing
    await asyncio.sleep(holder.config.fetch_timeout + 0.5)  # the pulls it had open (it had room) expire
    prompt = [*PREFIX, 4, 4, 4]
    tokens, seen = await run(placing, prompt, 16, "busy")
    assert tokens == reference(tiny_model_dir, prompt, 16)
    assert seen[0] == other.worker_id
    assert placing.metrics.placed_by_path["placed"] == 2 and placing.stats.placement_fallbacks == 1
    computed = holder.engine.stats.prompt_tokens
    holder.room_for_requests = room  # free again: its placed copy was withdrawn, nothing runs twice
    holder.intake.room_freed.set()
    await asyncio.sleep(1.5)
    assert holder.engine.stats.prompt_tokens == computed and holder.counters["placed_taken"] == 1


async def test_a_dead_worker_s_placed_request_falls_back_to_the_shared_queue(
    workers, kill, placing: Gateway, tiny_model_dir: Path
) -> None:
    holder, other = await cached_on_one(workers, placing, tiny_model_dir)
    await kill(holder)  # still in the registry (and the index) until its entry expires
    assert holder.worker_id in placing.placeable
    prompt = [*PREFIX, 5, 5]
    tokens, seen = await run(placing, prompt, 16, "dead")
    assert tokens == reference(tiny_model_dir, prompt, 16)
    assert seen[0] == other.worker_id
    assert placing.stats.placement_fallbacks == 1 and placing.stats.migrations == 0


def test_pdserve_up_places_with_its_own_broker_s_permissions(
    tmp_path: Path, tiny_model_dir: Path, system_control: Any
) -> None:
    """Both flags through `pdserve up` with its embedded broker (a user per role): the
    workers' KV events reach the API, a repeated prefix is placed, a short prompt is
    prefilled on the decode worker, and no permission is refused."""
    import httpx

    start_system, stop_system = system_control
    system = start_system(
        tmp_path, tiny_model_dir, None, "--prefix-aware-placement", "--conditional-disagg", "--prefix-min-tokens", "64"
    )
    try:
        # The API learns which workers can take placed requests from its load reading (every
        # refresh_seconds), which may come after /health answers: until then a first prefix
        # goes to the shared queue. Wait for the workers' listing, then for one reading.
        deadline = time.monotonic() + 30
        while not any(w["role"] == "prefill" for w in httpx.get(system.url + "/workers", timeout=10).json()):
            assert time.monotonic() < deadline, "the prefill worker never registered"
            time.sleep(0.2)
        time.sleep(2 * PlacementConfig().refresh_seconds)
        body = {"sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        for i in range(3):
            r = httpx.post(system.url + "/generate", json={"input_ids": [*PREFIX, i + 1], **body}, timeout=60)
            assert r.status_code == 200, r.text
            time.sleep(0.5)  # the KV events of the first reach the API
        r = httpx.post(system.url + "/generate", json={"input_ids": SHORT, **body}, timeout=60)
        assert r.status_code == 200, r.text
        metrics = httpx.get(system.url + "/metrics", timeout=10).text
        assert 'pdserve_placement_decisions_total{path="placed"} 3.0' in metrics, metrics[:2000]
        assert 'pdserve_placement_decisions_total{path="local"} 1.0' in metrics
        assert "permissions violation" not in system.log()
    finally:
        stop_system(system)


async def test_a_placed_request_whose_worker_dies_after_taking_it_moves_on(
    workers, kill, placing: Gateway, tiny_model_dir: Path
) -> None:
    """The holder claims the request and dies at its first word: the claim keeps the API
    from moving it to the shared queue a second time, and the request still completes (the
    decode worker computes the prompt when the dead holder's KV cannot be leased, or the
    API's stall timeout moves it on, whichever the kill caught)."""
    holder, other = await cached_on_one(workers, placing, tiny_model_dir)
    placing.stall_timeout = 1.5
    prompt = [*PREFIX, 6, 6, 6]

    async def on_chunk(tokens: list[int], chunk: TokenChunk) -> None:
        if chunk.worker_id == holder.worker_id and not holder.stopped.is_set():
            await kill(holder)  # at its first word (the alive chunk): it holds the claim

    tokens, seen = await run(placing, prompt, 16, "claimed-then-dead", on_chunk)
    assert tokens == reference(tiny_model_dir, prompt, 16)
    assert seen[0] == holder.worker_id and holder.worker_id not in seen[1:]
    assert holder.counters["placed_taken"] == 2 and placing.stats.placement_fallbacks == 0
    assert other.counters["placed_taken"] == 0
