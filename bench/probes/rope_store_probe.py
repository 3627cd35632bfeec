"""The rotary + KV store of one layer on a GPU (Qwen2.5-7B's heads, 16-token pages): into a bf16
pool, and into an FP8 pool with the key rotation inside the rotary kernel (the default) or as
torch's passes after it (``rope.FUSED_KEY_ROTATION`` off), at decode and prefill row counts;
from 1,024 rows also the fused kernel with a program a token (``fp8_fused_one``: the rotation's
matrix read by every program, against ``rope.rotation_tokens``' share). Each call is timed on a
fresh copy of the rows (the store rotates them in place), less the copy.

    python bench/probes/rope_store_probe.py --out rope_store_probe.json
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

from pdserve.engine.kernels import rope
from pdserve.engine.kv_pool import KV_FP8, KVLayout, KVPool

NUM_Q, NUM_KV, DIM, PAGE, LAYERS = 28, 4, 128, 16, 28


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,64,512,4096", help="the step's tokens, comma-separated")
    args = parser.parse_args()
    device = torch.device("cuda")
    inv = 1.0 / (1e6 ** (torch.arange(0, DIM, 2, device=device).float() / DIM))
    emb = torch.arange(8192, device=device).float()[:, None] * inv[None, :]
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    readings = []
    share = rope.rotation_tokens
    for rows in (int(r) for r in args.rows.split(",")):
        pages = rows // PAGE + 2
        positions = torch.arange(rows, device=device)
        slots = torch.arange(rows, device=device) + PAGE  # one sequence from page 1
        fresh = torch.randn((rows, (NUM_Q + 2 * NUM_KV) * DIM), device=device, dtype=torch.bfloat16)
        qkv = fresh.clone()
        copy_ms = launched_ms(lambda qkv=qkv, fresh=fresh: qkv.copy_(fresh), reps=50)
        out: dict[str, torch.Tensor] = {}
        variants = [("bf16_pool", "bfloat16", True), ("fp8_fused", KV_FP8, True), ("fp8_torch", KV_FP8, False)]
        if rows >= 1024:
            variants.append(("fp8_fused_one", KV_FP8, True))
        for name, dtype, fused in variants:
            pool = KVPool(KVLayout(LAYERS, NUM_KV, DIM, PAGE, dtype), pages, device)
            rope.FUSED_KEY_ROTATION = fused
            rope.rotation_tokens = (lambda tokens: 1) if name == "fp8_fused_one" else share

            def call(qkv=qkv, fresh=fresh, pool=pool, positions=positions, slots=slots) -> None:
                qkv.copy_(fresh)
                rope.rope_store(qkv, NUM_Q, NUM_KV, cos, sin, positions, slots, pool.kv, 3, pool.kv_scales)

            us = (launched_ms(call, reps=50) - copy_ms) * 1e3
            call()
            out[name] = qkv.clone()
            readings.append({"rows": rows, "variant": name, "us": round(us, 2)})
            print(f"rows {rows:5d} {name:10s} {us:9.2f} us", flush=True)
        rope.FUSED_KEY_ROTATION, rope.rotation_tokens = True, share
        diff = (out["fp8_fused"].float() - out["fp8_torch"].float()).abs()
        readings.append(
            {"rows": rows, "fused_vs_torch_max_abs": diff.max().item(), "same_bits": diff.max().item() == 0}
        )
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "layout": [NUM_Q, NUM_KV, DIM, PAGE],
    }
    args.out.write_text(json.dumps(result | {"readings": readings}, indent=1) + "\n")


if __name__ == "__main__":
    main()
