"""What a whole prompt's attention costs the first time its length is met, on one GPU.

Qwen2.5-7B's heads (28 queries over 4 key/value heads of 128, bf16, causal), as the fast path
calls the library's SDPA for a whole prompt. For each length, in a thread that has not run
SDPA before (the library may cache its set-up per thread: cuDNN's graphs are): the first call,
the second at the same length, and a first call at the next new length, each timed from the
host to the device's end (milliseconds); per backend (``auto``: the library's choice, then
cuDNN and flash pinned), then ``padded``: the fast path's own call (:func:`causal_sdpa`, up to
:func:`sdpa_length`) in a thread where :meth:`LlamaFamily.warm_up_sdpa`'s lengths were met.

    python bench/probes/sdpa_shapes_probe.py --out sdpa_shapes_probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.engine.models.llama import causal_sdpa, sdpa_length, sdpa_lengths

NUM_Q, NUM_KV, DIM = 28, 4, 128
BACKENDS = {"auto": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def in_fresh_thread(fn: Callable[[], dict]) -> dict:
    out: dict = {}

    def run() -> None:
        try:
            out.update(fn())
        except RuntimeError as exc:  # a backend that cannot run these shapes
            out["error"] = repr(exc)[:300]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out


def timed(call: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = torch.randn(n, (NUM_Q + 2 * NUM_KV) * DIM, device="cuda", dtype=torch.bfloat16)
    q = rows[:, : NUM_Q * DIM].view(n, NUM_Q, DIM)
    k = rows[:, NUM_Q * DIM : (NUM_Q + NUM_KV) * DIM].view(n, NUM_KV, DIM)
    v = rows[:, (NUM_Q + NUM_KV) * DIM :].view(n, NUM_KV, DIM)
    return q, k, v


def library(n: int, backend: SDPBackend | None) -> Callable[[], object]:
    q, k, v = qkv(n)

    def call() -> object:
        args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        if backend is None:
            return F.scaled_dot_product_attention(*args, is_causal=True, scale=DIM**-0.5, enable_gqa=True)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(*args, is_causal=True, scale=DIM**-0.5, enable_gqa=True)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", default="517,544,580,1000,2048,2080", help="prompt lengths, comma-separated")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    rows: list[dict] = []
    for backend in BACKENDS.values():  # load the libraries once, in this thread at a length not measured
        try:
            timed(library(100, backend))
        except RuntimeError:
            pass
    for name, backend in BACKENDS.items():

        def measure(backend: SDPBackend | None = backend) -> dict:
            out = {}
            for n in lengths:
                first = timed(library(n, backend))
                again = timed(library(n, backend))
                out[n] = {"first_ms": round(first, 3), "again_ms": round(again, 3)}
            return out

        for n, r in in_fresh_thread(measure).items():
            rows.append({"variant": name, "error": r} if n == "error" else {"variant": name, "length": n, **r})

    def padded() -> dict:
        width = (NUM_Q + 2 * NUM_KV) * DIM
        for length in sdpa_lengths(max(lengths)):  # as the runner's warm-up meets them
            causal_sdpa(torch.zeros(length, width, device="cuda", dtype=torch.bfloat16), NUM_Q, NUM_KV, DIM, DIM**-0.5)
        out = {}
        for n in lengths:
            step_rows = torch.randn(n, width, device="cuda", dtype=torch.bfloat16)

            def call(rows: torch.Tensor = step_rows) -> object:
                return causal_sdpa(rows, NUM_Q, NUM_KV, DIM, DIM**-0.5)

            out[n] = {"first_ms": round(timed(call), 3), "again_ms": round(timed(call), 3), "padded_to": sdpa_length(n)}
        return out

    for n, r in in_fresh_thread(padded).items():
        rows.append({"variant": "padded", "error": r} if n == "error" else {"variant": "padded", "length": n, **r})
    for r in rows:
        print(json.dumps(r))
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": "python bench/probes/sdpa_shapes_probe.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
