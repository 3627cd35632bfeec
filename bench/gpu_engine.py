"""pdserve's engine against ``transformers`` on one GPU, same model and work, one run.

A model of Qwen2.5-7B dimensions with random bf16 weights (both systems share the very
same tensors). Every measured run is cold: fresh random prompts, prefix cache reset,
cached tokens reported.

  * decode step at batch 1: a 512-token prompt, 128 new tokens, milliseconds per token
    after the first (through the engine loop; the graph replay alone is reported too);
  * decode throughput: 64 requests of 512 in / 128 out, output tokens per second over
    the decode phase (after the last request's first token), and over the whole run;
  * prefill: one 4,096-token prompt, time to its first token;
  * end to end (``--e2e``): ``pdserve up --mode unified`` on the GPU against the offline
    engine on the same workload, 64 concurrent, fresh prompts each run.

    python bench/gpu_engine.py --json docs/data/gpu_engine.json [--e2e] [--profile prof.txt]
    python bench/gpu_engine.py --device cpu --small     # a quick check of the script

``--quantization fp8``: the engine's decoder layers in FP8 weights (quantized at load; the
JSON records ``quantization`` and the weights' bytes before and after). The stock
``transformers`` run is skipped then (the engine drops the model's 16-bit projections):

    python bench/gpu_engine.py --quantization fp8 --json /tmp/gpu_engine_fp8.json   # docs/data/gpu_engine_fp8.json: bench/gpu.sh fp8

``--kv-cache-dtype fp8_e4m3``: the page pool in FP8 with a scale per page per KV head (the
JSON records the pool's dtype, bytes per token and pages per GiB; the sizes of the runs are
fixed, so the figures are the speed of FP8 attention, not of a larger pool):

    python bench/gpu_engine.py --kv-cache-dtype fp8_e4m3 --json /tmp/gpu_engine_fp8_kv.json   # bash bench/gpu.sh fp8: all
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import say
from gpu_e2e import measure_e2e
from gpu_engine_fp8 import add_fp8_flags, configure_fp8, first_token_logprobs, logit_error
from gpu_timing import Timer, profile, prompts

from pdserve.bench.shapes import QWEN2_5_7B
from pdserve.engine.config import KV_CACHE_DTYPES, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv_pool import bytes_per_token
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.schemas import SamplingParams

SMALL = dict(QWEN2_5_7B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
SMALL.update(num_key_value_heads=2, vocab_size=1000)


# ---- pdserve's engine ------------------------------------------------------------------
def engine_run(engine: Engine, batch: list[list[int]], new: int, timer: Timer) -> dict[str, float]:
    """Seconds in all, to the first token of the last request, and the tokens after it."""
    engine.pages.reset_prefix_cache()
    cached_before = engine.stats.cached_tokens
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    tag = f"{time.perf_counter()}"
    for i, p in enumerate(batch):
        engine.add_request(f"{tag}-{i}", p, params)
    seen: set[str] = set()
    tokens_after = 0
    start = timer.now()
    all_first = 0.0
    while engine.has_work():
        for out in engine.step():
            if out.rid not in seen:
                seen.add(out.rid)
                if len(seen) == len(batch):
                    all_first = time.perf_counter() - start
            elif len(seen) == len(batch):
                tokens_after += len(out.token_ids)
    total = timer.now() - start
    return {
        "started_at": start,  # perf_counter, after the device was idle
        "seconds": total,
        "all_first_s": all_first,
        "tokens_after_first": tokens_after,
        "cached_tokens": engine.stats.cached_tokens - cached_before,
    }


def measure_engine(engine: Engine, vocab: int, timer: Timer, rng: random.Random, args: argparse.Namespace) -> dict:
    row: dict[str, object] = {
        "model_impl": engine.runner.model_impl,
        "cuda_graphs": engine.runner.graphs is not None,
        "overlap": engine.overlap,
    }
    engine_run(engine, prompts(rng, 2, 64, vocab), 8, timer)  # warm-up (kernels compile)
    say("pdserve: batch 1")
    runs = [engine_run(engine, prompts(rng, 1, 512, vocab), args.new, timer) for _ in range(3)]
    per_token = [(r["seconds"] - r["all_first_s"]) / (args.new - 1) * 1e3 for r in runs]
    row["decode_bs1_ms"] = statistics.median(per_token)
    row["decode_bs1_ms_runs"] = per_token
    graphs = engine.runner.graphs
    if graphs is not None:
        row["decode_bs1_graph_replay_ms"] = replay_ms(graphs, 1, timer)
        row["decode64_graph_replay_ms"] = replay_ms(graphs, 64, timer)
    fast = engine.runner.fast
    options = {  # batch-1 options of the fast model, each measured on and then switched back off
        "fused_merge": args.try_fused_merge,  # the attention splits merged in one kernel
        "pdl": args.try_pdl,  # each GEMV a programmatic dependent launch
        "l2_prefetch": args.try_l2_prefetch,  # the o projection read into L2 during attention
        "separate_rope": args.try_separate_rope,  # rotary + KV store in a kernel of its own, as before
    }
    for option in [name for name, wanted in options.items() if wanted and fast is not None]:
        setattr(fast, option, True)
        engine.runner.graphs = graphs = None if graphs is None else recapture(engine)
        runs = [engine_run(engine, prompts(rng, 1, 512, vocab), args.new, timer) for _ in range(3)]
        row[f"decode_bs1_{option}_ms"] = statistics.median(
            (r["seconds"] - r["all_first_s"]) / (args.new - 1) * 1e3 for r in runs
        )
        if graphs is not None:
            row[f"decode_bs1_{option}_graph_replay_ms"] = replay_ms(graphs, 1, timer)
        setattr(fast, option, False)  # the rest measures the default
        engine.runner.graphs = graphs = None if graphs is None else recapture(engine)
    say(f"pdserve: {args.requests} requests")
    engine_run(engine, prompts(rng, args.requests, 512, vocab), 8, timer)  # the same shapes, warmed up
    runs = [engine_run(engine, prompts(rng, args.requests, 512, vocab), args.new, timer) for _ in range(3)]
    row["decode64_out_tok_s"] = statistics.median(
        r["tokens_after_first"] / (r["seconds"] - r["all_first_s"]) for r in runs
    )
    row["whole64_out_tok_s"] = statistics.median(args.requests * args.new / r["seconds"] for r in runs)
    row["runs64"] = runs
    say("pdserve: prefill 4096")
    fast = engine.runner.fast
    device_ms: list[float] = []
    host_ms: list[float] = []
    host_starts: list[float] = []  # perf_counter when each forward pass was called
    ahead: list[torch.Tensor] = []  # when set: work queued before the forward (see below)
    if fast is not None and timer.device.type == "cuda":  # the forward pass's device time too
        forward = fast.forward

        def timed_forward(step):
            if ahead:
                for _ in range(8):
                    ahead[0] @ ahead[0]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launched = time.perf_counter()
            host_starts.append(launched)
            out = forward(step)
            host_ms.append((time.perf_counter() - launched) * 1e3)
            end.record()
            end.synchronize()
            device_ms.append(start.elapsed_time(end))
            return out

        fast.forward = timed_forward  # type: ignore[method-assign]
    engine_run(engine, prompts(rng, 1, 4096, vocab), 1, timer)
    device_ms.clear()
    host_ms.clear()
    host_starts.clear()
    runs = [engine_run(engine, prompts(rng, 1, 4096, vocab), 1, timer) for _ in range(9)]
    row["prefill4096_ms"] = statistics.median(r["seconds"] * 1e3 for r in runs)
    row["prefill4096_ms_runs"] = [r["seconds"] * 1e3 for r in runs]
    if device_ms:
        row["prefill4096_forward_device_ms"] = statistics.median(device_ms)
        # the host's time to launch the forward pass: at or above the device time, the GPU waits on it
        row["prefill4096_forward_host_ms"] = statistics.median(host_ms)
        if len(host_starts) == len(runs):  # one forward pass a run: the host's work around it
            before = [(t - r["started_at"]) * 1e3 for t, r in zip(host_starts, runs, strict=True)]
            row["prefill4096_before_forward_ms"] = statistics.median(before)
            row["prefill4096_after_forward_ms"] = statistics.median(
                r["seconds"] * 1e3 - b - d for r, b, d in zip(runs, before, device_ms, strict=True)
            )
        # the same forward pass with ~10 ms of matrix products queued before it: the GPU at full clock
        # and the host ahead of it from the first kernel (what it costs inside a busy server)
        ahead.append(torch.randn(8192, 8192, device=timer.device, dtype=torch.bfloat16))
        device_ms.clear()
        for _ in range(5):
            engine_run(engine, prompts(rng, 1, 4096, vocab), 1, timer)
        row["prefill4096_forward_device_queued_ms"] = statistics.median(device_ms)
        ahead.clear()
    if fast is not None and timer.device.type == "cuda":  # each attention backend the library offers
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    engine_run(engine, prompts(rng, 1, 4096, vocab), 1, timer)
                    device_ms.clear()
                    runs = [engine_run(engine, prompts(rng, 1, 4096, vocab), 1, timer) for _ in range(3)]
            except RuntimeError as exc:
                say(f"prefill with {backend.name}: {exc}")
                continue
            row[f"prefill4096_{backend.name.lower()}_ms"] = statistics.median(r["seconds"] * 1e3 for r in runs)
            if device_ms:
                row[f"prefill4096_{backend.name.lower()}_device_ms"] = statistics.median(device_ms)
    if fast is not None:  # the same prompts' attention through the paged prefill kernel instead
        fast.sdpa_prefill = False
        runs = [engine_run(engine, prompts(rng, 1, 4096, vocab), 1, timer) for _ in range(3)]
        fast.sdpa_prefill = True
        row["prefill4096_paged_kernel_ms"] = statistics.median(r["seconds"] * 1e3 for r in runs)
        if device_ms:
            fast.forward = forward  # type: ignore[method-assign]
    row["cached_tokens"] = engine.stats.cached_tokens
    return row


def recapture(engine: Engine) -> object:
    """The runner's decode graphs captured again (after a change to the forward pass)."""
    from pdserve.engine.cuda_graph import DecodeGraphs

    old = engine.runner.graphs
    assert old is not None and engine.runner.fast is not None
    graphs = DecodeGraphs(
        engine.runner.fast.forward,
        old.max_batch,
        old._tables.shape[1],
        old.page_size,
        old.scratch_page,
        old.splits_for,
        engine.runner.device,
    )
    graphs.capture()
    return graphs


def replay_ms(graphs: object, batch: int, timer: Timer, n: int = 50) -> float:
    """Device time of one decode graph replay (the forward pass alone)."""
    graph = graphs._graphs[batch]  # type: ignore[attr-defined]
    graph.replay()
    timer.sync()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    timer.sync()
    return start.elapsed_time(end) / n


# ---- transformers ----------------------------------------------------------------------
def hf_generate(model: torch.nn.Module, batch: list[list[int]], new: int, timer: Timer) -> float:
    ids = torch.tensor(batch, device=timer.device)
    with torch.inference_mode():
        start = timer.now()
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        return timer.now() - start


def measure_transformers(model: torch.nn.Module, vocab: int, timer: Timer, rng: random.Random, args) -> dict:
    row: dict[str, object] = {}
    hf_generate(model, prompts(rng, 1, 64, vocab), 4, timer)
    say("transformers: batch 1")
    p = prompts(rng, 1, 512, vocab)
    t1 = hf_generate(model, p, 1, timer)
    tn = hf_generate(model, p, args.new, timer)
    row["decode_bs1_ms"] = (tn - t1) / (args.new - 1) * 1e3
    say(f"transformers: {args.requests} requests")
    batch = prompts(rng, args.requests, 512, vocab)
    t1 = hf_generate(model, batch, 1, timer)
    tn = hf_generate(model, batch, args.new, timer)
    row["decode64_out_tok_s"] = args.requests * (args.new - 1) / (tn - t1)
    row["whole64_out_tok_s"] = args.requests * args.new / tn
    say("transformers: prefill 4096")
    times = []
    with torch.inference_mode():
        for _ in range(3):
            ids = torch.tensor(prompts(rng, 1, 4096, vocab), device=timer.device)
            start = timer.now()
            model(input_ids=ids, logits_to_keep=1)
            times.append((timer.now() - start) * 1e3)
    row["prefill4096_ms"] = statistics.median(times)
    row["prefill4096_ms_runs"] = times
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small stand-in for the 7B model (script check)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path, help="write a device-time profile of decode and prefill here")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--quantization",
        choices=("fp8",),
        help="fp8: the engine's decoder layers in FP8 weights (a GPU of compute capability 8.9 or above; "
        "implies --skip-transformers)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the engine's KV page pool: auto (bf16 here), bf16 or fp8_e4m3 (default: %(default)s)",
    )
    add_fp8_flags(parser)
    parser.add_argument(
        "--try-fused-merge", action="store_true", help="also batch 1 with the attention splits merged in-kernel"
    )
    parser.add_argument("--try-pdl", action="store_true", help="also batch 1 with programmatic dependent launches")
    parser.add_argument(
        "--try-l2-prefetch", action="store_true", help="also batch 1 with the o projection prefetched into L2"
    )
    parser.add_argument(
        "--try-separate-rope",
        action="store_true",
        help="also batch 1 with the rotary + KV store in a kernel of its own (not inside decode attention)",
    )
    parser.add_argument("--e2e", action="store_true", help="also pdserve up --mode unified against the offline engine")
    parser.add_argument("--e2e-repeat", type=int, default=3)
    parser.add_argument(
        "--e2e-waves",
        type=int,
        default=4,
        help="end to end: this many times --requests requests, --requests in flight (1: one wave, mostly the "
        "ramp-up and the drain; default %(default)s)",
    )
    parser.add_argument("--only-e2e", action="store_true", help="the end-to-end pairs alone")
    parser.add_argument(
        "--e2e-client-processes",
        type=int,
        default=1,
        help="processes that send the requests and read the streams (default: %(default)s)",
    )
    parser.add_argument(
        "--e2e-client",
        choices=("raw", "httpx"),
        default="raw",
        help="how the client reads the streams: raw (bench/sse_client.py, a few us a token) or httpx "
        "(110-210 us a token) (default: %(default)s)",
    )
    parser.add_argument(
        "--e2e-step-log", action="store_true", help="the pipeline at --log-level DEBUG: each worker step on stderr"
    )
    parser.add_argument("--e2e-profile", type=Path, help="py-spy stacks of the last pipeline run (raw format)")
    parser.add_argument(
        "--e2e-api-processes",
        default="1,2",
        help="`pdserve up --api-processes` values to measure (default: %(default)s)",
    )
    args = parser.parse_args()
    fp8_choices = configure_fp8(args)
    quiet_transformers()
    from transformers import AutoModelForCausalLM, Qwen2Config

    device = torch.device(args.device)
    timer = Timer(device)
    dims = SMALL if args.small else QWEN2_5_7B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    say("building the model with random weights")
    with device:
        model = AutoModelForCausalLM.from_config(Qwen2Config(**dims), dtype=dtype, attn_implementation="sdpa").eval()
    vocab = min(dims["vocab_size"], 100_000)
    new_tokens = 64 * (512 + args.new + 64)
    config = EngineConfig(
        device=str(device),
        max_total_tokens=max(new_tokens, 4096 + 1024),
        max_num_seqs=max(args.requests, 8),
        chunked_prefill_size=8192,
        cuda_graph_max_batch=max(args.requests, 8),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    parameters = sum(p.numel() for p in model.parameters())  # before FP8 drops the 16-bit projections
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reference_logprobs = None
    if args.fp8_logit_error and args.quantization:
        say("the bf16 reference: a throwaway engine over the same weights")
        plain = dataclasses.replace(config, quantization=None, cuda_graph_max_batch=0)
        reference = Engine(ModelRunner(ModelSpec(Path("qwen2.5-7b-dims")), plain, model=model), plain)
        fixed = prompts(random.Random(1234), 64, 512, vocab)
        reference_logprobs = first_token_logprobs(reference, fixed)
        del reference
        torch.cuda.empty_cache() if device.type == "cuda" else None
    started = time.monotonic()
    engine = Engine(ModelRunner(ModelSpec(Path("qwen2.5-7b-dims")), config, model=model), config)
    say(f"engine ready in {time.monotonic() - started:.1f} s ({engine.runner.model_impl})")
    rng = random.Random(int(time.time()))
    result: dict[str, object] = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": "Qwen2.5-7B dimensions, random weights" if not args.small else "small stand-in",
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": args.quantization or "none",
        "kv_cache_dtype": engine.runner.layout.dtype,
        "kv_bytes_per_token": bytes_per_token(engine.runner.layout),
        "kv_pages_per_gib": round(2**30 / engine.runner.pool.page_bytes, 1),
        "parameters": parameters,
        "weight_bytes": weight_bytes,
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
    }
    if args.quantization:
        result["fp8_kernels"] = fp8_choices
    if engine.runner.fp8_bytes is not None:  # the decoder layers' linear weights, 16-bit and FP8 (with scales)
        before, after = engine.runner.fp8_bytes
        result.update(
            fp8_linear_bytes_before=before,
            fp8_linear_bytes_after=after,
            weight_bytes_served=weight_bytes - before + after,
        )
    if reference_logprobs is not None:
        result["fp8_logit_error"] = logit_error(reference_logprobs, first_token_logprobs(engine, fixed))
        say(f"logit error against bf16: {json.dumps(result['fp8_logit_error'])}")
    if args.quantization and not args.skip_transformers:
        say("--quantization fp8: no transformers run (the model's 16-bit projections are gone)")
        args.skip_transformers = True
    if not args.only_e2e:
        result.update(measure_engine(engine, vocab, timer, rng, args))
    if args.profile and not args.only_e2e:
        profile(engine, vocab, rng, args.profile)
    if not args.skip_transformers and not args.only_e2e:
        result["transformers"] = measure_transformers(model, vocab, timer, rng, args)
    if args.json:  # written now and again after the end-to-end pairs
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.e2e or args.only_e2e:
        del engine
        torch.cuda.empty_cache() if device.type == "cuda" else None
        result.update(measure_e2e(args, dims, str(device)))
    table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def table(r: dict) -> None:
    hf = r.get("transformers", {})
    rows = [
        ("decode step, batch 1 (ms)", "decode_bs1_ms", "{:.2f}"),
        ("decode, 64 requests (out tok/s)", "decode64_out_tok_s", "{:,.0f}"),
        ("whole run, 64 requests (out tok/s)", "whole64_out_tok_s", "{:,.0f}"),
        ("prefill 4096 (ms)", "prefill4096_ms", "{:.1f}"),
    ]
    say(f"\n{'figure':38} {'pdserve':>12} {'transformers':>14}")
    for label, key, fmt in rows:
        ours = fmt.format(r[key]) if key in r else "-"
        theirs = fmt.format(hf[key]) if key in hf else "-"
        say(f"{label:38} {ours:>12} {theirs:>14}")
    keys = (
        "decode_bs1_graph_replay_ms",
        "decode64_graph_replay_ms",
        "prefill4096_paged_kernel_ms",
        "e2e_unified_ratio",
    )
    for key in keys:
        if key in r:
            say(f"{key:38} {r[key]:>12.3f}")


if __name__ == "__main__":
    sys.exit(main())
