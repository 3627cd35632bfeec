"""``bench/gpu_engine.py --e2e``: ``pdserve up --mode unified`` on the GPU against the offline
engine on the same work, timed by an outside streaming client (pairs of runs, each cold)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import say

from pdserve.engine.config import EngineConfig


def measure_e2e(args: argparse.Namespace, dims: dict, device: str) -> dict:
    """``pdserve up --mode unified`` against the offline engine, 64 concurrent, cold each run."""
    from common import process_cpu_seconds, py_spy, start_pdserve, stop_pdserve
    from engine_bench import run_pdserve, workload
    from make_dummy_model import write_model_dir
    from pipeline_vs_offline import cpu_per_token, drive, through_http

    from pdserve.engine.loader import build_engine

    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="pdserve-e2e-")) / "model", dims, "bfloat16")
    tokens = 64 * (512 + args.new + 64)
    quantization = getattr(args, "quantization", None)
    kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")
    config = EngineConfig(
        device=device,
        max_total_tokens=tokens,
        max_num_seqs=128,
        chunked_prefill_size=8192,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    offline = build_engine(model_dir, config, load_format="dummy")
    vocab = min(4000, dims["vocab_size"])  # token ids the tokenizer knows: the API checks them
    seed = iter(range(1000, 2000))

    def fresh():  # --e2e-waves times the requests, --requests of them in flight at once
        return workload(args.requests * args.e2e_waves, next(seed), vocab, 512, 512, args.new, args.new)

    run_pdserve(offline, fresh(), args.requests)  # warm-up at full size (a first run compiles)
    flags = ["--device", device, "--model-path", str(model_dir), "--load-format", "dummy"]
    flags += ["--max-total-tokens", str(tokens), "--max-running-requests", "128", "--chunked-prefill-size", "8192"]
    flags += ["--quantization", quantization] if quantization else []
    flags += ["--kv-cache-dtype", kv_cache_dtype]
    by_processes: dict[int, dict] = {}
    for n in [int(x) for x in args.e2e_api_processes.split(",")]:
        up = [*flags, "--api-processes", str(n), *(["--log-level", "DEBUG"] if args.e2e_step_log else [])]
        proc, url = start_pdserve("unified", Path(tempfile.mkdtemp(prefix="pdserve-up-")), up, timeout=600)
        pairs = []
        try:
            asyncio.run(through_http(url, fresh(), args.requests, client=args.e2e_client))  # warm-up at full size
            for _ in range(args.e2e_repeat):
                reqs = fresh()
                offline.pages.reset_prefix_cache()
                steps_before = offline.stats.steps
                base = sum(r.output_len for r in reqs) / run_pdserve(offline, reqs, args.requests)
                offline_steps = offline.stats.steps - steps_before
                reqs = fresh()
                last = len(pairs) == args.e2e_repeat - 1
                profile_to = args.e2e_profile.with_suffix(f".api{n}.txt") if args.e2e_profile else None
                spy = py_spy(proc.pid, profile_to) if profile_to and last else None
                cpu_before = process_cpu_seconds(proc.pid)
                seconds, ttfts, cached, client_cpu, span, timeline = drive(
                    url, reqs, args.requests, args.e2e_client_processes, args.e2e_client
                )
                served = sum(r.output_len for r in reqs) / seconds
                cpu = cpu_per_token(proc.pid, cpu_before, client_cpu, sum(r.output_len for r in reqs))
                if spy is not None:
                    spy.wait(timeout=60)
                pairs.append(
                    {
                        "offline_out_tok_s": base,
                        "offline_steps": offline_steps,
                        "client_processes": args.e2e_client_processes,
                        "client": args.e2e_client,
                        "requests": len(reqs),
                        "in_flight": args.requests,
                        "client_connections": "warm (opened before the clock starts)",
                        "client_span": span,  # perf_counter: against the workers' step timeline
                        "client_timeline": [[round(t, 4) for t in row] for row in timeline],  # sent, first, end
                        "output_tokens": sum(r.output_len for r in reqs),
                        "pipeline_out_tok_s": served,
                        "ttft_p50_s": sorted(ttfts)[len(ttfts) // 2],
                        "pipeline_cached_tokens": cached,
                        "cpu_us_per_out_token": cpu,
                    }
                )
                say(f"e2e ({n} API processes): CPU us per output token {cpu}")
                say(f"e2e ({n} API processes): offline {base:,.0f} out tok/s, pipeline {served:,.0f}")
        finally:
            stop_pdserve(proc)
        ratios = sorted(p["pipeline_out_tok_s"] / p["offline_out_tok_s"] for p in pairs)
        by_processes[n] = {"ratio": ratios[len(ratios) // 2], "pairs": pairs}
    best = max(by_processes, key=lambda n: by_processes[n]["ratio"])
    return {
        "e2e_unified_ratio": by_processes[best]["ratio"],
        "e2e_waves": args.e2e_waves,
        "e2e_api_processes": best,
        "e2e_by_api_processes": by_processes,
    }
