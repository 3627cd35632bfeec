"""PD-disaggregated vs unified serving, measured with ``pdserve bench`` on one machine.

Starts ``pdserve up --mode pd`` (1 prefill + 1 decode worker) and then ``pdserve up --mode
unified --unified-workers 2`` on the same model, each on its own free port and data dir
under a temporary directory; runs the same request-rate sweep against each for two
workloads (prefill-heavy and decode-heavy); stops each system with SIGTERM. Writes:

* ``docs/img/serving_<workload>.png`` — PD and unified overlaid (TTFT, TPOT/ITL, goodput);
* ``docs/data/serving_sweep.json`` — every point of every run, the SLOs and the crossovers;
* the markdown tables and the crossover analysis on stdout (for ``docs/performance.md``).

``--client-overhead`` instead (or also, with ``--also-client-overhead``) measures the
benchmark client itself against ``pdserve bench stub`` in a separate process: achieved
vs. offered request rate, the latency the client adds, and its CPU time per request.

Examples::

    python bench/serving_sweep.py                                   # defaults: rates 1,2,4,8; 40 prompts
    python bench/serving_sweep.py --rates 2,8 --num-prompts 10 --out-img /tmp/x --out-data /tmp/x
    python bench/serving_sweep.py --client-overhead --stub-rates 100,250,500,750,1000
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from client_overhead import client_overhead
from common import fmt
from system import MODES, System

from pdserve.bench.config import BenchConfig
from pdserve.bench.metrics import SLO, RequestRecord, stat
from pdserve.bench.report import markdown_table, write_json
from pdserve.bench.runner import run_benchmark

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int


def _workload(text: str) -> Workload:
    name, _, lens = text.partition("=")
    i, _, o = lens.partition(":")
    return Workload(name, int(i), int(o))


# ---- goodput at an SLO chosen after the runs ------------------------------------------------
_FIELDS = {f.name for f in fields(RequestRecord)}


def goodput(point: dict[str, Any], slo: SLO) -> tuple[float, float]:
    """(req/s, fraction) of the point's requests meeting ``slo``."""
    recs = [RequestRecord(**{k: v for k, v in row.items() if k in _FIELDS}) for row in point["requests"]]
    good = sum(1 for r in recs if slo.met(r))
    return good / point["metrics"]["duration_s"], good / max(1, len(recs))


def _nice(x: float) -> float:
    """Round up to 1, 2 or 5 times a power of ten."""
    if x <= 0:
        return 1.0
    e = 10 ** math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        if x <= m * e:
            return float(m * e)
    return float(10 * e)


def auto_slo(runs: dict[str, list[dict[str, Any]]], factor: float, ttft: float | None, tpot: float | None) -> SLO:
    """The SLO for one workload: given values, else ``factor`` times the best p50 (TTFT,
    TPOT) any mode reached at the lowest rate, rounded up to 1/2/5 x 10^k ms."""
    firsts = [points[0]["metrics"] for points in runs.values() if points]
    if ttft is None:
        ttft = _nice(factor * min(stat(m, "ttft_ms", "p50") or math.inf for m in firsts))
    if tpot is None:
        tpot = _nice(factor * min(stat(m, "tpot_ms", "p50") or math.inf for m in firsts))
    return SLO(ttft_ms=ttft, itl_ms=tpot, itl_metric="tpot")


def crossover(rates: list[float], a: list[float], b: list[float], name_a: str, name_b: str, tie: float = 0.05) -> str:
    """Where goodput ``a`` overtakes ``b`` or falls below it. Differences within ``tie``
    (relative to the larger of the two) count as a tie: a few requests per point make
    small differences noise. A sign change between two rates is placed by linear
    interpolation; leaving a tie only names the interval."""

    def sign(x: float, y: float) -> int:
        if abs(x - y) <= tie * max(abs(x), abs(y), 1e-12):
            return 0
        return 1 if x > y else -1

    signs = [sign(x, y) for x, y in zip(a, b, strict=True)]
    span = f"{rates[0]:g}-{rates[-1]:g} req/s"
    band = f"within {100 * tie:g}%"
    if all(v == 0 for v in signs):
        return f"No crossover in {span}: {name_a} and {name_b} goodput are {band} of each other at every measured rate."
    events = []
    prev_i, prev_s = None, 0
    for i, v in enumerate(signs):
        if v == 0:
            continue
        verb = "overtakes" if v > 0 else "falls below"
        if prev_s == 0 and i > 0:
            events.append(
                f"{name_a} goodput {verb} {name_b} between {rates[i - 1]:g} and {rates[i]:g} req/s "
                f"(tied, {band}, up to {rates[i - 1]:g})"
            )
        elif prev_s not in (0, v) and prev_i is not None:
            d0, d1 = a[prev_i] - b[prev_i], a[i] - b[i]
            r = rates[prev_i] + (rates[i] - rates[prev_i]) * d0 / (d0 - d1)
            events.append(
                f"{name_a} goodput {verb} {name_b} between {rates[prev_i]:g} and {rates[i]:g} req/s (about {r:.2f} req/s)"
            )
        prev_i, prev_s = i, v
    if not events:
        where = "above" if prev_s > 0 else "below"
        return f"No crossover in {span}: {name_a} goodput is {where} {name_b} (by more than {100 * tie:g}%) from the lowest rate on."
    return "; ".join(events) + "."


# ---- the sweep ------------------------------------------------------------------------------------
def workload_table(wl: Workload, runs: dict[str, list[dict[str, Any]]], slo: SLO) -> str:
    header = [
        "mode",
        "rate",
        "ok/fail",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p99",
        "E2E p50",
        "goodput",
        "good %",
        "req queue p99",
        "kv queue p99",
        "cached / prompt tokens",
    ]
    rows = []
    for mode, points in runs.items():
        for p in points:
            m = p["metrics"]
            gp, frac = goodput(p, slo)
            timings = m.get("server_timings_ms") or {}
            rq = (timings.get("request_queue") or {}).get("p99")
            kq = (timings.get("kv_queue") or {}).get("p99")
            rows.append(
                [
                    mode,
                    f"{p['request_rate']:g}",
                    f"{m['completed']}/{m['failed']}",
                    fmt(m["request_throughput"], 2),
                    fmt(m["output_throughput"]),
                    fmt(stat(m, "ttft_ms", "p50")),
                    fmt(stat(m, "ttft_ms", "p99")),
                    fmt(stat(m, "tpot_ms", "p50"), 2),
                    fmt(stat(m, "tpot_ms", "p99"), 2),
                    fmt(stat(m, "itl_ms", "p99"), 2),
                    fmt(stat(m, "e2e_latency_ms", "p50")),
                    fmt(gp, 2),
                    fmt(100 * frac, 0),
                    fmt(rq, 2),
                    fmt(kq, 2),
                    f"{m.get('total_cached_tokens', '?')} / {m.get('total_input_tokens', '?')}",
                ]
            )
    return markdown_table(header, rows)


async def sweep_system(
    url: str, wl: Workload, args: argparse.Namespace, tokenizer: str, quiet: bool, seed: int
) -> list[dict[str, Any]]:
    cfg = BenchConfig(
        base_url=url,
        backend=args.backend,
        tokenizer=tokenizer,
        num_prompts=args.num_prompts,
        warmup=args.warmup,
        seed=seed,
        input_len=wl.input_len,
        output_len=wl.output_len,
        range_ratio=args.range_ratio,
        burstiness=args.burstiness,
        sweep=args.rates,
        save_requests=True,
        quiet=quiet,
        sweep_pause=args.pause,
    )
    result = await run_benchmark(cfg)
    return list(result["points"])


def run_sweeps(args: argparse.Namespace) -> dict[str, Any]:
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    root = Path(tempfile.mkdtemp(prefix="pdserve-sweep-"))
    if args.model_path:
        model = Path(args.model_path)
    else:
        from pdserve.engine.tiny_model import ensure_default_model

        model = ensure_default_model(root / "model")
    workloads = [_workload(w) for w in args.workloads]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {wl.name: {} for wl in workloads}
    started = time.time()
    for mode in args.modes:
        system = System(mode, model, root, args.up_args.split() if args.up_args else [])
        print(f"starting {system.label} on {system.url} (log: {system.log_path})", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            system.start()
            print(f"  ready after {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
            for wl in workloads:
                print(
                    f"  {wl.name}: input {wl.input_len}, output {wl.output_len}, rates {args.rates}",
                    file=sys.stderr,
                    flush=True,
                )
                # Each workload its own seeds: prompts drawn from one seed share their first
                # tokens, and the server's prefix cache would serve the second workload.
                seed = args.seed + 1000 * workloads.index(wl)
                runs[wl.name][mode] = asyncio.run(sweep_system(system.url, wl, args, str(model), args.quiet, seed))
        finally:
            system.stop()
            print(f"  stopped {mode}", file=sys.stderr, flush=True)
    return {
        "root": str(root),
        "model": str(model),
        "workloads": workloads,
        "runs": runs,
        "seconds": time.time() - started,
    }


def report(args: argparse.Namespace, sweep: dict[str, Any]) -> dict[str, Any]:
    from pdserve.bench.plot import plot_sweeps

    out_img, out_data = Path(args.out_img), Path(args.out_data)
    lines = [
        "## Serving sweep: PD-disaggregated vs unified",
        "",
        "`" + " ".join(["python bench/serving_sweep.py", *args.argv]) + "`",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}; model: "
        f"`{Path(sweep['model']).name}` on CPU; both systems on the same machine, one after the other",
        f"- PD: {MODES['pd'][0]}; unified: {MODES['unified'][0]}; backend `{args.backend}` (streaming), "
        f"`ignore_eos`, token-id prompts (exact lengths)",
        f"- {args.num_prompts} requests per point, Poisson arrivals (burstiness {args.burstiness:g}), {args.warmup} warm-up "
        f"requests per point, fresh prompts per point (seed {args.seed} + 1000 x workload + point index)",
        "- latencies in ms; TPOT = (E2E - TTFT) / (output tokens - 1); ITL = gaps between streamed events; "
        "queue columns are the server's `meta_info.timings` (request_queue: JetStream request queue wait; "
        "kv_queue: KV-ready event wait before a decode worker takes it)",
        "",
    ]
    result: dict[str, Any] = {
        "tool": "bench/serving_sweep.py",
        "argv": args.argv,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "model": sweep["model"],
        "seconds": sweep["seconds"],
        "workloads": {},
    }
    for wl in sweep["workloads"]:
        runs = sweep["runs"][wl.name]
        slo = auto_slo(runs, args.slo_factor, args.slo_ttft, args.slo_tpot)
        rates = [float(r) for r in args.rates]
        lines += [f"### {wl.name}: input {wl.input_len} tokens, output {wl.output_len} tokens", ""]
        how = (
            "given"
            if args.slo_ttft is not None and args.slo_tpot is not None
            else f"{args.slo_factor:g}x the best p50 at {rates[0]:g} req/s, rounded up, where not given"
        )
        lines += [f"SLO for goodput: {slo.describe()} ({how}).", ""]
        lines += [workload_table(wl, runs, slo), ""]
        analysis = ""
        if "pd" in runs and "unified" in runs:
            gp_pd = [goodput(p, slo)[0] for p in runs["pd"]]
            gp_un = [goodput(p, slo)[0] for p in runs["unified"]]
            analysis = crossover(rates, gp_pd, gp_un, "PD", "unified", args.tie)
            lines += [f"Crossover at this SLO: {analysis}", ""]
        png = out_img / f"serving_{wl.name}.png"
        series = [(MODES[m][0], points) for m, points in runs.items()]
        for points in runs.values():
            for p in points:
                gp, frac = goodput(p, slo)
                p["metrics"]["slo"] = {
                    "ttft_ms": slo.ttft_ms,
                    "itl_ms": slo.itl_ms,
                    "itl_metric": slo.itl_metric,
                    "text": slo.describe(),
                }
                p["metrics"]["goodput"], p["metrics"]["goodput_fraction"] = gp, frac
        plot_sweeps(series, png, title=f"{wl.name}: input {wl.input_len}, output {wl.output_len} ({slo.describe()})")
        rel = os.path.relpath(png, ROOT / "docs") if png.is_relative_to(ROOT / "docs") else str(png)
        lines += [f"![{wl.name}]({rel})", ""]
        if not args.save_requests:
            for points in runs.values():
                for p in points:
                    p.pop("requests", None)
        result["workloads"][wl.name] = {
            "input_len": wl.input_len,
            "output_len": wl.output_len,
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.itl_ms},
            "crossover": analysis,
            "runs": runs,
            "plot": str(png),
        }
    result["markdown"] = "\n".join(lines)
    write_json(out_data / "serving_sweep.json", result)
    return result


# ---- command line ---------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument(
        "--rates", type=_floats, default=[1.0, 2.0, 4.0, 8.0], help="request rates (req/s) (default: 1,2,4,8)"
    )
    p.add_argument("--num-prompts", type=int, default=40, help="requests per point (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per point (default: %(default)s)")
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["prefill-heavy=1024:16", "decode-heavy=64:256"],
        help="NAME=INPUT:OUTPUT token lengths (default: %(default)s)",
    )
    p.add_argument("--modes", nargs="+", default=["pd", "unified"], choices=list(MODES), help="(default: pd unified)")
    p.add_argument("--backend", default="generate", choices=["generate", "openai"], help="(default: %(default)s)")
    p.add_argument(
        "--range-ratio", type=float, default=0.0, help="length spread, see pdserve bench (default: %(default)s)"
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson (default: %(default)s)")
    p.add_argument(
        "--seed", type=int, default=None, help="first workload seed (default: a fresh one per run, recorded)"
    )
    p.add_argument("--pause", type=float, default=1.0, help="seconds between points (default: %(default)s)")
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in ms (default: auto, see --slo-factor)")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in ms (default: auto, see --slo-factor)")
    p.add_argument(
        "--slo-factor",
        type=float,
        default=3.0,
        help="auto SLO = this times the best p50 at the lowest rate, rounded up (default: %(default)s)",
    )
    p.add_argument(
        "--tie",
        type=float,
        default=0.05,
        help="goodput differences within this fraction count as ties in the crossover (default: %(default)s)",
    )
    p.add_argument("--model-path", default=None, help="model directory (default: build the tiny model in the temp dir)")
    p.add_argument("--up-args", default="", help="extra arguments for both `pdserve up` (default: none)")
    p.add_argument("--out-img", default=str(ROOT / "docs" / "img"), help="PNG directory (default: docs/img)")
    p.add_argument("--out-data", default=str(ROOT / "docs" / "data"), help="JSON directory (default: docs/data)")
    p.add_argument("--out-md", default=None, help="also write the markdown here (default: stdout only)")
    p.add_argument("--save-requests", action="store_true", help="keep per-request rows in the JSON (default: off)")
    p.add_argument(
        "--keep-tmp",
        action="store_true",
        help="keep the temp dir (model, data dirs, pdserve logs); it is kept anyway when a run fails (default: off)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars (default: off)")
    g = p.add_argument_group("client overhead against the stub")
    g.add_argument("--client-overhead", action="store_true", help="measure the client against the stub only")
    g.add_argument("--also-client-overhead", action="store_true", help="measure it after the serving sweep too")
    g.add_argument(
        "--stub-rates",
        type=_floats,
        default=[100.0, 250.0, 500.0, 750.0, 1000.0],
        help="open-loop target rates (default: 100,250,500,750,1000)",
    )
    g.add_argument(
        "--stub-concurrency",
        type=_ints,
        default=[16, 64],
        help="closed-loop concurrencies at rate inf (max sustained rate) (default: 16,64)",
    )
    g.add_argument(
        "--stub-seconds", type=float, default=4.0, help="seconds of arrivals per open-loop point (default: %(default)s)"
    )
    g.add_argument(
        "--stub-prompts", type=int, default=1000, help="at least this many requests per point (default: %(default)s)"
    )
    g.add_argument("--stub-tokens", type=int, default=16, help="tokens per stub answer (default: %(default)s)")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    texts = []
    if not args.client_overhead:
        sweep = run_sweeps(args)
        texts.append(report(args, sweep)["markdown"])
        if args.keep_tmp:
            print(f"kept {sweep['root']} (model, data dirs, pdserve logs)", file=sys.stderr)
        else:
            shutil.rmtree(sweep["root"], ignore_errors=True)
    if args.client_overhead or args.also_client_overhead:
        texts.append(client_overhead(args)["markdown"])
    md = "\n".join(texts)
    print(md)
    if args.out_md:
        Path(args.out_md).write_text(md + "\n")
    print(
        f"wrote JSON under {args.out_data}" + ("" if args.client_overhead else f" and PNGs under {args.out_img}"),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
