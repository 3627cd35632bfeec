"""Several prefill and several decode workers behind one API (xPyD, here 2P2D), as `pdserve
up --prefill-workers 2 --decode-workers 2` runs them: every worker of each role takes part,
every decode worker reads KV from the prefill workers that computed it (Mooncake over TCP,
and gloo point to point with one link per pair), nothing is recomputed, and greedy output
equals `transformers`."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

PREFILL, DECODE = 2, 2
NEW_TOKENS = 6


async def generate(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


async def workers_by_role(client: httpx.AsyncClient) -> dict[str, list[dict[str, Any]]]:
    """The registry's entries by role, each with its engine's prompt tokens (``/dashboard/data``)."""
    prompt_tokens = {w["id"]: w["prompt_tokens"] for w in (await client.get("/dashboard/data")).json()["workers"]}
    by_role: dict[str, list[dict[str, Any]]] = {}
    for w in (await client.get("/workers")).json():
        by_role.setdefault(w["role"], []).append({**w, "prompt_tokens": prompt_tokens.get(w["id"], 0)})
    return by_role


def all_took_part(by_role: dict[str, list[dict[str, Any]]]) -> bool:
    return all(w["prompt_tokens"] > 0 for w in by_role.get("prefill", [])) and all(
        w["counters"]["kv_pulls"] > 0 for w in by_role.get("decode", [])
    )


@pytest.mark.parametrize("backend", ["mooncake", "gloo"])
async def test_two_prefill_and_two_decode_workers_all_serve_and_match_transformers(up: Any, backend: str) -> None:
    system = up(
        "--prefill-workers",
        str(PREFILL),
        "--decode-workers",
        str(DECODE),
        "--num-threads",
        "1",
        "--disaggregation-transfer-backend",
        backend,
    )
    rng = random.Random(f"xpyd-{backend}")
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    async with httpx.AsyncClient(base_url=system.url, timeout=180) as client:
        while len((await workers_by_role(client)).get("decode", [])) < DECODE:  # /health needs only one
            await asyncio.sleep(0.3)
        # Waves of concurrent prompts until every worker has worked (the pull decides who
        # takes what; a wave of 24 is usually enough), at most four waves.
        for _ in range(4):
            wave = [[rng.randrange(3, 4000) for _ in range(rng.randint(150, 500))] for _ in range(24)]
            outputs += await asyncio.gather(*(generate(client, p) for p in wave))
            prompts += wave
            await asyncio.sleep(1.2)  # two heartbeats carry the counters
            by_role = await workers_by_role(client)
            if all_took_part(by_role):
                break
    assert len(by_role["prefill"]) == PREFILL and len(by_role["decode"]) == DECODE
    assert all_took_part(by_role), by_role
    pulls = 0
    for w in by_role["decode"]:
        c = w["counters"]
        assert c["recomputes"] == 0 and c["kv_pull_failures"] == 0 and c["kv_leases_refused"] == 0, c
        assert c["kv_links_refused"] == 0 and c["migrations"] == 0, c
        if backend == "gloo":  # one communicator per prefill worker it read from, reused
            assert 1 <= c["kv_links_opened"] <= PREFILL, c
        pulls += c["kv_pulls"]
    assert pulls == len(prompts)
    if backend == "gloo":
        assert sum(w["counters"]["kv_sends"] for w in by_role["prefill"]) == len(prompts)

    model = AutoModelForCausalLM.from_pretrained(system.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for p, got in list(zip(prompts, outputs, strict=True))[:: max(len(prompts) // 12, 1)]:
            ref = model.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            assert got == ref[0, len(p) :].tolist()
