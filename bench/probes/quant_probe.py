"""Per-row FP8 quantization of down's input (SiLU·up fused) on a GPU: the two-launch chunked
path against one program a row holding the whole row, at prefill and decode row counts.

    python bench/probes/quant_probe.py --out quant_probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gemv_probe import launched_ms

from pdserve.engine.kernels.fp8_quant import quantize_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--k", type=int, default=18944, help="columns (down's input at Qwen2.5-7B)")
    args = parser.parse_args()
    rows_out = []
    for rows in (64, 512, 4096):
        x = torch.randn((rows, 2 * args.k), device="cuda", dtype=torch.bfloat16)
        ref_q, ref_s = quantize_rows(x, silu_mul_input=True)
        variants = {"chunks_2048": {}, "chunks_4096": {"block_k": 4096}}
        for warps in (8, 16, 32):
            variants[f"one_pass_w{warps}"] = {"block_k": 1 << 15, "num_warps": warps}
        for name, kw in variants.items():
            try:
                q, s = quantize_rows(x, silu_mul_input=True, **kw)
                same = bool(torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s))
                us = launched_ms(lambda kw=kw, x=x: quantize_rows(x, silu_mul_input=True, **kw), reps=50) * 1e3
            except Exception as exc:  # a variant Triton cannot compile (registers): recorded
                rows_out.append({"rows": rows, "variant": name, "error": str(exc)[:200]})
                continue
            gbs = rows * args.k * (4 + 1) / us / 1e3
            rows_out.append({"rows": rows, "variant": name, "us": round(us, 2), "gb_s": round(gbs), "same_bits": same})
            print(f"rows {rows:5d} {name:14s} {us:9.2f} us {gbs:6.0f} GB/s same={same}", flush=True)
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "k": args.k}
    args.out.write_text(json.dumps(result | {"rows": rows_out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
