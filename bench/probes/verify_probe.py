"""Speculative verify steps against plain decode steps on a GPU: the graph replay of a verify
of K drafts at batch b (b * (K + 1) decode rows, rows of one sequence sharing its pages, K/V
stored first) against the plain decode graph at batch b, Qwen2.5-7B dimensions, random
weights, a 512-token context. Issue 35's goal: at most 1.10x / 1.15x / 1.5x at batch 1 / 8 / 64
for K = 4 (a step of more rows than the verify graphs hold runs eagerly: reported as such).

    python bench/probes/verify_probe.py --out verify_probe.json [--quantization fp8]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from gemv_probe import launched_ms

from pdserve.bench.shapes import QWEN2_5_7B
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.models.batch import rows_step

KINDS = (
    ("attention", ("decode_kernel", "merge_kernel", "prefill", "attention")),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90", "nvjet", "xmma", "matmul")),
    ("norm_rope_act", ("rms", "rope", "silu", "norm", "elementwise")),
)


def kernel_kinds(fn, reps: int = 5) -> dict[str, float]:
    """Device milliseconds a call of ``fn`` (eager), by kernel kind (names matched loosely),
    and the five longest kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    per_kernel: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
        if not us:
            continue
        name = event.key.lower()
        kind = next((k for k, needles in KINDS if any(n in name for n in needles)), "other")
        totals[kind] = totals.get(kind, 0.0) + us / 1e3 / reps
        per_kernel[event.key[:80]] = us / 1e3 / reps
    out = {k: round(v, 3) for k, v in sorted(totals.items())}
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:6]
    return out | {"top": {k: round(v, 3) for k, v in top}}  # type: ignore[dict-item]


def main() -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--drafts", type=int, default=4, help="K, draft tokens a verify")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--quantization", default=None)
    parser.add_argument(
        "--profile", action="store_true", help="at the largest batch: device time by kernel kind, verify against plain"
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_5_7B), dtype=torch.bfloat16).eval()
    rows_max = max(batches) * (args.drafts + 1)
    config = EngineConfig(
        device="cuda",
        max_total_tokens=max(batches) * (args.context + 64) + 1024,
        max_num_seqs=max(batches),
        cuda_graph_max_batch=max(batches),
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=args.drafts,
        quantization=args.quantization,
    )
    runner = ModelRunner(ModelSpec(Path("qwen2.5-7b-dims")), config, model=model)
    assert runner.graphs is not None and runner.verify_graphs is not None and runner.fast is not None
    page = config.page_size
    per_seq = -(-(args.context + args.drafts + 1) // page)
    results = []
    with torch.inference_mode():
        for b in batches:
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
            p = args.context - 1
            plain = launched_ms(lambda b=b, tables=tables, p=p: runner.graphs.run([7] * b, [p] * b, tables))
            ids, positions, seq_tables = [], [], []
            for table in tables:
                for j in range(args.drafts + 1):
                    ids.append(11 + j)
                    positions.append(p + j)
                    seq_tables.append(table)
            rows = len(ids)
            if rows <= runner.verify_graphs.max_batch:
                way = "graph"
                verify = launched_ms(lambda i=ids, q=positions, t=seq_tables: runner.verify_graphs.run(i, q, t))
            else:
                way = "eager rows"
                step = rows_step(ids, positions, seq_tables, page, runner.device, runner._splits(rows))
                verify = launched_ms(lambda step=step: runner.fast.forward(step))
            line = {"batch": b, "rows": rows, "plain_ms": round(plain, 3), "verify_ms": round(verify, 3)}
            line |= {"ratio": round(verify / plain, 3), "verify_way": way}
            if args.profile and b == max(batches):
                plain_step = rows_step([7] * b, [p] * b, tables, page, runner.device, runner._splits(b))
                verify_step = rows_step(ids, positions, seq_tables, page, runner.device, runner._splits(rows))
                line["profile"] = {
                    "plain": kernel_kinds(lambda s=plain_step: runner.fast.forward(s)),
                    "verify": kernel_kinds(lambda s=verify_step: runner.fast.forward(s)),
                }
            results.append(line)
            print(json.dumps(line), flush=True)
    out = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "drafts": args.drafts}
    out |= {"context": args.context, "quantization": args.quantization or "none", "rows_max": rows_max}
    args.out.write_text(json.dumps(out | {"results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
