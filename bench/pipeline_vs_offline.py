"""The whole pipeline against the same engine offline, on the same work, in one run.

Offline: the engine in this process runs the seeded mixed workload (prompts 16-1024,
outputs 16-256, greedy, fixed lengths) with ``--concurrency`` requests in flight.
Pipeline: ``pdserve up`` (PD: 1 prefill + 1 decode; unified: 1 worker) serves the same
requests over HTTP -> NATS -> workers (-> Mooncake) with the same concurrency. The
ratio is pipeline output tokens/s over offline output tokens/s.

    python bench/pipeline_vs_offline.py --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import start_pdserve, stop_pdserve
from engine_bench import Request, run_pdserve, workload

from pdserve.engine.config import EngineConfig
from pdserve.engine.loader import build_engine
from pdserve.engine.tiny_model import ensure_default_model


async def through_http(url: str, reqs: list[Request], concurrency: int) -> tuple[float, list[float]]:
    pending = list(reqs)
    ttfts: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(r: Request) -> None:
            body = {
                "input_ids": r.prompt,
                "stream": True,
                "sampling_params": {"max_new_tokens": r.output_len, "temperature": 0, "ignore_eos": True},
            }
            started = time.perf_counter()
            first = None
            async with client.stream("POST", "/generate", json=body) as resp:
                assert resp.status_code == 200, await resp.aread()
                async for line in resp.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - started
            ttfts.append(first or 0.0)

        async def lane() -> None:
            while pending:
                await one(pending.pop(0))

        started = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return time.perf_counter() - started, ttfts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--modes", default="pd,unified")
    parser.add_argument("--repeat", type=int, default=3, help="offline/pipeline pairs per mode (default: %(default)s)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--up-args", default="", help='extra `pdserve up` flags, e.g. "--num-threads 2"')
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="pdserve-pipe-"))
    model = ensure_default_model(data_dir)
    reqs = workload(args.requests, 1000 + args.concurrency, 4000, 16, 1024, 16, 256)
    useful = sum(r.output_len for r in reqs)
    engine = build_engine(model, EngineConfig(max_total_tokens=300_000, max_num_seqs=256))
    run_pdserve(engine, workload(2, 99, 4000, 16, 64, 4, 8), 2)

    def offline() -> float:
        tps = useful / run_pdserve(engine, reqs, args.concurrency)
        engine.pages.reset_prefix_cache()  # the next pass must not start warm
        return tps

    result: dict[str, object] = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "output_tokens": useful,
        "repeat": args.repeat,
    }
    for mode in args.modes.split(","):
        proc, url = start_pdserve(
            mode, data_dir, ["--unified-workers", "1", "--max-running-requests", "256", *args.up_args.split()]
        )
        pairs = []
        try:
            asyncio.run(through_http(url, workload(4, 7, 4000, 16, 64, 4, 8), 4))  # warm-up
            for _ in range(args.repeat):  # offline and pipeline back to back: pairs share the machine's mood
                base = offline()
                seconds, ttfts = asyncio.run(through_http(url, reqs, args.concurrency))
                ttfts.sort()
                pairs.append((base, useful / seconds, ttfts[len(ttfts) // 2]))
                print(f"{mode}: offline {base:,.0f}, pipeline {useful / seconds:,.0f} output tok/s", file=sys.stderr)
        finally:
            stop_pdserve(proc)
        ratios = sorted(p / b for b, p, _ in pairs)
        result[mode] = {
            "offline_out_tok_s": [b for b, _, _ in pairs],
            "pipeline_out_tok_s": [p for _, p, _ in pairs],
            "ttft_p50_s": [t for _, _, t in pairs],
            "median_ratio": ratios[len(ratios) // 2],
        }
        print(f"{mode}: median pipeline/offline {ratios[len(ratios) // 2]:.2f}x", file=sys.stderr)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
