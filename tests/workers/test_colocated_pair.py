"""The two workers of a co-located process live and die as one (real NATS, real engines)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.loader import build_engine
from pdserve.workers.colocated import role_configs, serve_together
from pdserve.workers.config import WorkerConfig
from pdserve.workers.decode import DecodeWorker
from pdserve.workers.lifecycle import WorkerCrashed
from pdserve.workers.prefill import PrefillWorker


async def test_a_failed_task_in_one_worker_stops_both_and_the_process_fails(
    nats_server: Any, tiny_model_dir: Path
) -> None:
    base = WorkerConfig(
        role="prefill",
        model_path=tiny_model_dir,
        model_name=tiny_model_dir.name,
        nats_url=nats_server.url,
        engine=EngineConfig(max_total_tokens=16 * 256),
        heartbeat_seconds=0.5,
    )
    prefill_cfg, decode_cfg = role_configs(base, "pair-1")
    assert (prefill_cfg.worker_id, decode_cfg.worker_id) == ("pair-1-prefill", "pair-1-decode")
    assert prefill_cfg.transfer_backend == decode_cfg.transfer_backend == "local"
    assert prefill_cfg.engine.cuda_graph_max_batch == 0  # prefill never decodes
    prefill_engine = build_engine(tiny_model_dir, prefill_cfg.engine)
    decode_engine = build_engine(tiny_model_dir, decode_cfg.engine, model=prefill_engine.runner.model)
    prefill, decode = PrefillWorker(prefill_cfg, prefill_engine), DecodeWorker(decode_cfg, decode_engine)
    serving = asyncio.create_task(serve_together([prefill, decode]))
    registered: set[str] = set()
    for _ in range(200):  # both start, then both are in the registry
        assert not serving.done()
        if decode.transfer is not None:
            registered = {w.worker_id for w in await prefill.lifecycle.workers()}
            if len(registered) == 2:
                break
        await asyncio.sleep(0.05)
    assert registered == {"pair-1-prefill", "pair-1-decode"}
    decode.lifecycle.crash("a decode task", RuntimeError("boom"))  # what a failed supervised task does
    with pytest.raises(WorkerCrashed, match="boom"):
        await asyncio.wait_for(serving, 30)
    assert prefill.stopped.is_set() and decode.stopped.is_set()
    assert prefill.lifecycle.crashed is not None  # the healthy half went down with it
