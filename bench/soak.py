"""Memory soak: thousands of requests through `pdserve up`; resident memory and KV pages.

Starts the whole system (PD mode by default) on a free port, sends ``--requests``
requests with random prompt and output lengths at a fixed concurrency, samples each
worker's resident memory (VmRSS) and KV pages in use every ``--every`` requests,
then waits for idle and checks that the page pools are empty again. The trend is the
least-squares slope of RSS over the second half of the run (after warm-up), in MiB
per 1,000 requests.

    python bench/soak.py                     # 2,000 requests, concurrency 16
    python bench/soak.py --requests 500 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import start_pdserve, stop_pdserve


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


async def run(args: argparse.Namespace, url: str) -> dict[str, object]:
    rng = random.Random(args.seed)
    samples: list[dict[str, object]] = []
    done = 0
    errors = 0
    lock = asyncio.Lock()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        workers = (await client.get("/workers")).json()

        async def sample() -> None:
            listing = (await client.get("/workers")).json()
            samples.append(
                {
                    "requests": done,
                    "rss_mib": {w["role"] + ":" + str(w["pid"]): rss_mib(w["pid"]) for w in listing},
                    "pages_used": {w["role"]: w["pages_used"] for w in listing},
                }
            )

        async def one(i: int) -> None:
            nonlocal done, errors
            prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(16, 512))]
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": rng.randint(8, 64), "temperature": 0.8, "ignore_eos": True},
            }
            r = await client.post("/generate", json=body)
            async with lock:
                done += 1
                errors += r.status_code != 200
                if done % args.every == 0:
                    await sample()
                    print(f"\r{done}/{args.requests} requests, {errors} errors", end="", file=sys.stderr, flush=True)

        queue = list(range(args.requests))

        async def worker() -> None:
            while queue:
                await one(queue.pop())

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        seconds = time.perf_counter() - started
        print(file=sys.stderr)
        deadline = time.monotonic() + 30
        while True:
            listing = (await client.get("/workers")).json()
            if (
                all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in listing)
                or time.monotonic() > deadline
            ):
                break
            await asyncio.sleep(0.5)
        idle = {w["role"]: {"pages_used": w["pages_used"], "in_flight": w["requests_in_flight"]} for w in listing}
    trends = {}
    half = samples[len(samples) // 2 :]
    for key in samples[-1]["rss_mib"]:  # type: ignore[union-attr]
        xs = [s["requests"] / 1000 for s in half]  # type: ignore[operator]
        ys = [s["rss_mib"][key] for s in half]  # type: ignore[index]
        trends[key] = {"first_mib": samples[0]["rss_mib"][key], "last_mib": ys[-1], "slope_mib_per_1000": slope(xs, ys)}  # type: ignore[index]
    return {
        "requests": args.requests,
        "errors": errors,
        "seconds": seconds,
        "workers": [w["role"] for w in workers],
        "idle": idle,
        "rss": trends,
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--every", type=int, default=100, help="sample every N requests (default: %(default)s)")
    parser.add_argument("--mode", choices=["pd", "unified"], default="pd")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    proc, url = start_pdserve(args.mode, Path(tempfile.mkdtemp(prefix="pdserve-soak-")))
    try:
        result = asyncio.run(run(args, url))
    finally:
        stop_pdserve(proc)
    print(
        f"{result['requests']} requests in {result['seconds']:.0f}s, {result['errors']} errors; idle pools: {result['idle']}"
    )
    print("| worker | RSS after first 100 (MiB) | RSS at end (MiB) | trend over 2nd half (MiB / 1,000 requests) |")
    print("|---|---|---|---|")
    for key, t in result["rss"].items():  # type: ignore[union-attr]
        print(f"| {key.split(':')[0]} | {t['first_mib']:.0f} | {t['last_mib']:.0f} | {t['slope_mib_per_1000']:+.1f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
