"""The whole pipeline against the same engine offline, on the same kind of work, cold.

Offline: the engine in this process runs a seeded mixed workload (prompts 16-1024,
outputs 16-256, greedy, fixed lengths) with ``--concurrency`` requests in flight.
Pipeline: ``pdserve up`` (PD: 1 prefill + 1 decode; unified: 1 worker) serves a workload of
the same shape over HTTP -> NATS -> workers (-> Mooncake) with the same concurrency. Every
measured run draws fresh prompts (its own seed), so neither side finds anything in a
prefix cache; cached prompt tokens are counted on both sides and reported. Offline and
pipeline runs alternate, so each pair shares the machine's mood; the cold ratio is the
median over pairs of pipeline output tokens/s over offline output tokens/s.

    python bench/pipeline_vs_offline.py          # writes docs/data/pipeline_vs_offline.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import busy_threads, process_cpu_seconds, process_threads, start_pdserve, stop_pdserve, thread_seconds
from engine_bench import Request, run_pdserve, workload
from sse_client import Connection, split_url

from pdserve.cores import available, format_cpus, spare
from pdserve.engine.config import EngineConfig
from pdserve.engine.loader import build_engine
from pdserve.engine.tiny_model import ensure_default_model

CLIENTS = ("raw", "httpx")


async def through_http(
    url: str,
    reqs: list[Request],
    concurrency: int,
    warm: bool = True,
    client: str = "raw",
    timeline: list[tuple[float, float, float]] | None = None,
) -> tuple[float, list[float], int, float]:
    """Seconds for all of ``reqs``, each one's time to first token, the prompt tokens the
    server reported as cached, and when the clock started (``time.perf_counter``).

    ``warm``: the client's ``concurrency`` connections are opened (one ``GET /health`` on
    each, at once) before the clock starts, as a long-lived client's keep-alive pool would
    have them; without it every run also pays for 64 TCP connections and their first
    requests. ``client``: ``raw`` reads the streams with :mod:`sse_client` (a few us a
    token), ``httpx`` with ``httpx`` (110-210 us a token: one process of it cannot keep up
    with a GPU at 64 in flight). ``timeline`` gets each request's (sent, first event,
    end) on ``time.perf_counter``'s clock."""
    if client == "raw":
        return await _through_raw(url, reqs, concurrency, warm, timeline)
    if client != "httpx":
        raise ValueError(f"client must be one of {CLIENTS}")
    pending = list(reqs)
    ttfts: list[float] = []
    cached = [0]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(r: Request) -> None:
            started = time.perf_counter()
            first = None
            last = ""
            async with http.stream("POST", "/generate", json=_generate_body(r)) as resp:
                assert resp.status_code == 200, await resp.aread()
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        last = line
                        if first is None:
                            first = time.perf_counter() - started
            ttfts.append(first or 0.0)
            if timeline is not None:
                timeline.append((started, started + (first or 0.0), time.perf_counter()))
            cached[0] += json.loads(last[len("data: ") :])["meta_info"].get("cached_tokens", 0) if last else 0

        async def lane() -> None:
            while pending:
                await one(pending.pop(0))

        if warm:
            await asyncio.gather(*(http.get("/health") for _ in range(concurrency)))
        started = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return time.perf_counter() - started, ttfts, cached[0], started


def _generate_body(r: Request) -> dict[str, Any]:
    return {
        "input_ids": r.prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": r.output_len, "temperature": 0, "ignore_eos": True},
    }


async def _through_raw(
    url: str,
    reqs: list[Request],
    concurrency: int,
    warm: bool,
    timeline: list[tuple[float, float, float]] | None,
) -> tuple[float, list[float], int, float]:
    pending = list(reqs)
    ttfts: list[float] = []
    cached = [0]
    host, port = split_url(url)
    conns = [Connection(host, port) for _ in range(concurrency)]

    async def lane(conn: Connection) -> None:
        while pending:
            r = pending.pop(0)
            got = await conn.stream("/generate", _generate_body(r))
            first = (got.first or got.ended) - got.sent
            ttfts.append(first)
            if timeline is not None:
                timeline.append((got.sent, got.sent + first, got.ended))
            cached[0] += (got.last or {}).get("meta_info", {}).get("cached_tokens", 0)

    try:
        if warm:
            await asyncio.gather(*(c.get("/health") for c in conns))
        started = time.perf_counter()
        await asyncio.gather(*(lane(c) for c in conns))
        return time.perf_counter() - started, ttfts, cached[0], started
    finally:
        await asyncio.gather(*(c.close() for c in conns))


def _client_share(url: str, reqs: list[Request], lanes: int, client: str, barrier: Any, results: Any) -> None:
    """One client process of :func:`drive`: its share of the requests, from the barrier on."""
    barrier.wait()
    cpu = time.process_time()
    timeline: list[tuple[float, float, float]] = []
    _, ttfts, cached, began = asyncio.run(through_http(url, reqs, lanes, client=client, timeline=timeline))
    # perf_counter is CLOCK_MONOTONIC: one clock for all the processes
    results.put((began, time.perf_counter(), ttfts, cached, time.process_time() - cpu, timeline))


def drive(
    url: str, reqs: list[Request], concurrency: int, processes: int = 1, client: str = "raw"
) -> tuple[float, list[float], int, float, tuple[float, float], list[tuple[float, float, float]]]:
    """:func:`through_http` from ``processes`` client processes at once (the requests and
    lanes dealt out among them). Returns seconds from the first start to the last
    finish, times to first token, cached prompt tokens, the clients' CPU seconds, the
    first start and last finish on ``time.perf_counter``'s clock (the workers' step
    timeline is on it too), and each request's (sent, first event, end) on that clock."""
    if processes <= 1:
        cpu = time.process_time()
        timeline: list[tuple[float, float, float]] = []
        seconds, ttfts, cached, began = asyncio.run(
            through_http(url, reqs, concurrency, client=client, timeline=timeline)
        )
        return seconds, ttfts, cached, time.process_time() - cpu, (began, time.perf_counter()), timeline
    ctx = multiprocessing.get_context("spawn")  # the parent may hold a CUDA context
    barrier, results = ctx.Barrier(processes + 1), ctx.Queue()
    shares = [(reqs[i::processes], concurrency // processes + (i < concurrency % processes)) for i in range(processes)]
    procs = [
        ctx.Process(target=_client_share, args=(url, r, n, client, barrier, results), daemon=True) for r, n in shares
    ]
    for proc in procs:
        proc.start()
    barrier.wait(timeout=120)
    outs = [results.get(timeout=900) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    span = (min(o[0] for o in outs), max(o[1] for o in outs))
    ttfts = [t for o in outs for t in o[2]]
    timeline = sorted(t for o in outs for t in o[5])
    return span[1] - span[0], ttfts, sum(o[3] for o in outs), sum(o[4] for o in outs), span, timeline


@contextlib.contextmanager
def client_cores(cores: list[int] | None) -> Iterator[None]:
    """This thread on ``cores`` (None: as it is) for the block. Affinity is a thread's: the
    offline engine's OpenMP threads keep theirs, and this one gets its own back after."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def cpu_per_token(root: int, before: dict[str, float], client_seconds: float, tokens: int) -> dict[str, float]:
    """CPU microseconds per output token of each part of the pipeline since ``before``
    (``client``: this process, which sends the requests and reads the streams)."""
    after = process_cpu_seconds(root)
    spent = {role: after[role] - before.get(role, 0.0) for role in after}
    spent["client"] = client_seconds
    return {role: round(seconds / tokens * 1e6, 1) for role, seconds in sorted(spent.items())}


def forward_totals(url: str, settle: float = 2.5) -> dict[str, list[float]]:
    """Each worker role's [seconds in forward passes, forward passes] so far, from the API's
    ``/metrics`` after ``settle`` seconds (workers report at each heartbeat, every 2 s)."""
    time.sleep(settle)
    totals: dict[str, list[float]] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for i, name in enumerate(("pdserve_engine_busy_seconds_total{", "pdserve_engine_steps_total{")):
            if line.startswith(name):
                role = line.split('role="', 1)[1].split('"', 1)[0]
                totals.setdefault(role, [0.0, 0.0])[i] += float(line.rsplit(" ", 1)[1])
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--modes", default="pd,unified")
    parser.add_argument("--repeat", type=int, default=3, help="offline/pipeline pairs per mode (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1000, help="first workload seed; each run takes the next")
    parser.add_argument("--json", type=Path, default=Path("docs/data/pipeline_vs_offline.json"))
    parser.add_argument("--up-args", default="", help='extra `pdserve up` flags, e.g. "--num-threads 2"')
    parser.add_argument(
        "--up-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for `pdserve up` and its workers only, not the offline engine "
        "(e.g. GOMP_SPINCOUNT=10000); may be given several times",
    )
    parser.add_argument(
        "--client", choices=CLIENTS, default="raw", help="how the streams are read (default: %(default)s)"
    )
    args = parser.parse_args()
    for pair in args.up_env:
        if "=" not in pair or pair.startswith("="):
            parser.error(f"--up-env {pair!r}: NAME=VALUE")
    data_dir = Path(tempfile.mkdtemp(prefix="pdserve-pipe-"))
    model = ensure_default_model(data_dir)
    seeds = iter(range(args.seed, args.seed + 10_000))

    def fresh() -> list[Request]:
        return workload(args.requests, next(seeds), 4000, 16, 1024, 16, 256)

    engine = build_engine(model, EngineConfig(max_total_tokens=300_000, max_num_seqs=256))
    run_pdserve(engine, workload(2, 99, 4000, 16, 64, 4, 8), 2)

    def offline() -> dict[str, float]:
        reqs = fresh()
        engine.pages.reset_prefix_cache()
        cached, busy, steps = engine.stats.cached_tokens, engine.stats.busy_seconds, engine.stats.steps
        seconds = run_pdserve(engine, reqs, args.concurrency)
        return {
            "out_tok_s": sum(r.output_len for r in reqs) / seconds,
            "cached_tokens": engine.stats.cached_tokens - cached,
            "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "forward_seconds": round(engine.stats.busy_seconds - busy, 3),
            "steps": engine.stats.steps - steps,
        }

    result: dict[str, object] = {
        "date": datetime.date.today().isoformat(),
        "command": "python bench/pipeline_vs_offline.py " + " ".join(sys.argv[1:]),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "repeat": args.repeat,
        "workload": "prompts 16-1024 tokens, outputs 16-256, greedy, fresh seed per run",
        "client": args.client,
        "cores": os.cpu_count(),
        "offline_threads": torch.get_num_threads(),  # torch's, not the process's
        "up_args": args.up_args,
        "up_env": args.up_env,
    }
    # `up --pin-cores` leaves the first cores to the API and the broker: the client takes them
    # too (as a remote client would take none of the workers'), only while it drives the pipeline
    client_set = spare(available()) if "--pin-cores" in args.up_args.split() else None
    result["client_cores"] = format_cpus(client_set) if client_set else "any"
    for mode in args.modes.split(","):
        proc, url = start_pdserve(
            mode,
            data_dir,
            ["--unified-workers", "1", "--max-running-requests", "256", *args.up_args.split()],
            env=dict(pair.split("=", 1) for pair in args.up_env),
        )
        pairs = []
        try:
            asyncio.run(through_http(url, workload(4, 7, 4000, 16, 64, 4, 8), 4))  # warm-up
            for _ in range(args.repeat):  # offline and pipeline back to back: pairs share the machine's mood
                base = offline()
                reqs = fresh()
                forward_before = forward_totals(url, settle=0.0 if pairs else 2.5)
                cpu_before = process_cpu_seconds(proc.pid)
                threads_before = thread_seconds(proc.pid)
                client_before = time.process_time()
                with client_cores(client_set):
                    seconds, ttfts, cached, _ = asyncio.run(
                        through_http(url, reqs, args.concurrency, client=args.client)
                    )
                ttfts.sort()
                forward = forward_totals(url)
                pipe = {
                    "threads": process_threads(proc.pid),  # per role, idle ones included
                    # per role, the threads that worked during the run: a second working pool shows here
                    "busy_threads": busy_threads(threads_before, thread_seconds(proc.pid)),
                    # each role's time in forward passes and their count: against the offline
                    # engine's, whether the steps ran slower or there were more of them
                    "forward": {
                        role: {
                            "seconds": round(now[0] - forward_before.get(role, [0.0, 0.0])[0], 3),
                            "steps": int(now[1] - forward_before.get(role, [0.0, 0.0])[1]),
                        }
                        for role, now in forward.items()
                    },
                    "cpu_us_per_out_token": cpu_per_token(
                        proc.pid, cpu_before, time.process_time() - client_before, sum(r.output_len for r in reqs)
                    ),
                    "out_tok_s": sum(r.output_len for r in reqs) / seconds,
                    "cached_tokens": cached,
                    "prompt_tokens": sum(len(r.prompt) for r in reqs),
                    "ttft_p50_s": ttfts[len(ttfts) // 2],
                }
                pairs.append({"offline": base, "pipeline": pipe, "ratio": pipe["out_tok_s"] / base["out_tok_s"]})
                print(
                    f"{mode}: offline {base['out_tok_s']:,.0f}, pipeline {pipe['out_tok_s']:,.0f} output tok/s "
                    f"(cached prompt tokens {base['cached_tokens']:.0f} / {cached}); forward passes "
                    f"{base['forward_seconds']:.2f} s / "
                    + " + ".join(f"{r} {f['seconds']:.2f} s" for r, f in pipe["forward"].items()),
                    file=sys.stderr,
                )
        finally:
            stop_pdserve(proc)
        ratios = sorted(p["ratio"] for p in pairs)
        result[mode] = {"cold_ratio": ratios[len(ratios) // 2], "pairs": pairs}
        print(f"{mode}: cold pipeline/offline {ratios[len(ratios) // 2]:.2f}x", file=sys.stderr)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
