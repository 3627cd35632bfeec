"""Decode-time matrix products of a 7B model on one GPU: the library's against pdserve's
Triton GEMV over a few tile shapes, at batch 1 and 4.

Each product is timed in a CUDA graph of many calls that cycle through enough weight
copies (several times the L2) that every call reads its weights from device memory.
Prints achieved read bandwidth (weight bytes / time) per shape and variant.

    python bench/probes/gemv_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import gemv as gemv_mod

SHAPES = {  # name: (N, K, bias, silu_mul)
    "qkv": (4608, 3584, True, False),
    "o": (3584, 3584, False, False),
    "gate_up": (37888, 3584, False, False),
    "down": (3584, 18944, False, True),
    "lm_head": (152064, 3584, False, False),
}
L2_BYTES = 60 << 20
# block_n, block_k, warps, stages, split_k
CONFIGS = list(itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (3,), (1,)))
WIDE = list(itertools.product((8,), (512, 1024), (4, 8), (2, 3), (1, 2, 3, 4)))  # --wide


def launched_ms(fn, reps: int = 30) -> float:
    """Milliseconds per call of ``fn()`` launched from Python (after three warm-up calls),
    between two CUDA events: what a caller that replays graphs or launches a few kernels sees."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def timed(fn, calls: int) -> float:
    """Microseconds per call of ``fn(i)``, from a graph of ``calls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[2]


def probe(
    name: str, n: int, k: int, has_bias: bool, silu: bool, batches: list[int], configs: list[tuple]
) -> list[dict]:
    dev = torch.device("cuda")
    nbytes = n * k * 2
    copies = max(2, -(-4 * L2_BYTES // nbytes))
    ws = [torch.randn((n, k), dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
    bias = torch.randn(n, dtype=torch.bfloat16, device=dev) if has_bias else None
    calls = max(copies, 24)
    rows = []
    for m in batches:
        x = torch.randn((m, 2 * k if silu else k), dtype=torch.bfloat16, device=dev)
        row: dict[str, object] = {"shape": name, "n": n, "k": k, "m": m, "weight_mb": nbytes / 1e6}

        def lib(i: int, x: torch.Tensor = x) -> None:
            a = F.silu(x[:, :k]) * x[:, k:] if silu else x
            F.linear(a, ws[i % copies], bias)

        for backend in ("cublaslt", "cublas"):
            torch.backends.cuda.preferred_blas_library(backend)
            us = timed(lib, calls)
            row[f"{backend}_us"] = us
            row[f"{backend}_tb_s"] = nbytes / us / 1e6
        torch.backends.cuda.preferred_blas_library("cublaslt")
        best = None
        gemv_mod.reserve_counters(dev)
        for bn, bk, warps, stages, split in configs if m <= 16 else []:  # the GEMV is for small batches

            def tri(i: int, x: torch.Tensor = x, cfg: tuple = (bn, bk, warps, stages, split)) -> None:
                gemv_mod.gemv(x, ws[i % copies], bias, silu, *cfg)

            try:
                us = timed(tri, calls)
            except Exception as exc:  # a tile that does not compile or fit: skip it
                print(f"  {name} m={m} {bn}x{bk} w{warps} s{stages} k{split}: {exc!r}", file=sys.stderr)
                continue
            row.setdefault("triton_all", []).append([bn, bk, warps, stages, split, us])
            if best is None or us < best[0]:
                best = (us, bn, bk, warps, stages, split)
        if best is not None:
            us, *config = best
            row.update(triton_us=us, triton_tb_s=nbytes / us / 1e6, triton_config=config)
            out = gemv_mod.gemv(x, ws[0], bias, silu, *config).float()
            a = F.silu(x[:, :k]) * x[:, k:] if silu else x
            ref = F.linear(a.float(), ws[0].float(), bias.float() if bias is not None else None)
            row["triton_rel_err"] = ((out - ref).norm() / ref.norm()).item()
        rows.append(row)
        print(
            f"{name:8} m={m} {nbytes / 1e6:7.1f} MB  cublasLt {row['cublaslt_tb_s']:.2f}  cublas {row['cublas_tb_s']:.2f}"
            f"  triton {row.get('triton_tb_s', 0):.2f} TB/s {row.get('triton_config')}",
            flush=True,
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="which of %(default)s")
    parser.add_argument("--wide", action="store_true", help="a wider sweep of tiles, pipeline stages included")
    args = parser.parse_args()
    results: list[dict] = []
    for name in args.shapes.split(","):
        n, k, has_bias, silu = SHAPES[name]
        batches = [int(b) for b in args.batches.split(",")]
        results += probe(name, n, k, has_bias, silu, batches, WIDE if args.wide else CONFIGS)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
