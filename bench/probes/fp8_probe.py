# ruff: noqa: B023  (each closure is timed before the loop moves on)
"""Probe: the projections of a 7B decoder in bf16 and FP8, by rows of input, on one GPU.

For Qwen2.5-7B's four projections (qkv, o, gate_up, and down with SiLU·up read on the fly)
and each row count, times (microseconds a call; ``tb_s``: weight bytes over that time):

- ``cublas``: the library's bf16 GEMM (``F.linear``; down: ``silu_mul`` then the GEMM);
- ``gemv``: pdserve's FP8 GEMV (W8A16, :func:`fp8.gemv_tiles`), up to 64 rows;
- ``batched``: the fused per-row quantization then the batched W8A8 kernel
  (:func:`fp8.quantize_rows` + :func:`fp8.matmul` at :func:`fp8.matmul_tiles`), what
  :func:`fp8.linear` runs between its thresholds; ``batched_mm``: the kernel alone, at the
  table's tiles and a few others (wider or narrower channel tiles, Hopper's fast FP8
  accumulation; its weight and activation tiles read by TMA, ``tma``) to correct the table;
  ``batched_a16``: the same kernel on the bf16
  activations as they are (W8A16, down reading SiLU·up on the fly; ``batched_a16_sep``:
  ``silu_mul`` first); up to 256 rows;
- ``tileq``: the batched kernel quantizing each K tile of the bf16 activations in registers
  (a scale per row per 128 columns, no quantization launch; down: ``silu_mul`` first;
  ``tileq_fused``: SiLU·up recomputed by each channel tile), at the table's tiles and 128
  channels a program (``tiles``);
- ``gemv_tiles``: at one row, the FP8 GEMV over a sweep of its tiles (``gemv_sep``: down with
  ``silu_mul`` first);
- ``scaled_mm``: the fused quantization then ``torch._scaled_mm`` (row-wise scales), timed
  together (``scaled_mm_fast``: with Hopper's fast FP8 accumulation, from 128 rows);
  ``quant``: the quantization alone (one launch up to 8,192 columns, two above).

Before timing, each (projection, rows) checks the kernels against torch: the quantization bit
for bit against :func:`quant.quantize_rows_fp8`, the batched kernel against ``_scaled_mm`` on
the same FP8 inputs (``checks`` in the JSON). Each figure is a CUDA graph of calls cycling
over enough copies of the weights that none is read from L2. The JSON (``--out``) is written
after every figure; after ``--budget`` seconds the sweep stops and the table is printed.

    python bench/probes/fp8_probe.py --out /tmp/fp8_probe.json --budget 200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.engine import quant
from pdserve.engine.kernels import elementwise, fp8, gemv

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
ROWS = "1,2,4,8,16,32,64,128,256,2048,4096"
# the batched kernel's other tiles tried beside the table's: (name, overrides)
MM_ALTS: list[tuple[str, dict[str, Any]]] = [
    ("fast_accum", {"precise": False}),
    ("n64", {"block_n": 64}),
    ("n256", {"block_n": 256, "block_k": 128, "num_warps": 8, "num_stages": 3}),
    ("tma", {"tma": True}),
]
# the FP8 GEMV's tiles tried at one row: (block_n, block_k, split_k, num_warps)
GEMV_SWEEP = [(bn, bk, sk, 4, 3) for bn in (8, 16, 32) for bk in (1024, 2048) for sk in (1, 2, 4) if bn * bk <= 32768]
# --gemv-sweep wide: also narrower channel tiles, shorter K tiles, 2 and 8 warps, 2 and 4 stages
# (block_n, block_k, split_k, num_warps, num_stages), the likeliest first (the budget may stop it)
GEMV_SWEEP_WIDE = (
    [(4, bk, sk, 4, 3) for bk in (512, 1024, 2048, 4096) for sk in (1, 2, 4)]
    + [(8, 512, sk, 4, 3) for sk in (1, 2, 4)]
    + [(bn, bk, sk, nw, 3) for nw in (2, 8) for bn in (4, 8, 16) for bk in (512, 1024, 2048, 4096) for sk in (1, 2, 4)]
    + [(bn, bk, sk, 4, ns) for ns in (2, 4) for bn, bk in ((4, 2048), (8, 1024), (8, 2048)) for sk in (1, 2, 4)]
)
GEMV_SWEEP_WIDE = [c for c in GEMV_SWEEP_WIDE if c[0] * c[1] <= 32768]
# --mm-sweep: the batched W8A8 kernel's tiles at each row count from 2 (block_n, block_k,
# num_warps, num_stages; split-K by the table's rule, then twice and half that), the likeliest
# first: at 64 rows the table's tiles read 1.2-1.4 TB/s on qkv and o, 2.5 on down (H200)
MM_SWEEP = (
    [(bn, bk, 4, ns) for bn in (64, 32, 128) for bk in (256, 128, 512) for ns in (3, 4, 5)]
    + [(bn, bk, 8, ns) for bn in (64, 128) for bk in (128, 256) for ns in (3, 4, 5)]
    + [(bn, bk, 4, ns) for bn in (64, 32) for bk in (128, 256) for ns in (2, 6)]
)
COMPLETE = (
    "gemv",
    "gemv_tiles",
    "gemv_sep",
    "batched",
    "batched_a16",
    "batched_a16_sep",
    "tileq",
    "tileq_fused",
    "scaled_mm",
    "scaled_mm_fast",
)  # fmt: skip  (whole products, FP8)
VARIANTS = (
    "cublas", "gemv", "gemv_tiles", "gemv_sep", "batched", "batched_mm", "tileq", "tileq_fused", "batched_a16",
    "batched_a16_sep", "scaled_mm", "scaled_mm_fast", "quant",
)  # fmt: skip


def timed(fn: Any, reps: int = 5) -> float:
    """Microseconds a call: ``fn`` captured in a graph (it loops over the copies itself and
    returns how many calls it made)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            calls = fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) * 1000 / reps / calls


def with_split(rows: int, n: int, k: int, tiles: dict[str, Any], w8a8: bool = True) -> dict[str, Any]:
    """``tiles`` with split-K chosen by the table's rule (:func:`fp8.split_k`, within one wave
    where :func:`fp8.matmul_tiles` keeps a W8A8 decode batch's programs to one) for its channel
    and K tiles."""
    programs = -(-rows // tiles["block_m"]) * -(-n // tiles["block_n"])
    one_wave = w8a8 and rows <= 64 and fp8.MATMUL_RULE == "one-wave"
    return {**tiles, "split_k": fp8.split_k(programs, k, tiles["block_k"], one_wave)}


def table(results: list[dict]) -> str:
    """Per projection and rows: each variant's best microseconds (``batched_mm``: the table's
    tiles / the best of all tried, with its name) and ``x bf16``: cuBLAS bf16's time over the
    fastest complete FP8 path's (gemv, batched, batched_a16(_sep), scaled_mm), with its name."""
    best: dict[tuple[str, int, str], dict] = {}
    for r in results:
        key = (r["shape"], r["rows"], r["variant"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    cells: dict[tuple[str, int], dict[str, str]] = {}
    for (shape, rows, variant), r in best.items():
        text = f"{r['us']:.1f}"
        if variant == "batched_mm":
            own = [x for x in results if (x["shape"], x["rows"], x.get("tiles")) == (shape, rows, "table")]
            text = (f"{own[0]['us']:.1f}/" if own else "-/") + f"{r['us']:.1f}:{r.get('tiles')}"
        cells.setdefault((shape, rows), {})[variant] = text
    for (shape, rows), row in cells.items():
        paths = [best[(shape, rows, v)] for v in VARIANTS if v in COMPLETE and (shape, rows, v) in best]
        bf16 = best.get((shape, rows, "cublas"))
        if paths and bf16:
            fastest = min(paths, key=lambda r: r["us"])
            row["x bf16"] = f"{bf16['us'] / fastest['us']:.2f}:{fastest['variant']}"
    columns = [*VARIANTS, "x bf16"]
    widths = {c: 22 if c in ("batched_mm", "x bf16") else max(len(c), 8) for c in columns}
    lines = [f"{'shape':8} {'rows':>5} " + " ".join(f"{c:>{widths[c]}}" for c in columns)]
    for (shape, rows), row in cells.items():
        lines.append(f"{shape:8} {rows:>5} " + " ".join(f"{row.get(c, '-'):>{widths[c]}}" for c in columns))
    return "\n".join(lines)


def sweep_best(results: list[dict]) -> dict[tuple[str, int], dict]:
    """Per projection and rows where tiles were swept: the table's time and the fastest tiles
    (the lines to put in :data:`fp8.MATMUL_TILES`)."""
    out: dict[tuple[str, int], dict] = {}
    for r in results:
        if r["variant"] != "batched_mm" or r.get("tiles") not in ("table", "sweep"):
            continue
        entry = out.setdefault((r["shape"], r["rows"]), {"table_us": None, "swept": False})
        entry["swept"] |= r["tiles"] == "sweep"
        if r["tiles"] == "table":
            entry["table_us"] = r["us"]
        if "us" not in entry or r["us"] < entry["us"]:
            keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k", "tma")
            entry |= {"us": r["us"], "tb_s": r["tb_s"], "tiles": {k: r[k] for k in keys if k in r}}
    return {key: entry for key, entry in out.items() if entry.pop("swept")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--budget", type=float, default=200.0, help="seconds of sweeping at most")
    parser.add_argument(
        "--gemv-sweep", choices=("narrow", "wide"), default="narrow", help="the one-row GEMV tiles tried (wide: ~400)"
    )
    parser.add_argument(
        "--mm-sweep",
        type=float,
        default=0.0,
        help="seconds a shape and row count to sweep the batched kernel's tiles (MM_SWEEP; 0: none)",
    )
    parser.add_argument(
        "--mm-sweep-tma",
        action="store_true",
        help="with --mm-sweep: each swept tile also with its tiles read by TMA (fp8.MATMUL_TMA)",
    )
    parser.add_argument("--only", default="", help="time only these variants (comma-separated; default: all)")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    dev = torch.device("cuda", 0)
    gemv.reserve_counters(dev)
    t0 = time.monotonic()
    results: list[dict] = []
    checks: list[dict] = []
    state = {"stopped": None}

    def write() -> None:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "gpu": torch.cuda.get_device_name(0),
                    "thresholds": {"gemv_max_rows": fp8.GEMV_MAX_ROWS, "batched_max_rows": fp8.BATCHED_MAX_ROWS},
                    "elapsed_s": round(time.monotonic() - t0, 1),
                    "stopped_by_budget_at": state["stopped"],
                    "checks": checks,
                    "rows": results,
                },
                f,
                indent=1,
            )

    def over(where: str) -> bool:
        if time.monotonic() - t0 > args.budget:
            state["stopped"] = state["stopped"] or where
            return True
        return False

    only = set(filter(None, args.only.split(",")))

    def record(shape: str, rows: int, variant: str, fn: Any, nbytes: int, **extra: Any) -> None:
        if only and variant not in only:
            return
        try:
            us = timed(fn)
        except Exception as exc:  # a tile out of shared memory, a shape the library refuses
            print(f"{variant} {shape} {rows} {extra}: {exc!r}", file=sys.stderr, flush=True)
            return
        row = {
            "shape": shape,
            "rows": rows,
            "variant": variant,
            "us": round(us, 2),
            "tb_s": round(nbytes / us / 1e6, 2),
        }
        row.update(extra)
        results.append(row)
        print(json.dumps(row), flush=True)
        write()

    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        if over(shape):
            break
        silu = shape == "down"
        bf = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02
        bfs = [bf] + [bf.clone() for _ in range(max(2, -(-(256 << 20) // bf.nbytes)) - 1)]
        q8 = [quant.quantize_fp8(w) for w in bfs[: max(2, -(-(256 << 20) // (n * k)))]]
        for rows in rows_list:
            if over(f"{shape}/{rows}"):
                break
            x = torch.randn((rows, 2 * k if silu else k), device=dev, dtype=torch.bfloat16)
            w0 = q8[0]
            # correctness on this GPU first
            check: dict[str, Any] = {"shape": shape, "rows": rows}
            try:
                xq, xs = fp8.quantize_rows(x, silu)
                act = elementwise.silu_mul(x) if silu else x
                q_ref, s_ref = quant.quantize_rows_fp8(act)
                check["quant_scale_mismatches"] = int((xs != s_ref).sum())
                check["quant_byte_mismatches"] = int((xq.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
                # exact accumulation: Hopper's fast one (the engine's prefill default) errs 1.2e-3
                # itself, which this check read as the kernel's (H100 and H200, 2026-12-05)
                ref = fp8.scaled_mm(xq, xs, w0, None, torch.float32, fast_accum=False)
                if rows <= 256:
                    tiles = fp8.matmul_tiles(rows, n, k)
                    out = fp8.matmul(xq, w0, None, xs, torch.float32, **tiles)  # type: ignore[arg-type]
                    check["batched_rel_err_vs_scaled_mm"] = ((out - ref).norm() / ref.norm()).item()
                    try:  # (a TMA that does not compile here leaves the other checks to run)
                        by_tma = fp8.matmul(xq, w0, None, xs, torch.float32, **{**tiles, "tma": True})  # type: ignore[arg-type]
                        check["tma_same_bits"] = bool(torch.equal(by_tma, out))
                    except Exception as exc:
                        check["tma_error"] = repr(exc)[:300]
                    dense = F.linear(act.float(), w0.dequantize(torch.float32))
                    out = fp8.matmul(x, w0, None, silu_mul_input=silu, **tiles).float()  # type: ignore[arg-type]
                    check["a16_rel_err_vs_dequantized"] = ((out - dense).norm() / dense.norm()).item()
                    gq, gs = quant.quantize_groups_fp8(act)
                    grouped = (gq.float() * gs.repeat_interleave(quant.GROUP, dim=1)[:, :k]) @ w0.dequantize(
                        torch.float32
                    ).T
                    tq = fp8.matmul_tiles(rows, n, k, tile_quant=True)
                    out = fp8.matmul(act, w0, None, out_dtype=torch.float32, tile_quant=True, **tq)  # type: ignore[arg-type]
                    check["tileq_rel_err_vs_groups"] = ((out - grouped).norm() / grouped.norm()).item()
                    check["tileq_rel_err_vs_dense"] = ((out - dense).norm() / dense.norm()).item()
                    check["row_rel_err_vs_dense"] = ((ref - dense).norm() / dense.norm()).item()
            except Exception as exc:  # a kernel that does not compile or run here: the timings say more
                check["error"] = repr(exc)
                xq, xs = quant.quantize_rows_fp8(elementwise.silu_mul(x) if silu else x)  # to time the rest
            checks.append(check)
            print("check", json.dumps(check), flush=True)

            def cublas(x: torch.Tensor = x) -> int:
                for w in bfs:
                    F.linear(elementwise.silu_mul(x) if silu else x, w)
                return len(bfs)

            record(shape, rows, "cublas", cublas, bf.nbytes)

            def scaled(x: torch.Tensor = x) -> int:
                for w in q8:
                    xq, xs = fp8.quantize_rows(x, silu)
                    fp8.scaled_mm(xq, xs, w, None, x.dtype)
                return len(q8)

            record(shape, rows, "scaled_mm", scaled, n * k)
            if rows >= 128:

                def scaled_fast(x: torch.Tensor = x) -> int:
                    for w in q8:
                        xq, xs = fp8.quantize_rows(x, silu)
                        fp8.scaled_mm(xq, xs, w, None, x.dtype, fast_accum=True)
                    return len(q8)

                record(shape, rows, "scaled_mm_fast", scaled_fast, n * k)
                fast = fp8.scaled_mm(xq, xs, w0, None, torch.float32, fast_accum=True)
                exact = fp8.scaled_mm(xq, xs, w0, None, torch.float32)
                check["fast_accum_rel_err_vs_scaled_mm"] = ((fast - exact).norm() / exact.norm()).item()

            def quantize(x: torch.Tensor = x) -> int:
                for _ in range(10):
                    fp8.quantize_rows(x, silu)
                return 10

            record(shape, rows, "quant", quantize, 0)
            if rows <= 64:
                tiles = fp8.gemv_tiles(rows, n, k)

                def ours(x: torch.Tensor = x) -> int:
                    for w in q8:
                        gemv.gemv(x, w.q, silu_mul_input=silu, scale=w.scale, **tiles)  # type: ignore[arg-type]
                    return len(q8)

                record(shape, rows, "gemv", ours, n * k, **tiles)
            if rows == 1:
                for bn, bk, sk, nw, ns in GEMV_SWEEP + (GEMV_SWEEP_WIDE if args.gemv_sweep == "wide" else []):
                    if k // sk < bk or over("gemv_tiles"):
                        continue
                    cfg = {"block_n": bn, "block_k": bk, "split_k": sk, "num_warps": nw, "num_stages": ns}

                    def swept(x: torch.Tensor = x, cfg: dict = cfg) -> int:
                        for w in q8:
                            gemv.gemv(x, w.q, silu_mul_input=silu, scale=w.scale, **cfg)
                        return len(q8)

                    record(shape, rows, "gemv_tiles", swept, n * k, **cfg)
                    if silu:

                        def swept_sep(x: torch.Tensor = x, cfg: dict = cfg) -> int:
                            for w in q8:
                                gemv.gemv(elementwise.silu_mul(x), w.q, scale=w.scale, **cfg)
                            return len(q8)

                        record(shape, rows, "gemv_sep", swept_sep, n * k, **cfg)
            if rows > 256:
                continue
            mm = fp8.matmul_tiles(rows, n, k)

            def batched(x: torch.Tensor = x) -> int:
                for w in q8:
                    xq, xs = fp8.quantize_rows(x, silu)
                    fp8.matmul(xq, w, None, xs, x.dtype, **mm)  # type: ignore[arg-type]
                return len(q8)

            record(shape, rows, "batched", batched, n * k, **mm)
            for name, overrides in [("table", {})] + MM_ALTS:
                cfg = with_split(rows, n, k, {**mm, **overrides})

                def mm_only(xq: torch.Tensor = xq, xs: torch.Tensor = xs, cfg: dict = cfg) -> int:
                    for w in q8:
                        fp8.matmul(xq, w, None, xs, torch.bfloat16, **cfg)
                    return len(q8)

                record(shape, rows, "batched_mm", mm_only, n * k, tiles=name, **cfg)
            swept_until = time.monotonic() + args.mm_sweep
            for bn, bk, nw, ns in MM_SWEEP if args.mm_sweep > 0 and rows > 1 else []:
                base = with_split(rows, n, k, {**mm, "block_n": bn, "block_k": bk, "num_warps": nw, "num_stages": ns})
                for split in sorted({base["split_k"], base["split_k"] * 2, max(1, base["split_k"] // 2)}):
                    if k // split < bk or time.monotonic() > swept_until or over("mm_sweep"):
                        continue
                    for tma in (False, True) if args.mm_sweep_tma else (False,):
                        cfg = {**base, "split_k": split, **({"tma": True} if tma else {})}

                        def mm_swept(xq: torch.Tensor = xq, xs: torch.Tensor = xs, cfg: dict = cfg) -> int:
                            for w in q8:
                                fp8.matmul(xq, w, None, xs, torch.bfloat16, **cfg)
                            return len(q8)

                        record(shape, rows, "batched_mm", mm_swept, n * k, tiles="sweep", **cfg)

            for name, overrides in (("table", {}), ("n128", {"block_n": 128})):
                cfg = with_split(rows, n, k, {**fp8.matmul_tiles(rows, n, k, tile_quant=True), **overrides}, w8a8=False)

                def tileq(x: torch.Tensor = x, cfg: dict = cfg) -> int:
                    for w in q8:
                        fp8.matmul(elementwise.silu_mul(x) if silu else x, w, None, tile_quant=True, **cfg)
                    return len(q8)

                record(shape, rows, "tileq", tileq, n * k, tiles=name, **cfg)
                if silu:

                    def tileq_fused(x: torch.Tensor = x, cfg: dict = cfg) -> int:
                        for w in q8:
                            fp8.matmul(x, w, None, silu_mul_input=True, tile_quant=True, **cfg)
                        return len(q8)

                    record(shape, rows, "tileq_fused", tileq_fused, n * k, tiles=name, **cfg)

            mm16 = fp8.matmul_tiles(rows, n, k, x_bytes=2)

            def a16(x: torch.Tensor = x) -> int:
                for w in q8:
                    fp8.matmul(x, w, None, silu_mul_input=silu, **mm16)  # type: ignore[arg-type]
                return len(q8)

            record(shape, rows, "batched_a16", a16, n * k, **mm16)
            if silu:

                def a16_sep(x: torch.Tensor = x) -> int:
                    for w in q8:
                        fp8.matmul(elementwise.silu_mul(x), w, None, **mm16)  # type: ignore[arg-type]
                    return len(q8)

                record(shape, rows, "batched_a16_sep", a16_sep, n * k, **mm16)
        bfs, q8 = [], []
        torch.cuda.empty_cache()
    write()
    print(table(results))
    for (shape, rows), fastest in sweep_best(results).items():
        print(f"best batched_mm {shape} {rows}: {json.dumps(fastest)}")
    if state["stopped"]:
        print(f"stopped by --budget {args.budget:.0f} s at {state['stopped']}")
    bad = [
        c
        for c in checks
        if "error" in c
        or c["quant_byte_mismatches"]
        or c.get("batched_rel_err_vs_scaled_mm", 0) > 1e-3
        or c.get("a16_rel_err_vs_dequantized", 0) > 1e-2
        or c.get("tileq_rel_err_vs_groups", 0) > 1e-3
        or c.get("tma_same_bits") is False
        or "tma_error" in c
    ]
    print(f"checks: {len(checks)}, failing: {len(bad)}", *(json.dumps(c) for c in bad), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
