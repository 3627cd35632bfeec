"""The benchmark client itself against ``pdserve bench stub`` in another process: achieved
against offered request rate, the latency the client adds, its CPU time per request
(``python bench/serving_sweep.py --client-overhead``)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import fmt, free_port

from pdserve.bench.config import BenchConfig
from pdserve.bench.metrics import stat
from pdserve.bench.report import markdown_table, write_json
from pdserve.bench.runner import run_benchmark


def client_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark client against ``pdserve bench stub`` (another process): achieved vs.
    offered rate, latency added, client CPU per request."""
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "pdserve.bench", "stub", "--port", str(port), "--tokens", str(args.stub_tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    rows = []
    points = []
    try:
        assert stub.stdout is not None
        stub.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        plan: list[tuple[float, int | None]] = [(r, None) for r in args.stub_rates]
        plan += [(math.inf, c) for c in args.stub_concurrency]
        for rate, conc in plan:
            n = args.stub_prompts if math.isinf(rate) else max(args.stub_prompts, int(rate * args.stub_seconds))
            cfg = BenchConfig(
                base_url=url,
                num_prompts=n,
                request_rate=rate,
                max_concurrency=conc,
                input_len=32,
                output_len=args.stub_tokens,
                warmup=min(32, conc or 32),
                quiet=True,
                seed=args.seed,
            )
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            result = asyncio.run(run_benchmark(cfg))
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime) / n
            [p] = result["points"]
            m = p["metrics"]
            p["client_cpu_us_per_request"] = cpu * 1e6
            points.append(p)
            lag = m.get("send_lag_ms") or {}
            rows.append(
                [
                    "inf" if math.isinf(rate) else f"{rate:g}",
                    str(conc or "-"),
                    str(n),
                    fmt(m.get("offered_request_rate")),
                    fmt(m["request_throughput"]),
                    fmt(stat(m, "ttft_ms", "p50"), 2),
                    fmt(stat(m, "ttft_ms", "p99"), 2),
                    fmt(stat(m, "e2e_latency_ms", "p50"), 2),
                    fmt(stat(m, "e2e_latency_ms", "p99"), 2),
                    fmt(lag.get("p50"), 2),
                    fmt(lag.get("p99"), 2),
                    fmt(cpu * 1e6, 0),
                    str(m["failed"]),
                ]
            )
            print(
                f"  stub rate {rows[-1][0]} conc {rows[-1][1]}: achieved {rows[-1][4]} req/s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        stub.terminate()
        try:
            stub.wait(timeout=10)
        except subprocess.TimeoutExpired:
            stub.kill()
            stub.wait()
    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan,) * 3
    header = [
        "target req/s",
        "max conc",
        "requests",
        "offered req/s",
        "achieved req/s",
        "TTFT p50",
        "TTFT p99",
        "E2E p50",
        "E2E p99",
        "send lag p50",
        "send lag p99",
        "client CPU us/req",
        "failed",
    ]
    md = "\n".join(
        [
            "## Client overhead against the stub server",
            "",
            f"`pdserve bench stub --tokens {args.stub_tokens} --itl-ms 0` in its own process on loopback (it answers at once, one "
            f"SSE event per token plus a usage event), the client in this one; {os.cpu_count()} CPU cores, load average "
            f"{load[0]:.1f} at the end. Latencies in ms: against an instant server they are the client's own overhead plus "
            "loopback and the stub's. Send lag = actual send time - scheduled arrival time (open loop only).",
            "",
            markdown_table(header, rows),
            "",
        ]
    )
    out = {"markdown": md, "points": points, "loadavg": load}
    write_json(Path(args.out_data) / "client_overhead.json", out)
    return out
