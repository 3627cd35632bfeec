# ruff: noqa: B023  (each closure is timed before the loop moves on)
"""Probe: the projections of a 7B decoder in bf16 and FP8, by rows of input, on one GPU.

For Qwen2.5-7B's four projections (qkv, o, gate_up, and down with SiLU·up read on the fly)
and each row count, times: the library's bf16 GEMM (``F.linear``), pdserve's GEMV kernel
(:mod:`pdserve.engine.kernels.gemv`) on bf16 and on FP8 weights with per-channel scales over
a few tile shapes, and ``torch._scaled_mm`` with row-wise scales (activations quantized per
token, the quantization included). Each figure is a CUDA graph of calls cycling over enough
copies of the weights that none is read from L2. Reports each variant's time and the weight
read rate (TB/s), and the fastest per (projection, rows, dtype). GPU only; stops sweeping
after ``--budget`` seconds and writes what it has.

    python bench/probes/fp8_probe.py --out /tmp/fp8_probe.json
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
# (block_n, block_k, num_warps, num_stages); split_k is added from the program count
GEMV_TILES = [(8, 512, 4, 3), (8, 1024, 4, 3), (8, 1024, 8, 3), (16, 512, 4, 3)]
DOT_TILES = [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (16, 256, 4, 4), (128, 128, 8, 3)]


def timed(fn: Any, reps: int = 5) -> float:
    """Microseconds a call: ``fn`` captured in a graph (it loops over the copies itself)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile / autotune outside the capture
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


def splits_for(n: int, block_n: int, sms: int) -> int:
    programs = -(-n // block_n)
    split = 1
    while programs * split < 2 * sms and split < 8:
        split *= 2
    return split


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,4,16,32,64,128,256,1024,4096")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds of sweeping at most")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t0 = time.monotonic()
    results: list[dict] = []
    best: dict[str, dict] = {}

    def record(shape: str, rows: int, dtype: str, variant: str, us: float, nbytes: int, **extra: Any) -> None:
        row = {"shape": shape, "rows": rows, "dtype": dtype, "variant": variant, "us": round(us, 2)}
        row["tb_s"] = round(nbytes / us / 1e6, 2)
        row.update(extra)
        results.append(row)
        key = f"{shape}/{rows}/{dtype}"
        if key not in best or us < best[key]["us"]:
            best[key] = row
        print(json.dumps(row), flush=True)

    for shape, (n, k) in SHAPES.items():
        silu = shape == "down"
        bf = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02
        copies = max(2, -(-(256 << 20) // bf.nbytes))
        bfs = [bf.clone() for _ in range(copies)]
        q8 = [quant.quantize_fp8(w) for w in bfs[: max(2, -(-(256 << 20) // (n * k)))]]
        for rows in rows_list:
            if time.monotonic() - t0 > args.budget:
                break
            x = torch.randn((rows, 2 * k if silu else k), device=dev, dtype=torch.bfloat16)

            def cublas(x: torch.Tensor = x) -> int:
                for w in bfs:
                    F.linear(elementwise.silu_mul(x) if silu else x, w)
                return len(bfs)

            record(shape, rows, "bf16", "cublas", timed(cublas), bf.nbytes)

            def scaled(x: torch.Tensor = x) -> int:
                for w in q8:
                    fp8.linear(x, w, silu_mul_input=silu, gemv_max_rows=0)
                return len(q8)

            try:
                record(shape, rows, "fp8", "scaled_mm", timed(scaled), n * k)
            except Exception as exc:  # a shape _scaled_mm refuses
                print(f"scaled_mm {shape} {rows}: {exc!r}", file=sys.stderr)
            if rows > 256:
                continue
            tiles = GEMV_TILES if rows < gemv.DOT_FROM_ROWS else DOT_TILES
            for bn, bk, warps, stages in tiles:
                split = splits_for(n, bn, sms)
                for dtype, ws in (("bf16", bfs), ("fp8", q8)):
                    cfg = {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages, "split_k": split}

                    def ours(x: torch.Tensor = x, ws: list = ws, cfg: dict = cfg) -> int:
                        for w in ws:
                            if isinstance(w, quant.Fp8Weight):
                                gemv.gemv(x, w.q, silu_mul_input=silu, scale=w.scale, **cfg)
                            else:
                                gemv.gemv(x, w, silu_mul_input=silu, **cfg)
                        return len(ws)

                    try:
                        record(shape, rows, dtype, "gemv", timed(ours), bf.nbytes if dtype == "bf16" else n * k, **cfg)
                    except Exception as exc:  # out of shared memory for a tile, say
                        print(f"gemv {shape} {rows} {cfg}: {exc!r}", file=sys.stderr)
        bfs, q8 = [], []
        torch.cuda.empty_cache()
    summary = {k: {"variant": v["variant"], "us": v["us"], "tb_s": v["tb_s"]} for k, v in best.items()}
    for key, row in best.items():
        print(
            "best",
            key,
            row["variant"],
            row["us"],
            "us",
            row["tb_s"],
            "TB/s",
            {c: row[c] for c in ("block_n", "block_k", "num_warps", "num_stages", "split_k") if c in row},
        )
    with open(args.out, "w") as f:
        json.dump(
            {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "best": summary, "rows": results},
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
