"""Probe: a decode step beside a prefill in a green context, on one GPU.

A decode-like step of the 7B stand-in (28 layers of Qwen2.5-7B's projections at batch M
and pdserve's paged decode attention over 2,048-token contexts, one CUDA graph) is timed
alone and beside a prefill-like load (2,048-token chunks of the same projections and
flash attention) running in a green context of P SMs on another stream of the same
process, for variants of decode's kernels:

* ``base``: cuBLAS as it chooses, attention splits as the engine sizes them for the
  whole GPU;
* ``splitsN``: attention cut into N context splits (programs far outnumber SMs, so the
  SMs that prefill leaves free share them out);
* ``carveout``: cuBLAS told to leave P SMs alone (``torch._C._set_sm_carveout_experimental``);
* ``triton``: a split-K Triton GEMM with many small programs in place of cuBLAS.

Also a table of FP8 (``torch._scaled_mm``, row-wise scales) against bf16 for the same
shapes at several batch sizes. Writes JSON to ``--out``. GPU only.

    python bench/probes/colocate_probe.py --out /tmp/colocate_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HIDDEN, QKV, INTER, LAYERS, HEADS, KV_HEADS, DIM, PAGE = 3584, 4608, 18944, 28, 28, 4, 128, 16


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k0 = tl.program_id(1) * per
    k1 = tl.minimum(k0 + per, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k0, k1, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < k1), other=0.0
        )
        w = tl.load(
            w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < k1), other=0.0
        )
        acc = tl.dot(x, w, acc)
    keep = (rm[:, None] < M) & (rn[None, :] < N)
    dest = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        tl.atomic_add(dest, acc, mask=keep)


def skinny(
    x: torch.Tensor, w: torch.Tensor, programs: int = 528, block_n: int = 64, block_k: int = 128
) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    blocks = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(programs, blocks), k // 512))
    block_m = max(16, triton.next_power_of_2(m))
    if split == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    _skinny_kernel[(blocks, split)](
        x,
        w,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        num_warps=4,
        num_stages=4,
    )
    return out if split == 1 else out.to(x.dtype)


class Weights:
    def __init__(self, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)

        def make(n: int, k: int) -> torch.Tensor:
            return (torch.randn((n, k), generator=g, device=device, dtype=torch.bfloat16) * 0.02).contiguous()

        self.layers = [
            (make(QKV, HIDDEN), make(HIDDEN, HIDDEN), make(2 * INTER, HIDDEN), make(HIDDEN, INTER))
            for _ in range(LAYERS)
        ]


def mlp_and_proj(h: torch.Tensor, layer: tuple, mm, attend) -> torch.Tensor:
    wqkv, wo, wgu, wd = layer
    qkv = mm(h, wqkv)
    a = attend(qkv)
    h = h + mm(a, wo)
    gu = mm(h, wgu)
    act = F.silu(gu[:, :INTER]) * gu[:, INTER:]
    return h + mm(act, wd)


def cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


class Decode:
    """The decode step at batch ``m`` over ``ctx``-token contexts in a paged pool."""

    def __init__(self, weights: Weights, m: int, ctx: int, device: torch.device) -> None:
        from pdserve.engine.kernels import paged

        self.paged = paged
        self.weights, self.m = weights, m
        pages_per = (ctx + PAGE - 1) // PAGE
        self.pool = torch.randn((m * pages_per, LAYERS, 2, KV_HEADS, PAGE, DIM), device=device, dtype=torch.bfloat16)
        self.tables = torch.arange(m * pages_per, device=device, dtype=torch.int32).view(m, pages_per)
        self.lens = torch.full((m,), ctx, device=device, dtype=torch.int32)
        self.x = torch.randn((m, HIDDEN), device=device, dtype=torch.bfloat16)
        self.out = torch.empty((m, HEADS, DIM), device=device, dtype=torch.bfloat16)

    def step(self, mm, splits: int) -> torch.Tensor:
        h = self.x
        for i, layer in enumerate(self.weights.layers):

            def attend(qkv: torch.Tensor, i: int = i) -> torch.Tensor:
                q = qkv[:, : HEADS * DIM].view(self.m, HEADS, DIM)
                self.paged.decode_attention(q, self.pool, i, self.tables, self.lens, DIM**-0.5, splits, self.out)
                return self.out.view(self.m, HIDDEN)

            h = mlp_and_proj(h, layer, mm, attend)
        return h


def prefill_loop(
    weights: Weights, stream: torch.cuda.Stream, stop: threading.Event, count: list[int], tokens: int
) -> None:
    torch.cuda.set_stream(stream)
    x = torch.randn((tokens, HIDDEN), device=stream.device, dtype=torch.bfloat16)

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        q = qkv[:, : HEADS * DIM].view(1, tokens, HEADS, DIM).transpose(1, 2)
        k = qkv[:, HEADS * DIM : HEADS * DIM + KV_HEADS * DIM].view(1, tokens, KV_HEADS, DIM).transpose(1, 2)
        v = qkv[:, HEADS * DIM + KV_HEADS * DIM :].view(1, tokens, KV_HEADS, DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(tokens, HIDDEN)

    with torch.inference_mode():
        while not stop.is_set():
            h = x
            for layer in weights.layers:
                h = mlp_and_proj(h, layer, cublas, attend)
                count[0] += 1
    stream.synchronize()


def green_stream(sms: int, device: int) -> torch.cuda.Stream:
    from torch.cuda.green_contexts import GreenContext

    context = GreenContext.create(num_sms=sms, device_id=device)
    green_stream.keep.append(context)  # type: ignore[attr-defined]
    return context.Stream()


green_stream.keep = []  # type: ignore[attr-defined]


def time_graph(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, reps: int) -> float:
    """ms per replay, replays queued back to back behind a sleep so the host never gaps them."""
    with torch.cuda.stream(stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(30e6))
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def measure(args: argparse.Namespace) -> dict:
    device = torch.device("cuda", 0)
    total_sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = Weights(device)
    from pdserve.engine.kernels import decode_splits

    rows: list[dict] = []
    decode_stream = torch.cuda.Stream(device, priority=-1)
    for m in args.batches:
        dec = Decode(weights, m, args.ctx, device)
        engine_splits = decode_splits(m, KV_HEADS, total_sms)
        variants: list[tuple[str, object, int, int]] = [("base", cublas, engine_splits, 0)]
        for s in args.splits:
            if s != engine_splits:
                variants.append((f"splits{s}", cublas, s, 0))
        variants.append(("carveout", cublas, engine_splits, -1))
        variants.append(("triton", skinny, engine_splits, 0))
        variants.append(("triton+splits8", skinny, max(engine_splits, 8), 0))
        for p in args.prefill_sms:
            for name, mm, splits, carve in variants:
                row = {"batch": m, "variant": name, "splits": splits, "prefill_sms": p}
                try:
                    carveout = p if carve < 0 else 0
                    if carveout:
                        torch._C._set_sm_carveout_experimental(carveout)
                    with torch.cuda.stream(decode_stream), torch.inference_mode():
                        for _ in range(2):
                            dec.step(mm, splits)
                        decode_stream.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, stream=decode_stream):
                            dec.step(mm, splits)
                    if carveout:
                        torch._C._set_sm_carveout_experimental(None)
                    row["alone_ms"] = round(time_graph(graph, decode_stream, args.reps), 3)
                    stream = green_stream(p, 0)
                    stop, count = threading.Event(), [0]
                    thread = threading.Thread(
                        target=prefill_loop, args=(weights, stream, stop, count, args.prefill_tokens)
                    )
                    t0 = time.perf_counter()
                    thread.start()
                    time.sleep(args.warmup)
                    beside = [time_graph(graph, decode_stream, args.reps) for _ in range(args.rounds)]
                    stop.set()
                    thread.join()
                    elapsed = time.perf_counter() - t0
                    row["beside_ms"] = [round(b, 3) for b in beside]
                    row["beside_median_ms"] = round(sorted(beside)[len(beside) // 2], 3)
                    row["slowdown"] = round(row["beside_median_ms"] / row["alone_ms"], 2)
                    row["prefill_layers_per_s"] = round(count[0] / elapsed, 1)
                    del graph
                except Exception as exc:  # a probe: record and go on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    try:
                        torch._C._set_sm_carveout_experimental(None)
                    except Exception:
                        pass
                print(json.dumps(row), flush=True)
                rows.append(row)
        del dec
        torch.cuda.empty_cache()
    # prefill alone in each green context, for the trade-off
    alone = {}
    for p in args.prefill_sms + [total_sms]:
        stream = green_stream(p, 0) if p < total_sms else torch.cuda.Stream(device)
        stop, count = threading.Event(), [0]
        thread = threading.Thread(target=prefill_loop, args=(weights, stream, stop, count, args.prefill_tokens))
        t0 = time.perf_counter()
        thread.start()
        time.sleep(1.5)
        stop.set()
        thread.join()
        alone[str(p)] = round(count[0] / (time.perf_counter() - t0), 1)
    print("prefill alone layers/s", alone, flush=True)
    return {"rows": rows, "prefill_alone_layers_per_s": alone, "total_sms": total_sms}


def fp8_table(args: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda", 0)
    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn((n, k), device=device, dtype=torch.bfloat16) * 0.02
        w_scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0
        w8 = (w / w_scale).to(torch.float8_e4m3fn)
        for m in (1, 16, 32, 64, 256, 2048):
            x = torch.randn((m, k), device=device, dtype=torch.bfloat16)
            row = {"shape": name, "m": m, "n": n, "k": k}

            def fp8(x: torch.Tensor = x, w8: torch.Tensor = w8, w_scale: torch.Tensor = w_scale) -> torch.Tensor:
                x_scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
                x8 = (x / x_scale).to(torch.float8_e4m3fn)
                return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16)

            for label, fn in (("bf16", lambda x=x, w=w: F.linear(x, w)), ("fp8_rowwise", fp8)):
                try:
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    reps = 50
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(reps):
                        fn()
                    end.record()
                    end.synchronize()
                    row[f"{label}_us"] = round(start.elapsed_time(end) / reps * 1000, 1)
                except Exception as exc:
                    row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:200]
            if "bf16_us" in row and "fp8_rowwise_us" in row:
                row["fp8_speedup"] = round(row["bf16_us"] / row["fp8_rowwise_us"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="colocate_probe.json")
    parser.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[16, 32])
    parser.add_argument("--splits", type=lambda s: [int(v) for v in s.split(",")], default=[4, 8])
    parser.add_argument("--prefill-sms", type=lambda s: [int(v) for v in s.split(",")], default=[66])
    parser.add_argument("--ctx", type=int, default=2304)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--skip-fp8", action="store_true")
    parser.add_argument("--skip-colocate", action="store_true")
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    if not args.skip_fp8:
        result["fp8"] = fp8_table(args)
    if not args.skip_colocate:
        result.update(measure(args))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
