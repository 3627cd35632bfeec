"""``pdserve up --colocate``: a prefill and a decode worker in one process (two engine
threads on the CPU), KV handed over in place; greedy equals transformers, and a kill -9 of
the process mid-stream loses nothing."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory, mixing_model_dir: Path, system_control: Any) -> Iterator[Any]:
    start, stop = system_control
    system = start(tmp_path_factory.mktemp("colocated"), mixing_model_dir, None, "--colocate", "--stall-timeout", "3")
    yield system
    stop(system)


def reference(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return list(out[0, len(prompt) :].tolist())


async def workers(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.get("/workers")
        r.raise_for_status()
        return list(r.json())


async def test_one_process_holds_both_roles_and_greedy_equals_transformers(colocated: Any) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in (7, 33, 120, 250, 400)]
    new = [24, 16, 30, 12, 20]
    async with httpx.AsyncClient(base_url=colocated.url, timeout=120) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    "/generate",
                    json={
                        "input_ids": p,
                        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
                    },
                )
                for p, n in zip(prompts, new, strict=True)
            )
        )
    for p, n, r in zip(prompts, new, replies, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == reference(colocated.model_dir, p, n)
    for _ in range(40):  # the registry entries' counters follow at the next heartbeat
        seen = await workers(colocated.url)
        roles = {w["role"]: w for w in seen}
        if roles.get("decode", {}).get("counters", {}).get("kv_pulls", 0) >= len(prompts):
            break
        await asyncio.sleep(0.25)
    assert set(roles) == {"prefill", "decode"}
    assert roles["prefill"]["pid"] == roles["decode"]["pid"]  # one process
    assert {w["transfer_backend"] for w in seen} == {"local"}
    assert all(w["transfer_endpoint"].startswith("local:") for w in seen)
    counters = roles["decode"]["counters"]
    # The normal path: every prompt's KV pulled in place, none recomputed, no fallback.
    assert counters["kv_pulls"] >= len(prompts)
    assert counters["recomputes"] == 0 and counters["kv_pull_failures"] == 0 and counters["kv_leases_refused"] == 0


async def test_samples_share_the_prompt_and_a_cancel_frees_both_pools(colocated: Any) -> None:
    prompt = [11, 22, 33, 44, 55, 66, 77, 88, 99]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "n": 2, "ignore_eos": True},
    }
    async with httpx.AsyncClient(base_url=colocated.url, timeout=60) as client:
        r = await client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        samples = r.json()
        assert len(samples) == 2 and samples[0]["output_ids"] == samples[1]["output_ids"]
        assert samples[0]["output_ids"] == reference(colocated.model_dir, prompt, 12)
        long = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        seen = 0
        async with client.stream("POST", "/generate", json=long) as stream:
            async for line in stream.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 5:
                    break  # the client goes: the API cancels
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            now = await workers(colocated.url)
            if all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in now):
                break
            await asyncio.sleep(0.2)
        assert all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in now), now
    assert "request cancelled" in colocated.log()


async def test_structured_output_and_the_prefix_cache_work_through_the_pair(colocated: Any) -> None:
    regex = r"(red|green|blue)-[0-9]{3}"
    body = {"text": "Pick:", "sampling_params": {"max_new_tokens": 30, "temperature": 1.0, "regex": regex, "n": 3}}
    prompt = [(13 * i) % 3000 + 5 for i in range(96)]  # six full pages
    again = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=colocated.url, timeout=60) as client:
        r = await client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert all(re.fullmatch(regex, o["text"]) for o in r.json())
        first = (await client.post("/generate", json=again)).json()
        second = (await client.post("/generate", json=again)).json()
    assert first["output_ids"] == second["output_ids"] == reference(colocated.model_dir, prompt, 4)
    assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] >= 80


async def test_kill_9_of_the_process_mid_stream_loses_no_token(colocated: Any) -> None:
    prompt = [5, 17, 260, 3001, 42, 99, 7]
    n = 600
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    pid = (await workers(colocated.url))[0]["pid"]
    got: list[int] = []
    killed = False
    async with httpx.AsyncClient(base_url=colocated.url, timeout=180) as client:
        async with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = orjson.loads(line[len("data: ") :])
                assert "error" not in event, event
                got = list(event["output_ids"])
                if not killed and len(got) >= 20:
                    os.kill(pid, signal.SIGKILL)  # both roles go at once
                    killed = True
    assert killed, "the request finished before the kill: make it longer"
    assert got == reference(colocated.model_dir, prompt, n)
    deadline = time.monotonic() + 60  # the supervisor restarted the pair
    while time.monotonic() < deadline:
        now = await workers(colocated.url)
        if {w["role"] for w in now} == {"prefill", "decode"} and all(w["pid"] != pid for w in now):
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"the pair did not come back: {now}")
