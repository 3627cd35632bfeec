"""``--kv-cache-dtype fp8`` through ``pdserve up`` (real prefill and decode worker processes, a
real nats-server, gloo between the two CPU page pools): FP8 pages with their scales move as
bytes, greedy output equals the offline engine's with an FP8 pool token for token, every prompt
arrives by one message over the link, none recomputed, in FP8 pages' bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_pool import page_bytes
from pdserve.engine.loader import build_engine
from tests.engine.reference import run
from tests.integration.conftest import System, start_system, stop_system
from tests.integration.test_p2p_pipeline import generate_all, prompts, workers_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp8_system(tmp_path_factory: pytest.TempPathFactory, mixing_model_dir: Path) -> Iterator[System]:
    from pdserve.broker.server import start_nats_server

    server = start_nats_server(tmp_path_factory.mktemp("nats-fp8"))
    system = start_system(
        tmp_path_factory.mktemp("fp8"),
        mixing_model_dir,
        server.url,
        "--disaggregation-transfer-backend",
        "gloo",
        "--kv-cache-dtype",
        "fp8",
    )
    yield system
    stop_system(system)
    server.stop()


async def test_fp8_pages_move_between_workers_and_greedy_equals_the_offline_fp8_engine(fp8_system: System) -> None:
    cases = prompts()
    got = await generate_all(fp8_system.url, cases[:-2], concurrent=True)
    got += await generate_all(fp8_system.url, cases[-2:], concurrent=False)
    config = EngineConfig(kv_cache_dtype="fp8_e4m3", max_total_tokens=4096)
    offline = build_engine(fp8_system.model_dir, config)
    layout = offline.runner.layout
    assert layout.dtype == "float8_e4m3fn/block"
    with torch.inference_mode():
        for (prompt, n), ids in zip(cases, got, strict=True):
            assert ids == run(offline, [prompt], n)[0]
    by_role = await workers_of(fp8_system.url, len(cases))
    pulled, pushed = by_role["decode"]["counters"], by_role["prefill"]["counters"]
    assert pulled["kv_pulls"] == len(cases) and pulled["recomputes"] == 0 and pulled["kv_links_refused"] == 0
    assert pushed["kv_send_bytes"] == pulled["kv_pull_bytes"] > 0
    assert pushed["kv_send_bytes"] % page_bytes(layout) == 0, "whole FP8 pages, scales inside"
    loaded = [line for line in fp8_system.log_path.read_text().splitlines() if "model loaded" in line]
    assert len(loaded) == 2 and all("kv_dtype=float8_e4m3fn/block" in line for line in loaded), loaded
