"""KV tiers in real workers over NATS and Mooncake: a restarted prefill worker serves a
prompt it saw before its restart from the disk tier, with the same greedy output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.api.gateway import Gateway
from pdserve.broker import streams
from pdserve.engine.config import EngineConfig, KVTierConfig
from pdserve.schemas import SamplingParams
from tests.integration.test_workers import reference

pytestmark = pytest.mark.slow


async def test_a_restarted_prefill_worker_serves_a_repeated_prompt_from_disk(
    workers, nats_server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = EngineConfig(
        max_total_tokens=16 * 512, kv_tiers=KVTierConfig(disk_dir=str(tmp_path), group_pages=4, load="always")
    )
    prefill = await workers("prefill", engine=engine)
    await workers("decode")
    gateway = Gateway(nats_server.url, tiny_model_dir.name, streams.BrokerConfig())
    await gateway.start()
    prompt = [random.Random(3).randrange(3, 4000) for _ in range(300)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

    async def generate(rid: str) -> list[int]:
        tokens: list[int] = []
        async for chunk in gateway.generate(prompt, params, rid=rid):
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                break
        return tokens

    try:
        first = await generate("before")
        assert prefill.engine.stats.cached_tokens == 0
        await prefill.shutdown()  # its teardown finishes the queued disk writes
        restarted = await workers("prefill", engine=engine)
        again = await generate("after")
        assert first == again == reference(tiny_model_dir, prompt, 8)
        assert restarted.engine.tiers is not None
        disk = restarted.engine.tiers.stats.tiers["disk"]
        assert disk.hit_pages == 300 // 16 // 4 * 4 and disk.corrupt == 0
        assert restarted.engine.stats.cached_tokens == disk.hit_pages * 16
        text = restarted.metrics.exposition().decode()
        assert f'tier="disk",worker="{restarted.worker_id}"}} {disk.hit_pages}.0' in text
    finally:
        await gateway.stop()
