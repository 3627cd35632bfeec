"""Prefill on GPU 0 and decode on GPU 1 (KV over NCCL) against two unified replicas on the
same two GPUs, in one run. Writes ``docs/data/two_gpu_pd.json``.

1. **transfer**: the KV of a 4,096-token prompt (Qwen2.5-7B dimensions, random bf16: 28
   layers x 4 KV heads x 128, 235 MB) moved by the ``nccl`` backend between two processes,
   one per GPU: the whole pull a decode worker makes (push request over NATS, one message,
   landing in its pages), the same with pages scattered on both sides (gather + scatter),
   and the bare send/recv of those bytes over the same kind of communicator. Beside it,
   Mooncake's own GPU path (each of ``--mooncake-protocols`` in child processes with a
   timeout: its ``nvlink_intra`` hung on one GPU before).
2. **serve**: ``pdserve up`` with 1 prefill + 1 decode (``--worker-devices cuda:0,cuda:1
   --disaggregation-transfer-backend nccl``), then with 2 unified workers on the same GPUs,
   behind the same API; on each, the TTFT of a 4,096-token prompt (PD only), a greedy probe,
   and a request-rate sweep with ``pdserve bench`` on a prefill-heavy (2,048 in / 128 out)
   and a balanced (512 in / 512 out) workload. Goodput: requests/s with TTFT <= 1 s and the
   request's own p99 ITL <= 30 ms (the issue's), the figure the best over the sweep's rates;
   beside it the same with the request's longest gap (``max-itl``) and its TPOT, and the
   first gap (first to second token: in PD the hand-off to decode, which a request's own
   p99 over ~100 gaps forgives).
3. **greedy**: the probe's tokens, PD against unified.

Every run is cold: each system starts fresh, every (system, workload) gets its own seed,
and the cached tokens each point saw are reported.

    python bench/two_gpu_pd.py                          # a 2-GPU host (bash bench/gpu.sh two_gpu_pd)
    python bench/two_gpu_pd.py --small --device cpu     # dry run: small shapes, gloo, one CPU

A rehearsal on one GPU (both roles and both replicas share GPU 0; the KV between processes on
one GPU over Mooncake, as NCCL refuses two ranks on one device) exercises every serving path
of the real run; its figures are not the issue's:

    python bench/two_gpu_pd.py --phases serve --worker-devices cuda:0,cuda:0 \
        --backend mooncake --up-arg=--max-total-tokens=131072 --out /tmp/one_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, greedy_probe, log, plot_goodput
from kv_transfer import measure_mooncake, measure_p2p
from make_dummy_model import write_model_dir
from serving_sweep import goodput
from system import System

from pdserve.bench.config import BenchConfig
from pdserve.bench.metrics import SLO, percentile, stat
from pdserve.bench.runner import run_benchmark
from pdserve.bench.shapes import QWEN2_5_0_5B, QWEN2_5_7B
from pdserve.schemas import KVLayout

ROOT = Path(__file__).resolve().parent.parent
PAGE_SIZE = 16


def layout_of(dims: dict[str, Any]) -> KVLayout:
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    return KVLayout(dims["num_hidden_layers"], dims["num_key_value_heads"], head_dim, PAGE_SIZE, "bfloat16")


# ---- 2. serving: PD and unified behind the same API ---------------------------------------------
WORKLOADS = {"prefill_heavy": (2048, 128), "balanced": (512, 512)}
SMALL_WORKLOADS = {"prefill_heavy": (256, 16), "balanced": (48, 48)}


async def bench_point(
    args: argparse.Namespace, url: str, model: Path, lens: tuple[int, int], rate: float, num: int, seed: int
) -> dict[str, Any]:
    """One ``pdserve bench`` point (``generate`` backend, token-id prompts, greedy, ignore_eos)."""
    cfg = BenchConfig(
        base_url=url,
        backend="generate",
        tokenizer=str(model),
        num_prompts=num,
        request_rate=rate,
        seed=seed,
        input_len=lens[0],
        output_len=lens[1],
        slo_ttft=args.slo_ttft,
        slo_itl=args.slo_itl,
        slo_itl_metric="p99-itl",
        save_requests=True,
        quiet=True,
    )
    point = (await run_benchmark(cfg))["points"][0]
    m = point["metrics"]
    m["goodput"], m["goodput_fraction"] = goodput(point, SLO(args.slo_ttft, args.slo_itl, "p99-itl"))
    # Stricter readings beside the issue's: a request's own p99 over ~100 gaps forgives its
    # longest, which is where PD's hand-off (first token from prefill, second from decode) shows.
    for metric in ("max-itl", "tpot"):
        m[f"goodput_{metric}"] = goodput(point, SLO(args.slo_ttft, args.slo_itl, metric))[0]
    firsts = sorted(row["itl"][0] for row in point["requests"] if row.get("ok") and row.get("itl"))
    m["first_gap_ms"] = {q: percentile(firsts, q) * 1e3 for q in (50, 99)} if firsts else None
    return point


def summary(point: dict[str, Any]) -> dict[str, Any]:
    """The figures of a point worth a table row."""
    m = point["metrics"]
    timings = m.get("server_timings_ms") or {}
    return {
        "rate": point["request_rate"],
        "seed": point["seed"],
        "completed": m["completed"],
        "failed": m["failed"],
        "req_per_s": m["request_throughput"],
        "goodput_rps": m["goodput"],
        "goodput_fraction": m["goodput_fraction"],
        "goodput_rps_max_itl": m.get("goodput_max-itl"),
        "goodput_rps_tpot": m.get("goodput_tpot"),
        "first_gap_p50_ms": (m.get("first_gap_ms") or {}).get(50),
        "first_gap_p99_ms": (m.get("first_gap_ms") or {}).get(99),
        "ttft_p50_ms": stat(m, "ttft_ms", "p50"),
        "ttft_p99_ms": stat(m, "ttft_ms", "p99"),
        "itl_p50_ms": stat(m, "itl_ms", "p50"),
        "itl_p99_ms": stat(m, "itl_ms", "p99"),
        "tpot_p50_ms": stat(m, "tpot_ms", "p50"),
        "kv_transfer_p50_ms": (timings.get("kv_transfer") or {}).get("p50"),
        "kv_queue_p50_ms": (timings.get("kv_queue") or {}).get("p50"),  # KVReady published -> a decode worker took it
        "cached_tokens": m.get("total_cached_tokens", 0),
        "errors": m.get("errors"),
    }


def serve(args: argparse.Namespace, mode: str, model: Path, extra: list[str], seed: int) -> dict[str, Any]:
    """Start one system, probe and sweep it, stop it."""
    import random

    root = Path(tempfile.mkdtemp(prefix=f"pd-two-{mode}-"))
    system = System(mode, model, root, extra)
    log(f"starting {system.label}: {' '.join(extra)} (log {system.log_path})")
    t0 = time.monotonic()
    out: dict[str, Any] = {"label": system.label, "flags": extra}
    try:
        system.start(timeout=args.start_timeout)
        out["start_s"] = time.monotonic() - t0
        log(f"  ready after {out['start_s']:.0f}s")
        rng = random.Random(args.seed)  # the same probe prompts on both systems
        prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in (17, 130, 515, 1000)]
        out["greedy"] = asyncio.run(greedy_probe(system.url, model, prompts, args.greedy_tokens))
        if mode == "pd":
            long = asyncio.run(bench_point(args, system.url, model, (args.tokens, 8), 0.5, 3, seed))
            out["ttft_4096"] = summary(long)
            log(f"  {args.tokens}-token prompt: TTFT p50 {out['ttft_4096']['ttft_p50_ms']:.1f} ms")
        out["workloads"] = {}
        for k, (name, lens) in enumerate(args.workloads.items()):
            points = []
            for j, rate in enumerate(args.rates):
                num = max(args.min_prompts, round(rate * args.duration))
                point = asyncio.run(bench_point(args, system.url, model, lens, rate, num, seed + 100 * (k + 1) + j))
                points.append(summary(point))
                p = points[-1]
                log(
                    f"  {name} @ {rate:g} req/s: goodput {p['goodput_rps']:.2f} req/s (max ITL "
                    f"{p['goodput_rps_max_itl']:.2f}), TTFT p99 {p['ttft_p99_ms'] or 0:.0f} ms, ITL p99 "
                    f"{p['itl_p99_ms'] or 0:.1f} ms, first gap p99 {p['first_gap_p99_ms'] or 0:.0f} ms, "
                    f"cached {p['cached_tokens']}"
                )
            out["workloads"][name] = {"input_len": lens[0], "output_len": lens[1], "points": points}
    except Exception as exc:  # recorded with the log's tail: the other system still runs
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["log_tail"] = system.log_tail()
        log(f"  {mode} failed: {out['error']}")
    finally:
        system.stop()
    return out


# ---- the run ------------------------------------------------------------------------------------
def best_goodput(run: dict[str, Any], workload: str, key: str = "goodput_rps") -> float | None:
    points = (run.get("workloads") or {}).get(workload, {}).get("points") or []
    return max((p[key] for p in points if p.get(key) is not None), default=None)


def plot(result: dict[str, Any], out: Path) -> list[str]:
    """Goodput against offered rate, PD against two unified replicas, one panel per workload;
    the lines' labels."""
    runs = {result[mode]["label"]: result[mode] for mode in ("pd", "unified") if result.get(mode)}
    workloads: dict[str, Any] = {}
    for run in runs.values():
        for name, w in (run.get("workloads") or {}).items():
            workloads.setdefault(name, {"input_len": w["input_len"], "output_len": w["output_len"]})
    gpus = len(set(result.get("worker_devices") or ["cuda:0", "cuda:1"]))
    where = f"{gpus} x {result['gpus'][0]}" if result["gpus"] else "CPU (dry run)"
    return plot_goodput(runs, workloads, result["slo"], f"PD against two unified replicas on {where}", out)


def pick_devices(args: argparse.Namespace) -> tuple[list[str], str, list[str]]:
    """The two worker devices, PD's backend and the GPUs' names; a GPU named that is not
    there is a clear error before anything starts."""
    default = "cuda:0,cuda:1" if args.device == "cuda" else "cpu,cpu"
    devices = (args.worker_devices or default).split(",")
    if len(devices) != 2:
        raise SystemExit(f"--worker-devices names two devices, not {devices}")
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device != "cuda":
        return devices, backend, []
    indices = [torch.device(d).index or 0 for d in devices]
    if max(indices) >= torch.cuda.device_count():
        raise SystemExit(f"needs CUDA devices {devices}; this host has {torch.cuda.device_count()} (or --device cpu)")
    if backend == "nccl" and indices[0] == indices[1]:
        raise SystemExit("nccl needs two GPUs (it refuses two ranks on one device): --backend mooncake")
    return devices, backend, [torch.cuda.get_device_name(i) for i in indices]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cuda: GPUs 0 and 1 over nccl; cpu: gloo"
    )
    parser.add_argument("--small", action="store_true", help="small shapes and short sweeps (the dry run)")
    parser.add_argument(
        "--model-path",
        type=Path,
        help="default: Qwen2.5-7B dimensions with random weights (--small: the built-in tiny model)",
    )
    parser.add_argument("--phases", default="transfer,serve", help="comma-separated: transfer, serve")
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="prompt length of the transfer and TTFT figures (default 4096; --small: 1024)",
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--transfer-timeout", type=float, default=150.0)
    parser.add_argument(
        "--mooncake-protocols", default="tcp,nvlink_intra", help="each in child processes with a timeout; empty: none"
    )
    parser.add_argument("--mooncake-timeout", type=float, default=30.0)
    parser.add_argument("--rates", default=None, help="request rates of the sweep (default 3,8,16; --small: 1,3)")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of arrivals per point (default 6; --small: 4)"
    )
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--slo-ttft", type=float, default=1000.0, help="ms")
    parser.add_argument("--slo-itl", type=float, default=30.0, help="ms, on each request's own p99 ITL")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock (every run cold)")
    parser.add_argument(
        "--out", type=Path, default=None, help="default docs/data/two_gpu_pd.json (--small: a temp file)"
    )
    parser.add_argument(
        "--img",
        type=Path,
        default=None,
        help="the goodput plot (default docs/img/two_gpu_pd.png; --small: a temp file)",
    )
    parser.add_argument("--plot-from", type=Path, help="only draw --img from this run's JSON (e.g. on another machine)")
    parser.add_argument(
        "--worker-devices", default=None, help="the two devices (default cuda:0,cuda:1; --device cpu: cpu,cpu)"
    )
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo", "mooncake"),
        default=None,
        help="PD's KV transfer backend (default nccl; --device cpu: gloo)",
    )
    parser.add_argument(
        "--up-arg",
        action="append",
        default=[],
        metavar="FLAG[=VALUE]",
        help="one more option for both systems' `pdserve up` (repeatable), e.g. --up-arg=--max-total-tokens=131072",
    )
    args = parser.parse_args()
    img = args.img or (
        Path(tempfile.gettempdir()) / "two_gpu_pd_small.png" if args.small else ROOT / "docs/img/two_gpu_pd.png"
    )
    if args.plot_from:
        plot(json.loads(args.plot_from.read_text()), img)
        log(f"wrote {img}")
        return 0
    args.rates = [float(r) for r in (args.rates or ("1,3" if args.small else "3,8,16")).split(",")]
    args.duration = args.duration or (4.0 if args.small else 6.0)
    args.tokens = args.tokens or (1024 if args.small else 4096)
    args.workloads = SMALL_WORKLOADS if args.small else WORKLOADS
    args.seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    out = args.out or (
        Path(tempfile.gettempdir()) / "two_gpu_pd_small.json" if args.small else ROOT / "docs/data/two_gpu_pd.json"
    )
    phases = set(args.phases.split(","))
    devices, backend, gpus = pick_devices(args)
    dims = QWEN2_5_0_5B if args.small else QWEN2_5_7B
    layout = layout_of(dims)
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "gpus": gpus,
        "device": args.device,
        "worker_devices": devices,
        "backend": backend,
        "small": args.small,
        "commit": git_commit(),
        "argv": sys.argv[1:],
        "seed": args.seed,
        "slo": {"ttft_ms": args.slo_ttft, "itl_ms": args.slo_itl, "itl_metric": "p99-itl (each request's own)"},
        "transfer_layout": {
            "tokens": args.tokens,
            "layout": layout.describe(),
            "dims": "qwen2.5-0.5b" if args.small else "qwen2.5-7b",
        },
    }
    started = time.monotonic()

    def save() -> None:
        """Write what is measured so far (a run cut short by its timeout still leaves data)."""
        p2p = result.get("p2p") or {}
        result["kv_transfer_4096_ms"] = p2p.get("pull_median_ms")
        ttft = ((result.get("pd") or {}).get("ttft_4096") or {}).get("ttft_p50_ms")
        pull = result["kv_transfer_4096_ms"]
        result["transfer_share_of_ttft"] = pull / ttft if ttft and pull else None
        result["seconds"] = time.monotonic() - started
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    if "transfer" in phases and backend != "mooncake":  # Mooncake's own figures follow
        log(f"transfer: {args.tokens} tokens of {layout.describe()} over {backend}, {devices[0]} -> {devices[1]}")
        result["p2p"] = measure_p2p(args, layout, devices, backend)
        log(f"  {json.dumps({k: v for k, v in result['p2p'].items() if not k.endswith('_ms')})}")
        save()
    if "transfer" in phases:
        result["mooncake"] = []
        for protocol in [p for p in args.mooncake_protocols.split(",") if p]:
            log(f"mooncake {protocol} (timeout {args.mooncake_timeout:g}s)")
            result["mooncake"].append(measure_mooncake(args, layout, devices, protocol))
            log(f"  {result['mooncake'][-1].get('read_median_ms') or result['mooncake'][-1].get('error')}")
            save()
    if "serve" in phases:
        if args.model_path:
            model, dummy = args.model_path, []
        elif args.small:
            from pdserve.engine.tiny_model import ensure_default_model

            model, dummy = ensure_default_model(Path(tempfile.mkdtemp(prefix="pd-two-model-"))), []
        else:
            model_dir = Path(tempfile.mkdtemp(prefix="pd-two-model-"))
            model, dummy = write_model_dir(model_dir, QWEN2_5_7B), ["--load-format", "dummy"]
        common = ["--device", args.device, "--worker-devices", ",".join(devices), *dummy]
        common += [part for arg in args.up_arg for part in arg.split("=", 1)]
        result["pd"] = serve(
            args, "pd", model, [*common, "--disaggregation-transfer-backend", backend], args.seed + 1000
        )
        result["goodput_pd_rps"] = best_goodput(result["pd"], "prefill_heavy")
        result["goodput_balanced_pd_rps"] = best_goodput(result["pd"], "balanced")
        result["goodput_pd_rps_max_itl"] = best_goodput(result["pd"], "prefill_heavy", "goodput_rps_max_itl")
        save()
        result["unified"] = serve(args, "unified", model, common, args.seed + 2000)
        result["goodput_unified_rps"] = best_goodput(result["unified"], "prefill_heavy")
        result["goodput_balanced_unified_rps"] = best_goodput(result["unified"], "balanced")
        result["goodput_unified_rps_max_itl"] = best_goodput(result["unified"], "prefill_heavy", "goodput_rps_max_itl")
        pd_greedy, un_greedy = result["pd"].get("greedy"), result["unified"].get("greedy")
        result["greedy_identical"] = pd_greedy is not None and pd_greedy == un_greedy
    save()
    keys = (
        "kv_transfer_4096_ms",
        "transfer_share_of_ttft",
        "goodput_pd_rps",
        "goodput_unified_rps",
        "goodput_pd_rps_max_itl",
        "goodput_unified_rps_max_itl",
        "greedy_identical",
    )
    log(f"wrote {out}: " + json.dumps({k: result.get(k) for k in keys}))
    if "serve" in phases:
        try:
            plot(result, img)
            log(f"wrote {img}")
        except ImportError:  # the GPU image may lack matplotlib: the JSON has every point
            log(f"no matplotlib here: draw the plot with --plot-from {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
