"""`pdserve up --autoscale` as users run it: its embedded nats-server (users and permissions
on), real worker processes, the tiny model. A backlog of long prompts scales the prefill
pool out; idle scales it back in, the retired worker draining while requests keep coming;
no request fails."""

from __future__ import annotations

import asyncio
import random
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

FLAGS = (
    "--autoscale",
    "--min-prefill",
    "1",
    "--max-prefill",
    "2",
    "--min-decode",
    "1",
    "--max-decode",
    "1",
    "--prefill-lag-threshold",
    "4",
    "--scale-down-window",
    "8",
    "--scale-up-cooldown",
    "2",
    "--num-threads",
    "1",
)


def desired(metrics: str, role: str) -> float | None:
    found = re.search(rf'^pdserve_desired_replicas{{role="{role}"}} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else None


def both_computed(metrics: str) -> bool:
    """Two prefill workers report prompt tokens, each some (counts come with heartbeats)."""
    computed = re.findall(r'^pdserve_prompt_tokens_total{role="prefill",worker="[^"]+"} (\S+)$', metrics, re.M)
    return len(computed) == 2 and all(float(n) > 0 for n in computed)


async def prefill_workers(client: httpx.AsyncClient) -> int:
    r = await client.get("/workers")
    return sum(1 for w in r.json() if w["role"] == "prefill")


async def generate(client: httpx.AsyncClient, rng: random.Random, prompt_len: int, new: int) -> int:
    body = {
        "input_ids": [rng.randrange(3, 4000) for _ in range(prompt_len)],
        "sampling_params": {"max_new_tokens": new, "ignore_eos": True},
    }
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == new
    return new


async def test_a_backlog_scales_prefill_out_and_idle_scales_it_in_with_a_drain(
    system_control: tuple[Any, Any], tmp_path: Path, tiny_model_dir: Path
) -> None:
    start_system, stop_system = system_control
    system = start_system(tmp_path, tiny_model_dir, None, *FLAGS)
    rng = random.Random(14)
    try:
        async with httpx.AsyncClient(base_url=system.url, timeout=180) as client:
            metrics = (await client.get("/metrics")).text
            assert desired(metrics, "prefill") == 1.0 and desired(metrics, "decode") == 1.0, metrics
            assert await prefill_workers(client) == 1

            # A burst: 80 prompts of 1,000 tokens at once (20 prefill replicas' worth of lag,
            # 10-20 s of one prefill worker's time here). The backlog is kept at least 24
            # prompts deep until the new worker registers (its start takes as long as the
            # burst on a slow machine) and has computed some of it (the first worker may take
            # every prompt waiting when the second registers, and finish them first).
            burst = [asyncio.create_task(generate(client, rng, 1000, 8)) for _ in range(80)]
            scaled_out_at = None
            began = time.monotonic()
            while scaled_out_at is None and time.monotonic() - began < 60:
                if desired((await client.get("/metrics")).text, "prefill") == 2.0:
                    scaled_out_at = time.monotonic() - began
                await asyncio.sleep(0.25)
            assert scaled_out_at is not None, system.log()
            while not both_computed((await client.get("/metrics")).text):  # registered, then took work
                assert time.monotonic() - began < 150, system.log()
                pending = sum(1 for t in burst if not t.done())
                burst += [asyncio.create_task(generate(client, rng, 1000, 8)) for _ in range(24 - pending)]
                await asyncio.sleep(0.5)
            assert sum(await asyncio.gather(*burst)) == len(burst) * 8
            # Each worker's count comes with its heartbeat: wait until both have reported it all.
            while True:
                computed = re.findall(
                    r'^pdserve_prompt_tokens_total{role="prefill",worker="[^"]+"} (\S+)$',
                    (await client.get("/metrics")).text,
                    re.M,
                )
                if sum(float(n) for n in computed) >= len(burst) * 1000 or time.monotonic() - began > 150:
                    break
                await asyncio.sleep(0.5)
            assert len(computed) == 2 and all(float(n) > 0 for n in computed), "the new worker took part of the backlog"

            # Idle (but for a trickle of short requests, which a draining worker may hold):
            # back to one prefill worker, the other retired and drained.
            trickle: list[asyncio.Task[int]] = []
            began = time.monotonic()
            while "retired worker exited" not in system.log():
                assert time.monotonic() - began < 120, system.log()
                trickle.append(asyncio.create_task(generate(client, rng, 24, 16)))
                await asyncio.sleep(0.5)
            assert sum(await asyncio.gather(*trickle)) == 16 * len(trickle)
            while await prefill_workers(client) != 1:  # it left the registry
                assert time.monotonic() - began < 150, system.log()
                await asyncio.sleep(0.5)
            metrics = (await client.get("/metrics")).text
            assert desired(metrics, "prefill") == 1.0
            assert 'pdserve_requests_finished_total{outcome="error"} 0.0' in metrics
    finally:
        stop_system(system)
    log = system.log()
    assert "scaling prefill 1 -> 2" in log and "scaling prefill 2 -> 1" in log
    assert re.search(r"retired worker exited role=prefill index=\d+ code=0 ", log), log
    assert "child process exited; restarting" not in log and "CRITICAL" not in log


def test_pdserve_autoscale_runs_the_pools_against_a_broker_of_ones_own(
    nats_server: Any, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`pdserve autoscale`: workers only, against an external nats-server; its own /metrics;
    SIGTERM drains the workers and exits 0."""
    import os
    import signal
    import subprocess
    import sys

    log_path = tmp_path / "autoscale.log"
    argv = [sys.executable, "-m", "pdserve", "autoscale", "--nats-url", nats_server.url]
    argv += ["--model-path", str(tiny_model_dir), "--data-dir", str(tmp_path / "data"), "--metrics-port", "0"]
    argv += ["--heartbeat-seconds", "0.5", "--num-threads", "1", "--max-prefill", "1", "--max-decode", "1"]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            found = re.search(r"autoscale metrics url=(\S+)", log_path.read_text())
            if found:
                url = found.group(1)
                text = httpx.get(url, timeout=5).text
                if "worker ready" in log_path.read_text() and desired(text, "prefill") == 1.0:
                    break
            time.sleep(0.5)
        assert url is not None, log_path.read_text()
        text = httpx.get(url, timeout=5).text
        assert desired(text, "prefill") == 1.0 and desired(text, "decode") == 1.0, text
        while log_path.read_text().count("worker ready") < 2:
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    log = log_path.read_text()
    assert code == 0, log
    assert log.count("worker stopped") == 2, log
