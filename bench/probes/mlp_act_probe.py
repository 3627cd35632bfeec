# ruff: noqa: B023  (each closure is timed before the loop moves on)
"""Probe: a 7B layer's FP8 MLP at decode batch sizes, down's input quantized two ways, on one GPU.

Qwen2.5-7B's gate/up (37,888 x 3,584) and down (3,584 x 18,944) in FP8, over rows already
quantized per row (as the RMSNorm hands them over), microseconds a layer (a CUDA graph cycling
over enough copies of the weights that none is read from L2):

- ``two_launch``: what the engine runs: gate/up's W8A8 product written in bf16, then
  :func:`fp8.quantize_rows` of SiLU·up (two launches at 18,944 columns), then down's product;
- ``fused``: :func:`fp8_act.gate_up_act` (SiLU·up quantized a scale per row per 128 columns in
  gate/up's epilogue), then down's product over those blocks (:func:`fp8_act.down_tiles`);
  ``fused_w4``: the same with 4 warps for gate/up.

Before timing, each row count checks the fused path: its FP8 blocks bit for bit against
``quant.quantize_groups_fp8`` of the two-launch path's bf16 SiLU·up, and both outputs' error
against float32 over the unquantized SiLU·up (``checks``). After: each compiled variant of the
batched kernel and of gate_up_act, its registers, spills and shared memory (``kernels``).

    python bench/probes/mlp_act_probe.py --out mlp_act_probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_probe import timed

from pdserve.engine import quant
from pdserve.engine.kernels import elementwise, fp8, fp8_act, gemv

HIDDEN, INTER = 3584, 18944


def kernel_report(dev: torch.device) -> list[dict[str, Any]]:
    """Each compiled variant of the batched W8A8 kernel and of gate_up_act on this GPU: its
    registers a thread, spills (bytes) and shared memory, with its tile constants (a compile
    for sm_90 off the GPU pipelined nothing, not even Triton's textbook matmul: these are read
    here)."""
    out = []
    for name, fn in (("matmul", fp8._matmul_kernel), ("gate_up_act", fp8_act._gate_up_act_kernel)):
        caches = getattr(fn, "device_caches", {}).get(dev.index or 0)
        for kernel in caches[0].values() if caches else []:
            consts = {k: v for k, v in getattr(kernel, "constants", {}).items() if isinstance(v, (int, bool))}
            meta = kernel.metadata
            out.append(
                {
                    "kernel": name,
                    "n_regs": getattr(kernel, "n_regs", None),
                    "n_spills": getattr(kernel, "n_spills", None),
                    "shared": getattr(meta, "shared", None),
                    "num_warps": getattr(meta, "num_warps", None),
                    "num_stages": getattr(meta, "num_stages", None),
                    "constants": {str(k): v for k, v in consts.items()},
                }
            )
    for row in out:
        print("kernel", json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="16,32,64,128")
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    gemv.reserve_counters(dev)
    copies = max(2, -(-(512 << 20) // (3 * HIDDEN * INTER)))  # gate/up and down: 204 MB a copy
    gate_up = [quant.quantize_fp8(torch.randn((2 * INTER, HIDDEN), device=dev, dtype=torch.bfloat16) * 0.02)]
    down = [quant.quantize_fp8(torch.randn((HIDDEN, INTER), device=dev, dtype=torch.bfloat16) * 0.02)]
    for _ in range(copies - 1):
        gate_up.append(quant.Fp8Weight(gate_up[0].q.clone(), gate_up[0].scale.clone()))
        down.append(quant.Fp8Weight(down[0].q.clone(), down[0].scale.clone()))
    rows_out: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn((rows, HIDDEN), device=dev, dtype=torch.bfloat16)
        xq, xs = fp8.quantize_rows(x)
        gu_tiles = fp8.matmul_tiles(rows, 2 * INTER, HIDDEN)
        down_tiles = fp8.matmul_tiles(rows, HIDDEN, INTER)
        grouped_tiles = fp8_act.down_tiles(rows, HIDDEN, INTER)
        act_tiles = fp8_act.act_tiles(rows)

        def two_launch(i: int = 0) -> torch.Tensor:
            gu = fp8.matmul(xq, gate_up[i], None, xs, torch.bfloat16, **gu_tiles)  # type: ignore[arg-type]
            aq, a_s = fp8.quantize_rows(gu, True)
            return fp8.matmul(aq, down[i], None, a_s, torch.bfloat16, **down_tiles)  # type: ignore[arg-type]

        def fused(i: int = 0, warps: int = act_tiles["num_warps"]) -> torch.Tensor:
            aq, a_s = fp8_act.gate_up_act(xq, xs, gate_up[i], **{**act_tiles, "num_warps": warps})
            return fp8.matmul(aq, down[i], None, out_dtype=torch.bfloat16, x_group_scale=a_s, **grouped_tiles)  # type: ignore[arg-type]

        gu = fp8.matmul(xq, gate_up[0], None, xs, torch.bfloat16, **gu_tiles)  # type: ignore[arg-type]
        act = elementwise.silu_mul(gu)
        q_ref, s_ref = quant.quantize_groups_fp8(act)
        aq, a_s = fp8_act.gate_up_act(xq, xs, gate_up[0], **act_tiles)
        exact = act.float() @ down[0].dequantize(torch.float32).T
        check = {
            "rows": rows,
            "block_byte_mismatches": int((aq.view(torch.uint8) != q_ref.view(torch.uint8)).sum()),
            "scale_mismatches": int((a_s != s_ref).sum()),
            "two_launch_rel_err": ((two_launch().float() - exact).norm() / exact.norm()).item(),
            "fused_rel_err": ((fused().float() - exact).norm() / exact.norm()).item(),
        }
        checks.append(check)
        print("check", json.dumps(check), flush=True)
        nbytes = gate_up[0].q.numel() + down[0].q.numel()
        for name, fn in (
            ("two_launch", two_launch),
            ("fused", fused),
            ("fused_w4", lambda i=0: fused(i, 4)),
        ):

            def cycle(fn: Any = fn) -> int:
                for i in range(copies):
                    fn(i)
                return copies

            try:
                us = timed(cycle)
            except Exception as exc:  # tiles out of shared memory or registers
                print(f"{name} {rows}: {exc!r}", file=sys.stderr, flush=True)
                continue
            row = {"rows": rows, "variant": name, "us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 2)}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "kernels": kernel_report(dev),
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "command": "python bench/probes/mlp_act_probe.py " + " ".join(sys.argv[1:]),
        "checks": checks,
        "rows": rows_out,
    }
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
