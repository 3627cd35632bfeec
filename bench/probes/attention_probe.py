"""Decode attention of a 7B model on one GPU: pdserve's paged kernel over its launch
shapes (keys per block, warps, pipeline stages, context splits), at batch 1 and 64.

Qwen2.5-7B's layout (28 query heads over 4 KV heads of 128, pages of 16 tokens) with
every sequence at ``--context`` tokens in shuffled pages. Each shape is timed in a CUDA
graph of one call per layer (every layer's KV is its own memory, so the calls read device
memory, not L2) and reported as microseconds per layer and KV read bandwidth.

    python bench/probes/attention_probe.py [--json out.json] [--context 640] [--kv-fp8]

``--kv-fp8``: the pool in FP8 with a scale per page per head (``--kv-cache-dtype fp8_e4m3``),
read in place by the same kernel; ``--f16-tiles`` with it: its tiles converted to float16, the
queries with them, rather than to bfloat16 (``paged.FP8_F16_TILES``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
from gemv_probe import timed

from pdserve.engine.kernels import decode_splits, paged
from pdserve.engine.kv_pool import KV_FP8, KVPool
from pdserve.schemas import KVLayout

LAYERS, NUM_Q, NUM_KV, DIM, PAGE = 28, 28, 4, 128, 16


def probe(
    batch: int, context: int, shapes: list[tuple[int, int, int, int, bool]], kv_fp8: bool = False, f16: bool = False
) -> dict:
    dev = torch.device("cuda")
    pages_per_seq = -(-context // PAGE)
    num_pages = batch * pages_per_seq + 1
    scales = None
    if kv_fp8:  # values and scales as the FP8 pool holds them (random values, scales near 1/448)
        layout = KVLayout(num_layers=LAYERS, num_kv_heads=NUM_KV, head_dim=DIM, page_size=PAGE, dtype=KV_FP8)
        fp8_pool = KVPool(layout, num_pages, dev)
        fp8_pool.kv.copy_(torch.randn(fp8_pool.kv.shape, device=dev).to(fp8_pool.kv.dtype))
        fp8_pool.kv_scales.fill_(1.0 / 448)  # type: ignore[union-attr]
        pool, scales = fp8_pool.kv, fp8_pool.kv_scales
    else:
        pool = torch.randn((num_pages, LAYERS, 2, NUM_KV, PAGE, DIM), dtype=torch.bfloat16, device=dev)
    order = torch.randperm(num_pages - 1, device=dev).to(torch.int32) + 1
    tables = order.view(batch, pages_per_seq).contiguous()
    ctx = torch.full((batch,), context, dtype=torch.int64, device=dev)
    qkv = torch.randn((batch, (NUM_Q + 2 * NUM_KV) * DIM), dtype=torch.bfloat16, device=dev)
    q = qkv[:, : NUM_Q * DIM].view(batch, NUM_Q, DIM)
    out = torch.empty((batch, NUM_Q, DIM), dtype=torch.bfloat16, device=dev)
    counters = torch.zeros(batch * NUM_KV, dtype=torch.int32, device=dev)
    kv_bytes = batch * context * 2 * NUM_KV * (DIM + 4 / PAGE if kv_fp8 else DIM * 2)  # one layer's K and V
    ref = None
    rows = []
    for block_n, warps, stages, splits, fused in shapes:

        def call(i: int, bn=block_n, w=warps, st=stages, sp=splits, fu=fused) -> None:
            paged.decode_attention(
                q, pool, i % LAYERS, tables, ctx, DIM**-0.5, sp, out, None, block_n=bn,
                counters=counters if fu else None, num_warps=w, num_stages=st, kv_scales=scales, f16=f16,
            )  # fmt: skip

        try:
            us = timed(call, LAYERS)
        except Exception as exc:  # a shape that does not compile or fit: skip it
            print(f"  batch {batch} {block_n}/{warps}/{stages}/{splits}: {type(exc).__name__}", file=sys.stderr)
            continue
        call(0)
        got = out.float().clone()
        ref = got if ref is None else ref
        rows.append(
            {
                "block_n": block_n,
                "warps": warps,
                "stages": stages,
                "splits": splits,
                "fused_merge": fused,
                "us_per_layer": us,
                "tb_s": kv_bytes / us / 1e6,
                "max_diff_vs_first": (got - ref).abs().max().item(),
            }
        )
        print(f"  (batch {batch} {block_n}/{warps}/{stages}/{splits}: {us:.2f} us)", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: r["us_per_layer"])
    default = decode_splits(batch, NUM_KV)
    kind = ("FP8 in float16 tiles" if f16 else "FP8") if kv_fp8 else "bf16"
    print(f"batch {batch}, context {context} ({kv_bytes / 1e6:.1f} MB of {kind} KV a layer), default splits {default}")
    for r in rows[:8]:
        print(
            f"  {r['us_per_layer']:6.2f} us  {r['tb_s']:.2f} TB/s  block_n {r['block_n']:3} warps {r['warps']}"
            f" stages {r['stages']} splits {r['splits']:2}{' fused' if r['fused_merge'] else ''}",
            flush=True,
        )
    return {
        "batch": batch,
        "context": context,
        "kv_mb_per_layer": kv_bytes / 1e6,
        "kv": "fp8_e4m3" if kv_fp8 else "bfloat16",
        "f16_tiles": f16,
        "default_splits": default,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--kv-fp8", action="store_true", help="an FP8 pool (values and a scale per block)")
    parser.add_argument("--f16-tiles", action="store_true", help="with --kv-fp8: its tiles read as float16")
    parser.add_argument("--defaults", action="store_true", help="only the engine's launch settings at each batch")
    parser.add_argument("--batches", default="1,64", help="the batches timed, of 1 and 64 (default both)")
    parser.add_argument("--quick", action="store_true", help="batch 64's sweep over 16 shapes, not 72")
    args = parser.parse_args()
    results = []
    small = itertools.product((32, 64), (4,), (2, 3), (8, 16, 32), (False, True))
    large = itertools.product((32, 64, 128), (4, 8), (1, 2, 3, 4), (1, 2, 4), (False,))
    if args.quick:
        large = itertools.product((64, 128), (4, 8), (2, 3), (1, 2), (False,))
    if args.defaults:  # decode_attention's own block and stages for the splits the engine picks
        splits1, splits64 = decode_splits(1, NUM_KV), decode_splits(64, NUM_KV)
        small = [(32 if splits1 >= 32 else 64, 4, 2, splits1, False)]
        large = [(128 if splits64 == 1 else 64, 4, 3 if splits64 == 1 else 2, splits64, False)]
    batches = {int(b) for b in args.batches.split(",")}
    if 1 in batches:
        results.append(probe(1, args.context, list(small), args.kv_fp8, args.f16_tiles))
    if 64 in batches:
        results.append(probe(64, args.context, list(large), args.kv_fp8, args.f16_tiles))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
