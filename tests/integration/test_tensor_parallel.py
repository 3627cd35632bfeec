"""Tensor-parallel workers end to end: ``pdserve up`` with prefill on 1 rank and decode on
2, then the other way round (real worker processes, their ranks over gloo, a real
nats-server, Mooncake between the ranks' pools). Greedy output equals ``transformers``
token for token; every prompt's KV was pulled (each decode rank reading exactly its KV
heads from the prefill rank(s) holding them), none recomputed; a clean stop ends every rank."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.reference import assert_greedy_equal
from tests.integration.conftest import start_system, stop_system

pytestmark = pytest.mark.slow

NEW = 10


def prompts() -> list[list[int]]:
    """Lengths around the 16-token page edges; two share their first 32 tokens, so the
    second pull skips the pages the decode worker has cached."""
    rng = random.Random(23)
    shared = [rng.randrange(3, 4000) for _ in range(32)]
    cases = [[rng.randrange(3, 4000) for _ in range(n)] for n in (5, 17, 63)]
    return cases + [shared + [rng.randrange(3, 4000) for _ in range(n)] for n in (9, 20)]


async def generate(url: str, prompt: list[int]) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


async def workers_after(url: str, pulls: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for _ in range(40):
            by_role = {w["role"]: w for w in (await client.get("/workers")).json()}
            if by_role.get("decode", {}).get("counters", {}).get("kv_pulls", 0) >= pulls:
                return by_role
            await asyncio.sleep(0.25)
    raise AssertionError(f"the registry never showed {pulls} pulls: {by_role}")


@pytest.fixture(scope="module")
def reference(mixing_model_dir: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(mixing_model_dir).eval()
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts()
        ]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
async def test_greedy_across_tp_sizes_equals_transformers(
    prefill_tp: int, decode_tp: int, mixing_model_dir: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    from pdserve.broker.server import start_nats_server

    server = start_nats_server(tmp_path / "nats")
    system = start_system(
        tmp_path,
        mixing_model_dir,
        server.url,
        "--prefill-tensor-parallel-size",
        str(prefill_tp),
        "--decode-tensor-parallel-size",
        str(decode_tp),
    )
    try:
        cases = prompts()
        got = list(await asyncio.gather(*(generate(system.url, p) for p in cases[:-1])))
        got.append(await generate(system.url, cases[-1]))  # after its prefix's twin: cached pages skipped
        by_role = await workers_after(system.url, len(cases))
    finally:
        stop_system(system)
        server.stop()
    model = AutoModelForCausalLM.from_pretrained(mixing_model_dir).eval()
    assert_greedy_equal(model, cases, got, reference)
    assert len({tuple(g) for g in got}) == len(got)  # the outputs depend on the whole context
    decode, prefill = by_role["decode"], by_role["prefill"]
    assert (prefill["tp_size"], decode["tp_size"]) == (prefill_tp, decode_tp)
    assert decode["kv_layout"]["num_kv_heads"] == 2 // decode_tp
    counters = decode["counters"]
    assert counters["kv_pulls"] == len(cases)
    assert counters["recomputes"] == counters["kv_pull_failures"] == 0
    # Each pulled page costs one read per (layer, K|V) and per prefill rank it draws from: 4 layers.
    assert counters["kv_pull_ops"] % 8 == 0 and counters["kv_pull_ops"] > 0
    log = system.log()
    assert log.count("tensor-parallel rank stopped") == 1, log[-3000:]
    assert "exited with status" not in log
