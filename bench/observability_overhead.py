"""What tracing and metrics cost: the same pipeline with them on against off, cold.

Two `pdserve up` systems (PD: 1 prefill + 1 decode each) run side by side: "off" with no
``OTEL_*`` variables and nobody reading its metrics; "on" exporting every span over
OTLP/HTTP to a sink in this process (which counts what it receives) while this process
scrapes its ``/metrics`` and ``/dashboard/data`` every second. Each pair runs the same
requests on both systems (each meets them first: no prefix cache helps either side), off
first in even pairs and on first in odd ones, so each pair shares the machine's mood and
the draw of prompt lengths; every pair draws fresh requests (its own seed). The cached
prompt tokens the servers report are recorded. The figure is the median over pairs of
on/off output tokens per second.

    python bench/observability_overhead.py     # writes docs/data/observability_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import process_cpu_seconds, start_pdserve, stop_pdserve
from engine_bench import Request, workload
from pipeline_vs_offline import through_http

from pdserve.engine.tiny_model import ensure_default_model


class SpanSink:
    """An OTLP/HTTP endpoint that takes every export and counts requests and bytes."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.exports += 1
                sink.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


async def scraping(url: str, stop: asyncio.Event) -> int:
    """Read ``/metrics`` and ``/dashboard/data`` every second until ``stop``; how many rounds."""
    rounds = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            (await client.get("/metrics")).raise_for_status()
            (await client.get("/dashboard/data")).raise_for_status()
            rounds += 1
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
    return rounds


def measured(pid: int, url: str, reqs: list[Request], concurrency: int, scrape: bool) -> dict[str, Any]:
    """One run against the system of process ``pid``, with the CPU its processes spent per
    output token (the client's scraping not included): unlike throughput, that does not
    depend on what else the machine runs."""
    before = process_cpu_seconds(pid)
    result = asyncio.run(_measured(url, reqs, concurrency, scrape))
    after = process_cpu_seconds(pid)
    tokens = sum(r.output_len for r in reqs)
    result["cpu_us_per_out_token"] = {
        role: round((after[role] - before.get(role, 0.0)) / tokens * 1e6, 1) for role in sorted(after)
    }
    return result


async def _measured(url: str, reqs: list[Request], concurrency: int, scrape: bool) -> dict[str, Any]:
    stop = asyncio.Event()
    scraper = asyncio.create_task(scraping(url, stop)) if scrape else None
    seconds, ttfts, cached, _ = await through_http(url, reqs, concurrency)
    stop.set()
    rounds = await scraper if scraper is not None else 0
    ttfts.sort()
    return {
        "out_tok_s": sum(r.output_len for r in reqs) / seconds,
        "seconds": seconds,
        "cached_tokens": cached,
        "prompt_tokens": sum(len(r.prompt) for r in reqs),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "scrapes": rounds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=6, help="off/on pairs (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=5000, help="first workload seed; each pair takes the next")
    parser.add_argument("--json", type=Path, default=Path("docs/data/observability_overhead.json"))
    parser.add_argument("--up-args", default="", help='extra `pdserve up` flags, e.g. "--num-threads 1"')
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="pdserve-obs-"))
    model = ensure_default_model(data_dir)
    seeds = iter(range(args.seed, args.seed + 10_000))

    def fresh() -> list[Request]:
        return workload(args.requests, next(seeds), 4000, 16, 512, 16, 128)

    sink = SpanSink()
    up = ["--model-path", str(model), "--max-running-requests", "256", *args.up_args.split()]
    on_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url, "OTEL_SERVICE_NAME": "pdserve-bench"}
    off_proc, off_url = start_pdserve("pd", data_dir / "off", up, env={"OTEL_SDK_DISABLED": "true"})
    try:
        on_proc, on_url = start_pdserve("pd", data_dir / "on", up, env=on_env)
    except BaseException:
        stop_pdserve(off_proc)
        raise
    pairs = []
    try:
        for url in (off_url, on_url):  # warm-up: first forward passes, connections
            asyncio.run(through_http(url, workload(8, 7, 4000, 16, 64, 4, 8), 8))
        for i in range(args.repeat):
            # Both halves of a pair get the same requests (each server meets them first, so
            # both are cold) and take turns going first, so that neither the workload's draw
            # nor the machine's drift between the halves reads as overhead.
            reqs = fresh()
            exports = sink.exports
            if i % 2 == 0:
                off = measured(off_proc.pid, off_url, reqs, args.concurrency, scrape=False)
                on = measured(on_proc.pid, on_url, reqs, args.concurrency, scrape=True)
            else:
                on = measured(on_proc.pid, on_url, reqs, args.concurrency, scrape=True)
                off = measured(off_proc.pid, off_url, reqs, args.concurrency, scrape=False)
            on["span_exports"] = sink.exports - exports
            pairs.append({"off": off, "on": on, "ratio": on["out_tok_s"] / off["out_tok_s"]})
            print(
                f"CPU us per output token: off {off['cpu_us_per_out_token']}, on {on['cpu_us_per_out_token']}",
                file=sys.stderr,
            )
            print(
                f"off {off['out_tok_s']:,.0f}, on {on['out_tok_s']:,.0f} output tok/s "
                f"(ratio {pairs[-1]['ratio']:.3f}; cached prompt tokens {off['cached_tokens']} / "
                f"{on['cached_tokens']}; {on['span_exports']} span exports, {on['scrapes']} scrapes)",
                file=sys.stderr,
            )
    finally:
        stop_pdserve(on_proc)
        stop_pdserve(off_proc)
    cpu = {
        side: {
            role: statistics.median(p[side]["cpu_us_per_out_token"].get(role, 0.0) for p in pairs)
            for role in pairs[0][side]["cpu_us_per_out_token"]
        }
        for side in ("off", "on")
    }
    ratios = sorted(p["ratio"] for p in pairs)
    median = (
        ratios[len(ratios) // 2] if len(ratios) % 2 else (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2
    )
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python bench/observability_overhead.py " + " ".join(sys.argv[1:]),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "repeat": args.repeat,
        "workload": "prompts 16-512 tokens, outputs 16-128, greedy, fresh seed per pair (both halves the same requests, each on its own server); /generate streaming",
        "on": "OTLP/HTTP export of every span to a sink in the client process; /metrics and /dashboard/data read every second",
        "off": "OTEL_SDK_DISABLED=true, nothing scraped",
        "median_ratio_on_over_off": round(median, 4),
        "median_cpu_us_per_out_token": cpu,
        "span_bytes_received": sink.bytes,
        "pairs": pairs,
    }
    print(f"tracing and metrics on / off, median over {len(pairs)} pairs: {median:.3f}", file=sys.stderr)
    print(f"CPU us per output token, median: off {cpu['off']}, on {cpu['on']}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
