"""FP8 in the engine benchmark (``bench/gpu_engine.py --quantization fp8``): the kernels'
choices for a run (flags, the GEMV tiles a probe found fastest), as recorded with its
figures, and the logits' error against the same model in bf16."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pdserve.engine.engine import Engine
from pdserve.engine.kernels import fp8, paged
from pdserve.schemas import SamplingParams


def add_fp8_flags(parser: argparse.ArgumentParser) -> None:
    """The FP8 kernels' flags of the benchmark."""
    parser.add_argument(
        "--fp8-batched",
        choices=fp8.BATCHED_MODES,
        help=f"FP8: how the batched kernel takes its activations (default {fp8.BATCHED_MODE}; see "
        "pdserve.engine.kernels.fp8)",
    )
    parser.add_argument(
        "--fp8-gemv-tiles",
        type=Path,
        help="FP8: the GEMV's tiles at one row from bench/probes/fp8_probe.py's JSON (the fastest per shape, "
        "and down's SiLU·up fused or not)",
    )
    parser.add_argument(
        "--fp8-mm-tiles",
        type=Path,
        help="FP8: the batched kernel's tiles from bench/probes/fp8_probe.py --mm-sweep's JSON (the fastest per "
        "shape and row block swept, where faster than the rule's)",
    )
    parser.add_argument(
        "--fp8-mm-rule",
        choices=fp8.MATMUL_RULES,
        help=f"FP8: the batched kernel's tile rule for decode batches (default {fp8.MATMUL_RULE}; 'fill': the "
        "rule before 2026-12-05, for a baseline in the same run)",
    )
    parser.add_argument(
        "--fp8-mm-tma",
        action="store_true",
        help="FP8: the batched kernel reads its tiles by TMA (fp8.MATMUL_TMA; off: no faster on an H100, 2026-12-06)",
    )
    parser.add_argument(
        "--fp8-accum",
        choices=("fast", "exact"),
        help="FP8: prefill's GEMMs (torch._scaled_mm) with Hopper's fast accumulation or without "
        f"(default {'fast' if fp8.SCALED_MM_FAST_ACCUM else 'exact'})",
    )
    parser.add_argument(
        "--fp8-kv-tiles",
        choices=("bf16", "f16"),
        help="FP8 KV: the attention kernels convert the pool's tiles to bf16 or to float16, the queries with "
        f"them (default {'f16' if paged.FP8_F16_TILES else 'bf16'}; paged.FP8_F16_TILES)",
    )
    parser.add_argument(
        "--fp8-logit-error",
        action="store_true",
        help="with --quantization fp8: first the same model in bf16 (a throwaway engine), then FP8, each "
        "prompt's first token's top-20 log-probabilities compared (fixed prompts, 64 of 512 tokens)",
    )


def first_token_logprobs(engine: Engine, batch: list[list[int]]) -> list[dict[int, float]]:
    """Each prompt's first generated token's top-20 log-probabilities, ``{token: logprob}``."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=20)
    tag = f"lp-{time.perf_counter()}"
    for i, p in enumerate(batch):
        engine.add_request(f"{tag}-{i}", p, params)
    found: dict[str, dict[int, float]] = {}
    while engine.has_work():
        for out in engine.step():
            if out.logprobs:
                top = out.logprobs[0]
                found[out.rid] = dict(zip(top.top_ids, top.top_logprobs, strict=True))
    return [found[f"{tag}-{i}"] for i in range(len(batch))]


def logit_error(bf16: list[dict[int, float]], fp8_: list[dict[int, float]]) -> dict[str, float]:
    """FP8 against bf16 over the same prompts: the first token's top-1 agreement, and the
    log-probability differences of the tokens in both top-20 lists (mean, p99 and max)."""
    agree = sum(max(a, key=a.__getitem__) == max(b, key=b.__getitem__) for a, b in zip(bf16, fp8_, strict=True))
    diffs = sorted(abs(a[t] - b[t]) for a, b in zip(bf16, fp8_, strict=True) for t in a.keys() & b.keys())
    overlap = statistics.mean(len(a.keys() & b.keys()) / len(a) for a, b in zip(bf16, fp8_, strict=True))
    return {
        "prompts": len(bf16),
        "top1_agreement": agree / len(bf16),
        "top20_overlap": overlap,
        "abs_logprob_diff_mean": statistics.mean(diffs),
        "abs_logprob_diff_p99": diffs[int(0.99 * (len(diffs) - 1))],
        "abs_logprob_diff_max": diffs[-1],
    }


def measured_mm_tiles(probe: dict) -> dict[tuple[int, int, int], dict[str, int]]:
    """From an fp8_probe JSON: per row block and weight shape swept, the batched kernel's fastest
    tiles where they beat the rule's (``fp8.MATMUL_TILES`` entries)."""
    shapes = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
    keys = ("block_n", "block_k", "split_k", "num_warps", "num_stages")
    out: dict[tuple[int, int, int], dict[str, int]] = {}
    mm = [r for r in probe["rows"] if r["variant"] == "batched_mm" and r.get("tiles") in ("table", "sweep")]
    for shape, (n, k) in shapes.items():
        for rows in sorted({r["rows"] for r in mm if r["shape"] == shape and r["tiles"] == "sweep"}):
            tried = [r for r in mm if r["shape"] == shape and r["rows"] == rows]
            best = min(tried, key=lambda r: r["us"])
            table = [r for r in tried if r["tiles"] == "table"]
            if best["tiles"] == "sweep" and (not table or best["us"] < table[0]["us"]):
                out[(best["block_m"], n, k)] = {key: best[key] for key in keys} | (
                    {"tma": True} if best.get("tma") else {}
                )
    return out


def configure_fp8(args: argparse.Namespace) -> dict[str, object]:
    """The FP8 kernels' choices for this run (``--fp8-batched``, ``--fp8-gemv-tiles``,
    ``--fp8-mm-tiles``), as recorded."""
    if args.fp8_batched:
        fp8.BATCHED_MODE = args.fp8_batched
    if args.fp8_accum:
        fp8.SCALED_MM_FAST_ACCUM = args.fp8_accum == "fast"
    if args.fp8_gemv_tiles:
        probe = json.loads(args.fp8_gemv_tiles.read_text())
        shapes = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
        keys = ("block_n", "block_k", "split_k", "num_warps", "num_stages")
        for shape, (n, k) in shapes.items():
            rows = [
                r for r in probe["rows"] if r["shape"] == shape and r["rows"] == 1 and r["variant"].startswith("gemv")
            ]
            if rows:
                best = min(rows, key=lambda r: r["us"])
                fp8.GEMV_TILES[(n, k)] = {key: best[key] for key in keys}
                if shape == "down":
                    fp8.GEMV_SILU_FUSED = best["variant"] != "gemv_sep"
    if args.fp8_mm_rule:
        fp8.MATMUL_RULE = args.fp8_mm_rule
    if args.fp8_mm_tma:
        fp8.MATMUL_TMA = True
    if args.fp8_kv_tiles:
        paged.FP8_F16_TILES = args.fp8_kv_tiles == "f16"
    if args.fp8_mm_tiles:
        fp8.MATMUL_TILES.update(measured_mm_tiles(json.loads(args.fp8_mm_tiles.read_text())))
    return {
        "batched_mode": fp8.BATCHED_MODE,
        "gemv_tiles": {f"{n}x{k}": t for (n, k), t in fp8.GEMV_TILES.items()},
        "gemv_silu_fused": fp8.GEMV_SILU_FUSED,
        "matmul_block_n": fp8.matmul_tiles(64, 3584, 3584)["block_n"],
        "matmul_tiles": {f"{m}x{n}x{k}": t for (m, n, k), t in fp8.MATMUL_TILES.items()},
        "matmul_rule": fp8.MATMUL_RULE,
        "matmul_tma": fp8.MATMUL_TMA,
        "matmul_tiles_64_rows": {
            name: fp8.matmul_tiles(64, n, k)
            for name, (n, k) in {
                "qkv": (4608, 3584),
                "o": (3584, 3584),
                "gate_up": (37888, 3584),
                "down": (3584, 18944),
            }.items()
        },
        "scaled_mm_fast_accum": fp8.SCALED_MM_FAST_ACCUM,
        "kv_f16_tiles": paged.FP8_F16_TILES,
    }
