"""What a request's ``priority`` buys under a backlog: `pdserve up` with a small batch, a burst
of ordinary requests that keeps it full, and a few probe requests sent while the burst drains,
once with ``priority`` -1 and once with the default, in alternating order, a fresh seed a
round (every prompt new to the prefix cache: cold).

A round: ``--burst`` requests of ``--prompt-len`` random tokens and ``--burst-out`` output
tokens each, all at once (``/v1/completions``, streamed); after ``--probe-after`` seconds,
``--probes`` probe requests (``--probe-out`` tokens), one every ``--probe-every`` seconds. Per
round: the probes' time to first token and to their last token (in PD mode the first token
comes from the prefill pool, and the decode pool's queue shows in the latency), the burst's
mean latency and
the round's length (what the probes' priority costs the others), and the workers'
preemptions and prefix-cache hits (cached tokens: 0 in a cold round) from the API's ``/metrics``. Figures: medians over the rounds, and the median of
the pairs' ratios (priority against default, the same round seed).

    python bench/priority.py --json docs/data/priority_cpu.json
    python bench/priority.py --mode pd --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import git_commit, start_pdserve, stop_pdserve

VOCAB_LOW, VOCAB_HIGH = 3, 4000


async def one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int, priority: int) -> dict[str, float]:
    """A streamed completion: seconds to its first token and to its end."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "priority": priority,
    }
    began = time.perf_counter()
    first = None
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None and json.loads(line[6:])["choices"]:
                first = time.perf_counter() - began
    return {"ttft": first if first is not None else float("nan"), "latency": time.perf_counter() - began}


TOTALS = {
    "preemptions": "pdserve_engine_preemptions_total",
    "priority_preemptions": "pdserve_engine_priority_preemptions_total",
    "cached_tokens": "pdserve_prefix_cache_hit_tokens_total",  # (a cold run: 0)
}


async def worker_totals(http: httpx.AsyncClient) -> dict[str, float]:
    """The workers' preemptions and prefix-cache hits, summed, on the API's /metrics."""
    text = (await http.get("/metrics")).text
    totals = dict.fromkeys(TOTALS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, name in TOTALS.items():
                if sample.name == name:
                    totals[key] += sample.value
    return totals


async def round_(url: str, args: argparse.Namespace, seed: int, priority: int) -> dict[str, Any]:
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.prompt_len)]

    burst_prompts = [prompt() for _ in range(args.burst)]
    probe_prompts = [prompt() for _ in range(args.probes)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        before = await worker_totals(http)
        began = time.perf_counter()
        burst = [asyncio.create_task(one(http, p, args.burst_out, 0)) for p in burst_prompts]
        await asyncio.sleep(args.probe_after)
        probes = []
        for p in probe_prompts:
            probes.append(asyncio.create_task(one(http, p, args.probe_out, priority)))
            await asyncio.sleep(args.probe_every)
        probe_times = await asyncio.gather(*probes)
        burst_times = await asyncio.gather(*burst)
        length = time.perf_counter() - began
        await asyncio.sleep(1.2)  # two heartbeats: the workers' counters reach the registry
        after = await worker_totals(http)
    return {
        "seed": seed,
        "priority": priority,
        "probe_ttft_ms": [round(t["ttft"] * 1e3, 1) for t in probe_times],
        "probe_latency_ms": [round(t["latency"] * 1e3, 1) for t in probe_times],
        "probe_ttft_median_ms": round(statistics.median(t["ttft"] for t in probe_times) * 1e3, 1),
        "probe_latency_median_ms": round(statistics.median(t["latency"] for t in probe_times) * 1e3, 1),
        "burst_latency_mean_ms": round(statistics.fmean(t["latency"] for t in burst_times) * 1e3, 1),
        "round_s": round(length, 2),
        **{key: after[key] - before[key] for key in TOTALS},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="unified", choices=("unified", "pd"))
    p.add_argument("--rounds", type=int, default=3, help="pairs of rounds (priority -1 and default)")
    p.add_argument("--max-running", type=int, default=4, help="the workers' batch (--max-running-requests)")
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--burst-out", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--probes", type=int, default=6)
    p.add_argument("--probe-out", type=int, default=8)
    p.add_argument("--probe-after", type=float, default=0.5, help="seconds after the burst")
    p.add_argument("--probe-every", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one per run")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "commit": git_commit(),
        "seed": seed,
        "params": {k: str(v) for k, v in vars(args).items() if k != "json"},
        "rounds": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--max-running-requests", str(args.max_running)]
        if args.mode == "pd":
            extra += ["--prefill-workers", "1", "--decode-workers", "1"]
        proc, url = start_pdserve(args.mode, Path(tmp), extra, log_path=Path(tmp) / "up.log")
        try:
            for r in range(args.rounds):
                order = (-1, 0) if r % 2 == 0 else (0, -1)
                for priority in order:  # fresh prompts of the same lengths for each: a cold prefix cache
                    reading = asyncio.run(round_(url, args, seed + 1000 * r + (priority == -1), priority))
                    reading["pair"] = r
                    results["rounds"].append(reading)
                    print(json.dumps({k: v for k, v in reading.items() if not isinstance(v, list)}), flush=True)
        finally:
            stop_pdserve(proc)
    summary: dict[str, Any] = {}
    for name, priority in (("urgent", -1), ("default", 0)):
        mine = [r for r in results["rounds"] if r["priority"] == priority]
        summary[name] = {
            "probe_ttft_median_ms": statistics.median(r["probe_ttft_median_ms"] for r in mine),
            "probe_latency_median_ms": statistics.median(r["probe_latency_median_ms"] for r in mine),
            "burst_latency_mean_ms": statistics.median(r["burst_latency_mean_ms"] for r in mine),
            "round_s": statistics.median(r["round_s"] for r in mine),
            "preemptions": statistics.median(r["preemptions"] for r in mine),
            "cached_tokens": max(r["cached_tokens"] for r in mine),
        }
    pairs = [
        (
            next(r for r in results["rounds"] if r["pair"] == i and r["priority"] == -1),
            next(r for r in results["rounds"] if r["pair"] == i and r["priority"] == 0),
        )
        for i in range(args.rounds)
    ]
    summary["probe_ttft_ratio"] = round(
        statistics.median(u["probe_ttft_median_ms"] / d["probe_ttft_median_ms"] for u, d in pairs), 3
    )
    summary["probe_latency_ratio"] = round(
        statistics.median(u["probe_latency_median_ms"] / d["probe_latency_median_ms"] for u, d in pairs), 3
    )
    summary["burst_latency_ratio"] = round(
        statistics.median(u["burst_latency_mean_ms"] / d["burst_latency_mean_ms"] for u, d in pairs), 3
    )
    results["summary"] = summary
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
