"""A burst against three deployments in one run: fixed min+min, fixed max+max, autoscaled.

Each deployment is a fresh ``pdserve up`` (its own data dir and broker, the same model)
that gets the same schedule: ``--steady-before`` seconds at ``--base-rate`` requests/s,
``--burst-seconds`` at ``--burst-factor`` times that, then ``--steady-after`` seconds at the
base rate again (Poisson arrivals from one schedule seed, shared; prompt tokens drawn from a
fresh seed per deployment, so every run is cold: the cached tokens the server reported are
recorded). Every second the script reads the API's ``/metrics`` (queues, the autoscaler's
decision, the registry) and counts the worker processes under ``pdserve up`` in ``/proc``.

It reports, for the autoscaled run: the time from the backlog crossing its threshold (the
rule's need for prefill first above one replica plus tolerance) to the decision to scale
out and to the new worker serving (registered); the time from the burst's backlog being
cleared (its last request answered) to both pools back at their minimum, retired workers
gone; failures. For all three: goodput (requests answered with TTFT <= ``--slo-ttft``, per
second of schedule), throughput, TTFT percentiles, and worker-seconds (worker processes
alive, integrated over the schedule). Writes ``--out-data`` (JSON) and ``--out-img`` (the
autoscaled run's backlog and replicas over time, with the fixed runs' backlogs).

Example (the figure in docs/autoscaling.md)::

    python bench/autoscale_burst.py --max-prefill 2 --max-decode 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import free_port, git_commit, stop_pdserve
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import RequestOptions, build_body, http_request, make_client, send_request
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.report import write_json

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("prefill", "decode")


@dataclass
class Sample:
    t: float
    processes: dict[str, int]
    registered: dict[str, int]
    pending: dict[str, float]
    ack_pending: dict[str, float]
    backlog_tokens: float | None = None
    desired: dict[str, float] = field(default_factory=dict)
    need: dict[str, float] = field(default_factory=dict)


def schedule(args: argparse.Namespace) -> list[tuple[float, str]]:
    """(offset, phase) of every request: the same for every deployment."""
    out: list[tuple[float, str]] = []
    start = 0.0
    phases = (
        ("steady", args.steady_before, args.base_rate),
        ("burst", args.burst_seconds, args.base_rate * args.burst_factor),
        ("after", args.steady_after, args.base_rate),
    )
    rng = random.Random(args.schedule_seed)
    for name, seconds, rate in phases:
        n = max(round(seconds * rate), 1)
        offsets = [o for o in arrival_offsets(n * 2, rate, 1.0, rng.randrange(1 << 30)) if o < seconds][:n]
        out += [(start + o, name) for o in offsets]
        start += seconds
    return out


def worker_processes(root: int) -> dict[str, int]:
    """Worker processes (``pdserve prefill|decode``) below ``root``, by role (Linux /proc)."""
    parents: dict[int, int] = {}
    roles: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "pdserve" in argv and argv.index("pdserve") + 1 < len(argv):
            roles[int(entry)] = argv[argv.index("pdserve") + 1]
    counts = dict.fromkeys(ROLES, 0)
    for pid, role in roles.items():
        p = pid
        while p not in (root, 0, 1) and p in parents:
            p = parents[p]
        if p == root and role in counts:
            counts[role] += 1
    return counts


def read_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def by_label(m: dict[str, list[tuple[dict[str, str], float]]], name: str, label: str) -> dict[str, float]:
    return {labels[label]: value for labels, value in m.get(name, []) if label in labels}


async def sample_loop(url: str, root: int, t0: float, samples: list[Sample], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            began = time.monotonic()
            try:
                m = read_metrics((await client.get(url + "/metrics")).text)
            except httpx.HTTPError:
                m = {}
            registered = dict.fromkeys(ROLES, 0)
            for labels, _ in m.get("pdserve_worker_info", []):
                if labels.get("role") in registered:
                    registered[labels["role"]] += 1
            need: dict[str, float] = {}
            for labels, value in m.get("pdserve_autoscale_need_replicas", []):
                need[labels["role"]] = max(need.get(labels["role"], 0.0), value)
            tokens = by_label(m, "pdserve_autoscale_backlog_tokens", "role").get("prefill")
            if tokens is None:  # a fixed pool: the API's own count of prompt tokens with no token back
                tokens = sum(v for _, v in m.get("pdserve_prefill_tokens_waiting", []))
            samples.append(
                Sample(
                    t=round(began - t0, 2),
                    processes=worker_processes(root),
                    registered=registered,
                    pending=by_label(m, "pdserve_queue_pending", "stage"),
                    ack_pending=by_label(m, "pdserve_queue_ack_pending", "stage"),
                    backlog_tokens=tokens,
                    desired=by_label(m, "pdserve_desired_replicas", "role"),
                    need=need,
                )
            )
            await asyncio.sleep(max(1.0 - (time.monotonic() - began), 0.05))


def start_up(name: str, home: Path, model: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--host", "127.0.0.1"]
    argv += ["--data-dir", str(home), "--model-path", str(model), "--log-level", "INFO", *extra]
    log = open(home / "up.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_pdserve(proc, timeout=90)
    raise SystemExit(f"{name}: pdserve up did not come up; see {home / 'up.log'}")


async def replay(
    url: str, plan: list[tuple[float, str]], args: argparse.Namespace, seed: int, t0: float
) -> list[RequestRecord]:
    rng = random.Random(seed)
    opts = RequestOptions(backend="generate", ignore_eos=True)
    records = [RequestRecord(index=i, scheduled=o) for i, (o, _) in enumerate(plan)]
    async with make_client(len(plan), args.request_timeout) as client:

        async def one(i: int, offset: float, req: BenchRequest) -> None:
            request = http_request(url + "/generate", orjson_dumps(build_body(req, opts)), timeout=args.request_timeout)
            await asyncio.sleep(max(t0 + offset - time.perf_counter(), 0.0))
            await send_request(client, request, records[i], "generate", req, clock=time.perf_counter, t0=t0)

        tasks = []
        for i, (offset, _) in enumerate(plan):
            ids = [rng.randrange(3, 4000) for _ in range(args.input_len)]
            tasks.append(one(i, offset, BenchRequest(ids, args.input_len, args.output_len, exact=True)))
        await asyncio.gather(*tasks)
    return records


def orjson_dumps(body: dict[str, Any]) -> bytes:
    import orjson

    return orjson.dumps(body)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def worker_seconds(samples: list[Sample], start: float, end: float) -> float:
    total = 0.0
    for a, b in itertools.pairwise(samples):
        lo, hi = max(a.t, start), min(b.t, end)
        if hi > lo:
            total += sum(a.processes.values()) * (hi - lo)
    return round(total, 1)


def summarize(
    name: str,
    records: list[RequestRecord],
    plan: list[tuple[float, str]],
    samples: list[Sample],
    args: argparse.Namespace,
) -> dict[str, Any]:
    length = args.steady_before + args.burst_seconds + args.steady_after
    ok = [r for r in records if r.ok]
    good = [r for r in ok if r.ttft is not None and r.ttft <= args.slo_ttft]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    burst = [r for r, (_, phase) in zip(records, plan, strict=True) if phase != "after"]
    cleared = max((r.start + (r.latency or 0.0) for r in burst), default=0.0)
    out: dict[str, Any] = {
        "name": name,
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "goodput_rps": round(len(good) / length, 3),
        "good_fraction": round(len(good) / len(records), 3),
        "throughput_rps": round(len(ok) / length, 3),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "worker_seconds": worker_seconds(samples, 0.0, length),
        "burst_backlog_cleared_s": round(cleared, 2),
        "timeline": [asdict(s) for s in samples],
    }
    return out


def autoscale_figures(summary: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    samples = [Sample(**s) for s in summary["timeline"]]
    threshold = 1.0 + args.tolerance
    crossed = next((s.t for s in samples if s.need.get("prefill", 0.0) > threshold), None)
    decided = next((s.t for s in samples if s.desired.get("prefill", 1.0) > args.min_prefill), None)
    ready = next((s.t for s in samples if s.registered["prefill"] > args.min_prefill), None)
    cleared = summary["burst_backlog_cleared_s"]
    at_min = next(
        (
            s.t
            for s in samples
            if s.t >= cleared
            and s.processes["prefill"] == args.min_prefill
            and s.processes["decode"] == args.min_decode
        ),
        None,
    )
    peak = {role: max((s.processes[role] for s in samples), default=0) for role in ROLES}
    return {
        "backlog_crossed_threshold_s": crossed,
        "scale_out_decided_s": decided,
        "scale_out_ready_s": ready,
        "decision_after_crossing_s": None if crossed is None or decided is None else round(decided - crossed, 2),
        "ready_after_crossing_s": None if crossed is None or ready is None else round(ready - crossed, 2),
        "back_to_minimum_s": at_min,
        "back_to_minimum_after_cleared_s": None if at_min is None else round(at_min - cleared, 2),
        "peak_processes": peak,
    }


def plot(result: dict[str, Any], out: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {r["name"]: r for r in result["runs"]}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    b0, b1 = args.steady_before, args.steady_before + args.burst_seconds
    for ax in (top, bottom):
        ax.axvspan(b0, b1, color="0.9", label="burst")
    colors = {"autoscale": "C0", "fixed-min": "C3", "fixed-max": "C2"}
    for name, run in runs.items():
        tl = run["timeline"]
        ts = [s["t"] for s in tl]
        lag = [s["pending"].get("prefill", 0) + s["ack_pending"].get("prefill", 0) for s in tl]
        top.plot(
            ts,
            lag,
            color=colors[name],
            lw=2 if name == "autoscale" else 1,
            ls="-" if name == "autoscale" else "--",
            label=f"{name}: prefill queue (waiting + in hand)",
        )
    top.set_ylabel("requests")
    top.legend(loc="upper right", fontsize=8)
    tl = runs["autoscale"]["timeline"]
    ts = [s["t"] for s in tl]
    for role, color in (("prefill", "C0"), ("decode", "C1")):
        bottom.step(
            ts, [s["processes"][role] for s in tl], where="post", color=color, lw=2, label=f"{role} worker processes"
        )
        bottom.step(
            ts,
            [s["desired"].get(role, float("nan")) for s in tl],
            where="post",
            color=color,
            ls=":",
            label=f"{role} desired",
        )
    ax2 = bottom.twinx()
    ax2.plot(ts, [s["backlog_tokens"] or 0 for s in tl], color="0.4", lw=1, label="prefill backlog tokens")
    ax2.set_ylabel("prompt tokens waiting")
    bottom.set_ylabel("replicas (autoscaled run)")
    bottom.set_xlabel("seconds since the schedule started")
    bottom.set_ylim(0, max(args.max_prefill, args.max_decode) + 0.5)
    h1, l1 = bottom.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    bottom.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    fig.suptitle(
        f"{args.burst_factor:g}x burst for {args.burst_seconds:g} s over {args.base_rate:g} req/s "
        f"({args.input_len} in / {args.output_len} out), {result['machine']['cpus']} CPUs"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def run_one(
    name: str,
    extra: list[str],
    model: Path,
    home: Path,
    plan: list[tuple[float, str]],
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    load_before = os.getloadavg()
    proc, url = start_up(name, home, model, extra)
    try:
        time.sleep(args.warmup)
        samples: list[Sample] = []
        stop = asyncio.Event()

        async def go() -> list[RequestRecord]:
            t0 = time.perf_counter()
            sampler = asyncio.create_task(sample_loop(url, proc.pid, t0, samples, stop))
            records = await replay(url, plan, args, seed, t0)
            length = args.steady_before + args.burst_seconds + args.steady_after
            while time.perf_counter() - t0 < length + args.tail:
                await asyncio.sleep(0.5)
            stop.set()
            await sampler
            return records

        records = asyncio.run(go())
    finally:
        stop_pdserve(proc, timeout=90)
    summary = summarize(name, records, plan, samples, args)
    summary["seed"] = seed
    summary["load_before"] = load_before
    summary["flags"] = extra
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-prefill", type=int, default=1)
    p.add_argument("--max-prefill", type=int, default=2)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-decode", type=int, default=2)
    p.add_argument("--base-rate", type=float, default=1.0, help="requests/s outside the burst")
    p.add_argument("--burst-factor", type=float, default=10.0)
    p.add_argument("--burst-seconds", type=float, default=30.0)
    p.add_argument("--steady-before", type=float, default=20.0)
    p.add_argument("--steady-after", type=float, default=70.0)
    p.add_argument("--tail", type=float, default=0.0, help="seconds to keep sampling after the schedule")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput counts requests with TTFT <= this")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (--num-threads)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds between healthy and the schedule")
    p.add_argument("--tolerance", type=float, default=0.1, help="the rule's tolerance (for the threshold)")
    p.add_argument("--schedule-seed", type=int, default=14)
    p.add_argument("--seed", type=int, default=None, help="first prompt seed (default: fresh, recorded)")
    p.add_argument("--commit", default="", help="the commit measured (default: git's HEAD)")
    p.add_argument("--configs", default="fixed-min,fixed-max,autoscale")
    p.add_argument("--scale-args", default="", help="extra flags for the autoscaled run")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/pdserve-autoscale-burst"))
    p.add_argument("--out-data", type=Path, default=ROOT / "docs/data/autoscale_burst.json")
    p.add_argument("--out-img", type=Path, default=ROOT / "docs/img/autoscale_burst.png")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)

    from pdserve.engine.tiny_model import ensure_default_model

    model = ensure_default_model(args.workdir / "model")
    common = ["--device", args.device, "--num-threads", str(args.threads), "--heartbeat-seconds", "1"]
    configs = {
        "fixed-min": ["--prefill-workers", str(args.min_prefill), "--decode-workers", str(args.min_decode)],
        "fixed-max": ["--prefill-workers", str(args.max_prefill), "--decode-workers", str(args.max_decode)],
        "autoscale": [
            "--autoscale",
            *("--min-prefill", str(args.min_prefill), "--max-prefill", str(args.max_prefill)),
            *("--min-decode", str(args.min_decode), "--max-decode", str(args.max_decode)),
            *args.scale_args.split(),
        ],
    }
    plan = schedule(args)
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "commit": args.commit or git_commit(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_before": os.getloadavg()},
        "model": model.name,
        "schedule": {
            "requests": len(plan),
            "by_phase": {ph: sum(1 for _, x in plan if x == ph) for ph in ("steady", "burst", "after")},
            **{
                k: getattr(args, k)
                for k in (
                    "base_rate",
                    "burst_factor",
                    "burst_seconds",
                    "steady_before",
                    "steady_after",
                    "input_len",
                    "output_len",
                    "slo_ttft",
                )
            },
        },
        "runs": [],
    }
    for i, name in enumerate(args.configs.split(",")):
        print(f"--- {name}", flush=True)
        run = run_one(name, common + configs[name], model, args.workdir / name, plan, args, seed + i)
        if name == "autoscale":
            run["autoscale"] = autoscale_figures(run, args)
        brief = {k: v for k, v in run.items() if k != "timeline"}
        print(brief, flush=True)
        result["runs"].append(run)
    runs = {r["name"]: r for r in result["runs"]}
    if {"autoscale", "fixed-max"} <= runs.keys():
        a, m = runs["autoscale"], runs["fixed-max"]
        figures = a["autoscale"]
        result["goals"] = {
            "goodput_vs_max": round(a["goodput_rps"] / m["goodput_rps"], 3) if m["goodput_rps"] else None,
            "worker_seconds_saved": round(1 - a["worker_seconds"] / m["worker_seconds"], 3),
            "scale_out_within_10s": figures["ready_after_crossing_s"] is not None
            and figures["ready_after_crossing_s"] <= 10,
            "back_to_minimum_within_60s": figures["back_to_minimum_after_cleared_s"] is not None
            and figures["back_to_minimum_after_cleared_s"] <= 60,
            "no_failures": all(r["failed"] == 0 for r in result["runs"]),
        }
        g = result["goals"]
        g["goodput_within_20pct_of_max"] = g["goodput_vs_max"] is not None and g["goodput_vs_max"] >= 0.8
        g["at_least_30pct_fewer_worker_seconds"] = g["worker_seconds_saved"] >= 0.3
        print(result["goals"], flush=True)
        plot(result, args.out_img, args)
    write_json(args.out_data, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
