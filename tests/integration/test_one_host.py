"""`pdserve up` on one CPU host, with its embedded broker: KV moves through /dev/shm (the
``shm`` backend), so no process of it listens beyond loopback; the workers take turns at the
cores; greedy equals transformers."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.workers.listening import listening_ports

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_host(tmp_path_factory: pytest.TempPathFactory, mixing_model_dir: Path, system_control: Any) -> Iterator[Any]:
    start, stop = system_control
    system = start(tmp_path_factory.mktemp("one-host"), mixing_model_dir, None)
    yield system
    stop(system)


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net shows them


async def test_kv_moves_through_shared_memory_and_nothing_listens_beyond_loopback(one_host: Any) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in (9, 70, 200, 333)]
    async with httpx.AsyncClient(base_url=one_host.url, timeout=120) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    "/generate",
                    json={
                        "input_ids": p,
                        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
                    },
                )
                for p in prompts
            )
        )
        for _ in range(80):  # the registry entries' counters and stats follow at each worker's next heartbeat
            seen = (await client.get("/workers")).json()
            decode = next(w for w in seen if w["role"] == "decode")["counters"]
            if decode["kv_pulls"] >= len(prompts) and all(w["stats"]["steps"] > 0 for w in seen):
                break
            await asyncio.sleep(0.25)
    model = AutoModelForCausalLM.from_pretrained(one_host.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for p, r in zip(prompts, replies, strict=True):
            ref = model.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
            assert r.json()["output_ids"] == ref[0, len(p) :].tolist()
    assert {w["transfer_backend"] for w in seen} == {"shm"}
    # by default the two CPU workers take turns at the cores: each step waited for the lock
    assert all(w["stats"]["turn_wait_seconds"] > 0 for w in seen), [w["stats"] for w in seen]
    assert decode["kv_pulls"] >= len(prompts) and decode["recomputes"] == 0 and decode["kv_pull_failures"] == 0
    pids = {w["pid"] for w in seen} | {one_host.process.pid}
    sockets = [address for pid in pids for address in listening_ports(pid).values()]
    assert sockets, "the API and the broker listen"
    assert all(address in LOOPBACK for address in sockets), sockets
