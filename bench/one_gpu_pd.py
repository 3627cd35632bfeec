"""Prefill and decode co-located on one GPU (``pdserve up --colocate``) against unified
serving on the same GPU at its best ``--chunked-prefill-size``, in one run. Writes
``docs/data/one_gpu_pd.json`` (and a plot with ``--img``).

1. **handoff**: the KV of a 4,096-token prompt (Qwen2.5-7B dimensions, bf16: 235 MB) handed
   from one page pool to another by the ``local`` backend, as a co-located decode worker
   reads it: one run, and the same pages scattered (one copy per page).
2. **bare step**: each system's decode step at 16 and 32 in flight with 16-token prompts
   (prefill's share negligible): the ITL p50 there is the step the ITL goal is a multiple of.
3. **load**: 2,048-token prompts, 256 new tokens, 16 and 32 in flight, fresh prompts: ITL
   p50/p99 (every gap of every request), each request's longest gap (p50/p90), output tok/s,
   TTFT p50.
4. **goodput**: a request-rate sweep; goodput = requests/s with TTFT <= ``--slo-ttft`` and the
   request's longest gap <= ``--slo-gap``.

Every system starts fresh, every point has its own seed, and each point's cached tokens are
recorded (0 expected: the prompts are random).

    python bench/one_gpu_pd.py --out docs/data/one_gpu_pd.json --img docs/img/one_gpu_pd.png
    python bench/one_gpu_pd.py --small --device cpu --out /tmp/one_gpu_pd.json   # dry run
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, greedy_probe, log, start_pdserve, stop_pdserve
from make_dummy_model import write_model_dir

from pdserve.bench.config import BenchConfig
from pdserve.bench.metrics import percentile, stat
from pdserve.bench.runner import run_benchmark
from pdserve.bench.shapes import QWEN2_5_0_5B, QWEN2_5_7B
from pdserve.engine.kv_pool import KVPool
from pdserve.schemas import KVLayout
from pdserve.workers.transfer.base import plan_reads
from pdserve.workers.transfer.local import LocalTransfer

PAGE = 16


def measure_handoff(dims: dict[str, Any], tokens: int, device: str, reps: int = 20) -> dict[str, Any]:
    """Milliseconds of a ``local`` read of ``tokens`` tokens' KV, one run and page by page."""
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    dtype = "bfloat16" if device == "cuda" else "float32"
    layout = KVLayout(dims["num_hidden_layers"], dims["num_key_value_heads"], head_dim, PAGE, dtype)
    pages = tokens // PAGE
    prefill = KVPool(layout, pages + 1, torch.device(device))
    decode = KVPool(layout, pages + 1, torch.device(device))
    prefill.tensor.normal_()
    src, dst = LocalTransfer(prefill, "bench-prefill"), LocalTransfer(decode, "bench-decode")
    src.register(prefill.data_ptr, prefill.nbytes)
    dst.register(decode.data_ptr, decode.nbytes)
    out: dict[str, Any] = {"tokens": tokens, "bytes": pages * prefill.page_bytes}
    try:
        for name, order in (("one_run", list(range(pages))), ("scattered", list(range(pages))[::-1])):
            remote = prefill.segments(order)
            reads = plan_reads(remote, prefill.page_bytes, list(range(pages)), decode.data_ptr)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                dst.read(src.endpoint, reads)
                times.append((time.perf_counter() - t0) * 1e3)
            assert torch.equal(decode.tensor[:pages], prefill.tensor[order]), "the copy differs"
            out[name] = {"copies": len(reads), "ms_p50": statistics.median(times), "ms_min": min(times)}
    finally:
        src.close()
        dst.close()
    return out


async def point(
    url: str, model: Path, lens: tuple[int, int], concurrency: int | None, rate: float, num: int, seed: int
) -> dict[str, Any]:
    cfg = BenchConfig(
        base_url=url,
        backend="generate",
        tokenizer=str(model),
        num_prompts=num,
        request_rate=rate,
        max_concurrency=concurrency,
        seed=seed,
        input_len=lens[0],
        output_len=lens[1],
        save_requests=True,
        quiet=True,
    )
    return (await run_benchmark(cfg))["points"][0]


def summary(p: dict[str, Any], slo_ttft: float, slo_gap: float) -> dict[str, Any]:
    m = p["metrics"]
    rows = [r for r in p["requests"] if r.get("ok")]
    gaps = sorted(max(r["itl"]) for r in rows if r.get("itl"))
    firsts = sorted(r["itl"][0] for r in rows if r.get("itl"))
    later = sorted(max(r["itl"][1:]) for r in rows if len(r.get("itl") or ()) > 1)
    timings = m.get("server_timings_ms") or {}
    good = sum(1 for r in rows if r.get("itl") and r["ttft"] <= slo_ttft and max(r["itl"]) <= slo_gap)
    return {
        "completed": m["completed"],
        "failed": m["failed"],
        "out_tok_s": m["output_throughput"],
        "req_per_s": m["request_throughput"],
        "ttft_p50_ms": stat(m, "ttft_ms", "p50"),
        "ttft_p99_ms": stat(m, "ttft_ms", "p99"),
        "itl_p50_ms": stat(m, "itl_ms", "p50"),
        "itl_p99_ms": stat(m, "itl_ms", "p99"),
        "max_gap_p50_ms": percentile(gaps, 50) * 1e3 if gaps else None,
        "max_gap_p90_ms": percentile(gaps, 90) * 1e3 if gaps else None,
        "first_gap_p50_ms": percentile(firsts, 50) * 1e3 if firsts else None,
        "first_gap_p90_ms": percentile(firsts, 90) * 1e3 if firsts else None,
        "later_max_gap_p90_ms": percentile(later, 90) * 1e3 if later else None,
        "kv_queue_p50_ms": (timings.get("kv_queue") or {}).get("p50"),
        "kv_transfer_p50_ms": (timings.get("kv_transfer") or {}).get("p50"),
        "goodput_rps": good / m["duration_s"],
        "cached_tokens": m.get("total_cached_tokens", 0),
        "seed": p["seed"],
    }


def run_system(args: argparse.Namespace, name: str, flags: list[str], model: Path, seed: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"one-gpu-{name}-"))
    log(f"starting {name}: {' '.join(flags)}")
    t0 = time.monotonic()
    extra = [*flags[2:], "--model-path", str(model), *args.up_arg]
    if args.step_log and "--colocate" in flags:
        extra += ["--log-level", "DEBUG"]
    log_path = args.log_dir / f"{name}.log" if args.log_dir else None
    proc, url = start_pdserve(flags[1], root, extra, timeout=args.start_timeout, log_path=log_path)

    out: dict[str, Any] = {"flags": flags, "start_s": time.monotonic() - t0, "bare": {}, "load": {}, "sweep": []}
    slo = (args.slo_ttft, args.slo_gap / 1e3)
    try:
        asyncio.run(point(url, model, (64, 8), 4, float("inf"), 8, seed))  # warm-up (compiles, first graphs)
        probes = [[(7 * i + 3) % 4000 + 3 for i in range(n)] for n in (17, 300, 1000)]
        out["greedy"] = asyncio.run(greedy_probe(url, model, probes, 32))
        for i, n in enumerate(args.loads):
            bare = summary(
                asyncio.run(point(url, model, (16, args.output_len), n, float("inf"), n, seed + 10 + i)), *slo
            )
            out["bare"][str(n)] = bare
            num = max(n * args.waves, n)
            lens = (args.input_len, args.output_len)
            p = summary(asyncio.run(point(url, model, lens, n, float("inf"), num, seed + 20 + i)), *slo)
            out["load"][str(n)] = p
            log(
                f"  {name} x{n}: bare step {bare['itl_p50_ms']:.2f} ms; ITL p50 {p['itl_p50_ms']:.2f} p99 "
                f"{p['itl_p99_ms']:.1f} ms, longest gap p50 {p['max_gap_p50_ms']:.0f} p90 {p['max_gap_p90_ms']:.0f} ms, "
                f"{p['out_tok_s']:.0f} tok/s, TTFT p50 {p['ttft_p50_ms']:.0f} ms, cached {p['cached_tokens']}; first gap "
                f"p50 {p['first_gap_p50_ms']:.0f} p90 {p['first_gap_p90_ms']:.0f} ms, longest later gap p90 "
                f"{p['later_max_gap_p90_ms']:.0f} ms"
            )
        for j, rate in enumerate(args.rates):
            num = max(8, round(rate * args.duration))
            lens = (args.input_len, args.output_len)
            p = summary(asyncio.run(point(url, model, lens, None, rate, num, seed + 40 + j)), *slo)
            p["rate"] = rate
            out["sweep"].append(p)
            log(
                f"  {name} @ {rate:g} req/s: goodput {p['goodput_rps']:.2f}, TTFT p50 {p['ttft_p50_ms']:.0f} ms, "
                f"longest gap p90 {p['max_gap_p90_ms']:.0f} ms"
            )
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        log(f"  {name} failed: {out['error']}")
    finally:
        stop_pdserve(proc)
    out["goodput_rps"] = max((p["goodput_rps"] for p in out["sweep"]), default=None)
    return out


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """Each goal of the issue against the best unified (by output tok/s at each load)."""
    co = result["systems"].get(result.get("colocated_key", "colocated_pd")) or {}
    unified = {k: v for k, v in result["systems"].items() if k.startswith("unified")}
    out: dict[str, Any] = {}
    for n in map(str, result["loads"]):
        c = (co.get("load") or {}).get(n)
        best = max(
            (u["load"][n] for u in unified.values() if n in (u.get("load") or {})),
            key=lambda p: p["out_tok_s"],
            default=None,
        )
        bare = ((co.get("bare") or {}).get(n) or {}).get("itl_p50_ms")
        needed = ("itl_p99_ms", "max_gap_p90_ms", "out_tok_s", "ttft_p50_ms")
        if not c or not best or not bare or any(c.get(k) is None for k in needed):
            continue  # a system that failed there (its point records how)
        out[n] = {
            "itl_p99_over_bare": c["itl_p99_ms"] / bare,
            "max_gap_p90_ms": c["max_gap_p90_ms"],
            "out_tok_s_ratio": c["out_tok_s"] / best["out_tok_s"],
            "ttft_p50_ratio": c["ttft_p50_ms"] / best["ttft_p50_ms"],
        }
    # Greedy against unified at the same chunk size (another chunking rounds bf16 otherwise).
    same = result["systems"].get(f"unified_{result['chunked_prefill_size']}") or {}
    if co.get("greedy") and same.get("greedy"):
        out["greedy_equal"] = co["greedy"] == same["greedy"]
    gp = [u.get("goodput_rps") or 0 for u in unified.values()]
    if co.get("goodput_rps") is not None and gp and max(gp) > 0:
        out["goodput_ratio"] = co["goodput_rps"] / max(gp)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in result["systems"].items():
        pts = run.get("sweep") or []
        if pts:
            ax.plot([p["rate"] for p in pts], [p["goodput_rps"] for p in pts], marker="o", label=name)
    ax.set_xlabel("offered requests/s")
    ax.set_ylabel("goodput, requests/s")
    ax.set_title(
        f"One {result['gpu'] or 'CPU'}: TTFT <= {result['slo_ttft_s']:g} s, longest gap <= "
        f"{result['slo_gap_ms']:g} ms ({result['input_len']} in / {result['output_len']} out)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="small shapes, short runs (the CPU dry run)")
    parser.add_argument(
        "--systems",
        default="colocated,unified-512,unified-2048,unified-8192",
        help="colocated and unified-<chunked-prefill-size>, comma-separated",
    )
    parser.add_argument("--loads", default="16,32", help="requests in flight")
    parser.add_argument("--waves", type=int, default=3, help="requests per load point: this many times the load")
    parser.add_argument("--rates", default="2,4,6,8", help="the goodput sweep's offered rates (req/s; empty: none)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of offered load per sweep rate")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-gap", type=float, default=25.0, help="a request's longest gap, ms")
    parser.add_argument("--phases", default="handoff,serve")
    parser.add_argument("--up-arg", action="append", default=[], help="one more flag for every `pdserve up`")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=None, help="default: fresh from the clock")
    parser.add_argument("--out", type=Path, default=Path("docs/data/one_gpu_pd.json"))
    parser.add_argument("--img", type=Path, default=None)
    parser.add_argument("--verdict-of", default="colocated_pd", help="the co-located system the goals are read on")
    parser.add_argument("--log-dir", type=Path, default=None, help="each system's output in DIR/<system>.log")
    parser.add_argument("--step-log", action="store_true", help="co-located systems log each step (DEBUG)")
    args = parser.parse_args()
    args.loads = [int(x) for x in args.loads.split(",") if x]
    args.rates = [float(x) for x in args.rates.split(",") if x]
    dims = QWEN2_5_0_5B if args.small else QWEN2_5_7B
    args.input_len, args.output_len = (256, 32) if args.small else (2048, 256)
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else ""
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "commit": git_commit(),
        "command": " ".join(sys.argv),
        "dims": "qwen2.5-0.5b" if args.small else "qwen2.5-7b",
        "input_len": args.input_len,
        "output_len": args.output_len,
        "loads": args.loads,
        "chunked_prefill_size": 2048,  # co-located's (pdserve's default)
        "slo_ttft_s": args.slo_ttft,
        "slo_gap_ms": args.slo_gap,
        "seed": seed,
        "systems": {},
        "colocated_key": args.verdict_of,
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    phases = set(args.phases.split(","))
    if "handoff" in phases:
        result["kv_handoff"] = measure_handoff(dims, 4096 if not args.small else 1024, args.device)
        result["kv_handoff_4096_ms"] = result["kv_handoff"]["one_run"]["ms_p50"]
        log(f"handoff: {json.dumps(result['kv_handoff'])}")
        save()
    if "serve" in phases:
        model = write_model_dir(Path(tempfile.mkdtemp()) / "model", dims)
        common = ["--device", args.device, "--load-format", "dummy"]
        for k, name in enumerate(s for s in args.systems.split(",") if s):
            if name.startswith("colocated"):  # colocated[-<chunk>][-sms<N>][-wait<seconds>]
                parts = name.split("-")[1:]
                size = next((p for p in parts if p.isdigit()), "")
                sms = next((p.removeprefix("sms") for p in parts if p.startswith("sms")), "")
                wait = next((p.removeprefix("wait") for p in parts if p.startswith("wait")), "")
                key = "_".join(["colocated_pd", *parts])
                flags = ["--mode", "pd", "--colocate", *common]
                flags += ["--chunked-prefill-size", size] if size else []
                flags += ["--prefill-sms", sms] if sms else []
                flags += ["--prefill-wait-target", wait] if wait else []
            else:
                size = name.removeprefix("unified-")
                key, flags = f"unified_{size}", ["--mode", "unified", "--chunked-prefill-size", size, *common]
            result["systems"][key] = run_system(args, key, flags, model, seed + 1000 * k)
            result["verdict"] = verdict(result)
            save()
        log(f"verdict: {json.dumps(result.get('verdict'))}")
        if args.img:
            plot(result, args.img)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
