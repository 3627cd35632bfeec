"""End to end with the point-to-point backend: ``pdserve up --disaggregation-transfer-backend
gloo`` (real worker processes, a real nats-server, torch.distributed's gloo between the two
CPU page pools: the protocol the nccl backend runs between GPUs). Greedy output equals
``transformers`` and the Mooncake pipeline token for token, and the counters show every
prompt arrived by one point-to-point message over one link, none recomputed."""

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

from tests.integration.conftest import System, start_system, stop_system

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gloo_system(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[System]:
    """1 prefill + 1 decode worker moving KV over gloo, on a broker of their own."""
    from pdserve.broker.server import start_nats_server

    server = start_nats_server(tmp_path_factory.mktemp("nats-gloo"))
    system = start_system(
        tmp_path_factory.mktemp("gloo"), tiny_model_dir, server.url, "--disaggregation-transfer-backend", "gloo"
    )
    yield system
    stop_system(system)
    server.stop()


def prompts() -> list[tuple[list[int], int]]:
    """Lengths around page edges (16 a page), and two prompts sharing 48 tokens, so that the
    second pull skips the pages the decode worker has cached and lands on split pages."""
    rng = random.Random(11)
    shared = [rng.randrange(3, 4000) for _ in range(48)]
    cases = [[rng.randrange(3, 4000) for _ in range(n)] for n in (5, 16, 17, 63, 130, 257)]
    cases += [shared + [rng.randrange(3, 4000) for _ in range(n)] for n in (9, 30)]
    return [(p, m) for p, m in zip(cases, (8, 20, 12, 16, 9, 14, 10, 11), strict=True)]


async def generate_all(url: str, cases: list[tuple[list[int], int]], concurrent: bool) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(prompt: list[int], n: int) -> list[int]:
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
            r = await client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return list(r.json()["output_ids"])

        if concurrent:
            return list(await asyncio.gather(*(one(p, n) for p, n in cases)))
        return [await one(p, n) for p, n in cases]


async def workers_of(url: str, pulls: int) -> dict[str, Any]:
    """The registry entries by role once the decode worker's heartbeat shows ``pulls``."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for _ in range(40):
            listing = (await client.get("/workers")).json()
            by_role = {w["role"]: w for w in listing}
            sent = by_role.get("prefill", {}).get("counters", {}).get("kv_sends", 0)
            if by_role.get("decode", {}).get("counters", {}).get("kv_pulls", 0) >= pulls and sent >= pulls:
                return by_role
            await asyncio.sleep(0.25)
    raise AssertionError(f"the registry never showed {pulls} pulls: {listing}")


async def test_greedy_through_gloo_equals_transformers_and_mooncake(gloo_system: System, pd_system: System) -> None:
    cases = prompts()
    # The shared-prefix pair goes last, one after the other, so the second finds the prefix cached.
    first = await generate_all(gloo_system.url, cases[:-2], concurrent=True)
    got = first + await generate_all(gloo_system.url, cases[-2:], concurrent=False)
    mooncake = await generate_all(pd_system.url, cases, concurrent=True)
    model = AutoModelForCausalLM.from_pretrained(gloo_system.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for (prompt, n), ids, other in zip(cases, got, mooncake, strict=True):
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            assert ids == ref[0, len(prompt) :].tolist()
            assert ids == other

    by_role = await workers_of(gloo_system.url, len(cases))
    decode, prefill = by_role["decode"], by_role["prefill"]
    assert decode["transfer_backend"] == decode["transfer_protocol"] == "gloo"
    assert prefill["transfer_backend"] == prefill["transfer_protocol"] == "gloo"
    pulled = decode["counters"]
    assert pulled["kv_pulls"] == len(cases) and pulled["kv_pull_ops"] == len(cases)  # one message each
    assert pulled["recomputes"] == 0 and pulled["kv_pull_failures"] == 0 and pulled["kv_leases_refused"] == 0
    assert pulled["kv_links_opened"] == 1 and pulled["kv_links_refused"] == 0  # one link, reused
    pushed = prefill["counters"]
    assert pushed["kv_sends"] == len(cases) and pushed["kv_send_failures"] == 0
    assert pushed["kv_send_bytes"] == pulled["kv_pull_bytes"] > 0
    assert pushed["kv_links_opened"] == 1
