"""Offline engine benchmark: pdserve's engine against transformers on the same work.

The same seeded mixed workload (prompts 16-1024 tokens, outputs 16-256, greedy,
fixed output lengths) runs through

  * pdserve's engine (paged KV, continuous batching, chunked prefill) on the forward pass
    ``--model-impl`` picks (mode ``pdserve``) and on the stock ``transformers`` code with
    pdserve's paged attention (mode ``stock``),
  * transformers ``generate`` on left-padded static batches of ``concurrency``,
  * transformers continuous batching (``init_continuous_batching`` manager),

at each concurrency (requests in flight), on the same model, in one process, one after
the other. Output tokens/s counts only the tokens each request asked for. The ratio
column is pdserve against the best transformers mode of the same row.

    python bench/engine_bench.py                       # tiny model, concurrency 1, 8, 64
    python bench/engine_bench.py --model 100m          # ~100M-parameter random Qwen2
    python bench/engine_bench.py --model smollm2       # SmolLM2-135M-Instruct, the default model (real weights)
    python bench/engine_bench.py --json out.json
    python bench/engine_bench.py --model smollm2 --modes pdserve,stock --input-len 256,256 --output-len 64,64 \
        --concurrency 1,8,16 --fresh          # the CPU passes A/B, new prompts each repeat
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.default_model import ensure_default_model as ensure_smollm2
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import build_engine, quiet_transformers
from pdserve.engine.tiny_model import ensure_default_model
from pdserve.schemas import SamplingParams


@dataclass
class Request:
    prompt: list[int]
    output_len: int


def workload(n: int, seed: int, vocab: int, min_in: int, max_in: int, min_out: int, max_out: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request([rng.randrange(3, vocab) for _ in range(rng.randint(min_in, max_in))], rng.randint(min_out, max_out))
        for _ in range(n)
    ]


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- systems ---------------------------------------------------------------------
def run_pdserve(engine: Engine, reqs: list[Request], concurrency: int) -> float:
    pending = list(enumerate(reqs))
    in_flight = 0
    started = time.perf_counter()
    while pending or engine.has_work():
        while pending and in_flight < concurrency:
            i, r = pending.pop(0)
            engine.add_request(
                f"r{i}-{started}",
                r.prompt,
                SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True),
            )
            in_flight += 1
        for out in engine.step():
            if out.finish_reason is not None:
                in_flight -= 1
    return time.perf_counter() - started


def run_hf_static(model: torch.nn.Module, reqs: list[Request], concurrency: int, pad_id: int) -> float:
    started = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(reqs), concurrency):
            batch = reqs[b : b + concurrency]
            width = max(len(r.prompt) for r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[i, width - len(r.prompt) :] = 1
            n = max(r.output_len for r in batch)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - started


def run_hf_cb(model: torch.nn.Module, reqs: list[Request], concurrency: int) -> float:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in reqs), eos_token_id=-1)
    longest = max(len(r.prompt) + r.output_len for r in reqs)
    blocks = concurrency * (-(-longest // 256) + 1) + 8  # sized like pdserve's pool: enough, not all RAM
    cb = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=2048, max_requests_per_batch=max(concurrency, 1))
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    manager.start()
    pending = list(enumerate(reqs))
    in_flight = 0
    started = time.perf_counter()
    try:
        while pending or in_flight:
            while pending and in_flight < concurrency:
                i, r = pending.pop(0)
                manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.output_len)
                in_flight += 1
            result = manager.get_result(timeout=1.0)
            if result is not None and result.is_finished():
                in_flight -= 1
    finally:
        manager.stop(block=True)
    return time.perf_counter() - started


# ---- driver ------------------------------------------------------------------------
def make_100m(base: Path, out: Path) -> Path:
    """A ~100M-parameter Qwen2 with random weights and the tiny model's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(base)
    config = Qwen2Config(
        vocab_size=len(tok) + (-len(tok)) % 64,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="tiny", help="tiny, 100m, smollm2, or a model directory (default: %(default)s)"
    )
    parser.add_argument("--concurrency", default="1,8,64", help="comma-separated (default: %(default)s)")
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests per row (default: 4 at concurrency 1, else max(concurrency, 16))",
    )
    parser.add_argument("--input-len", default="16,1024", help="min,max prompt tokens (default: %(default)s)")
    parser.add_argument("--output-len", default="16,256", help="min,max output tokens (default: %(default)s)")
    parser.add_argument("--modes", default="pdserve,hf-static,hf-cb", help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fresh", action="store_true", help="new prompts each repeat (every mode of a repeat gets the same ones)"
    )
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (default: %(default)s)")
    parser.add_argument(
        "--model-impl",
        default=EngineConfig.model_impl,
        choices=("auto", "pdserve", "transformers"),
        help="pdserve's forward pass: its own (pdserve), the stock code (transformers) (default: %(default)s)",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per mode; the table shows the median (default: %(default)s)"
    )
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-bench")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    quiet_transformers()
    from transformers import AutoModelForCausalLM

    tiny = ensure_default_model(args.data_dir, progress=progress)
    if args.model == "tiny":
        path = tiny
    elif args.model == "100m":
        path = make_100m(tiny, args.data_dir / "models" / "random-qwen2-100m")
    elif args.model == "smollm2":
        path = ensure_smollm2(args.data_dir, progress=progress)
    else:
        path = Path(args.model)
    modes = args.modes.split(",")
    min_in, max_in = (int(x) for x in args.input_len.split(","))
    min_out, max_out = (int(x) for x in args.output_len.split(","))
    # Room for every request in flight at its longest (300,000 tokens at most): a real model's
    # KV is large (SmolLM2: 46 KB a token in float32, 14 GB for 300,000 tokens).
    progress(f"loading {path}")
    most = max(int(c) for c in args.concurrency.split(","))
    pool = min(300_000, most * (max_in + max_out) + 4096)
    engine = build_engine(
        path, EngineConfig(max_total_tokens=pool, max_num_seqs=256, model_impl=args.model_impl), dtype=args.dtype
    )
    engines = {"pdserve": engine}
    if "stock" in modes:
        stock = EngineConfig(max_total_tokens=pool, max_num_seqs=256, model_impl="transformers")
        engines["stock"] = build_engine(path, stock, dtype=args.dtype)
    model = engine.runner.model
    dtype = next(model.parameters()).dtype
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    if any(m.startswith("hf") for m in modes):
        progress(f"loading {path} for transformers")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        n = args.requests or (4 if concurrency == 1 else max(concurrency, 16))
        reqs = workload(n, args.seed + concurrency, min(vocab, 4000), min_in, max_in, min_out, max_out)
        useful = sum(r.output_len for r in reqs)
        row = {
            "concurrency": concurrency,
            "requests": n,
            "output_tokens": useful,
            "prompt_tokens": sum(len(r.prompt) for r in reqs),
        }
        warm = workload(2, 99, min(vocab, 4000), 16, 64, 4, 8)
        runs: dict[str, list[float]] = {m: [] for m in modes}
        for rep in range(args.repeat):  # modes interleaved, so each repeat shares the machine's mood
            if args.fresh:
                seed = args.seed + concurrency + 1000 * (rep + 1)
                reqs = workload(n, seed, min(vocab, 4000), min_in, max_in, min_out, max_out)
                useful = sum(r.output_len for r in reqs)
            for mode in modes:
                gc.collect()
                progress(
                    f"concurrency {concurrency}, run {rep + 1}/{args.repeat}: {mode} ({n} requests, {useful} output tokens)"
                )
                if mode in engines:
                    eng = engines[mode]
                    run_pdserve(eng, warm, 2)
                    eng.pages.reset_prefix_cache()  # every measured run cold (the same prompts repeat)
                    cached = eng.stats.cached_tokens
                    seconds = run_pdserve(eng, reqs, concurrency)
                    key = f"{mode}_cached_tokens"
                    row[key] = row.get(key, 0) + eng.stats.cached_tokens - cached
                elif mode == "hf-static":
                    run_hf_static(hf, warm, 2, pad_id)
                    seconds = run_hf_static(hf, reqs, concurrency, pad_id)
                elif mode == "hf-cb":
                    seconds = run_hf_cb(hf, reqs, concurrency)
                else:
                    raise SystemExit(f"unknown mode {mode}")
                runs[mode].append(useful / seconds)
                progress(f"  {useful / seconds:,.1f} output tok/s ({seconds:.1f}s)")
        for mode in modes:
            row[mode] = sorted(runs[mode])[len(runs[mode]) // 2]
            row[f"{mode}_runs"] = runs[mode]
        best = max((row[m] for m in modes if m != "pdserve"), default=None)
        if "pdserve" in row and best:
            row["ratio"] = row["pdserve"] / best
        rows.append(row)

    impl = engine.runner.model_impl
    threads = torch.get_num_threads()
    print(f"\nmodel {path.name}: {params / 1e6:.1f}M parameters, {dtype}, {threads} threads, pdserve mode: {impl}")
    head = (
        "| concurrency | requests | "
        + " | ".join(f"{m} out tok/s (min-max)" for m in modes)
        + " | pdserve / best other | pdserve cached prompt tokens |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for row in rows:
        cells = " | ".join(f"{row[m]:,.1f} ({min(row[m + '_runs']):,.1f}-{max(row[m + '_runs']):,.1f})" for m in modes)
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else "-"
        cached = row.get("pdserve_cached_tokens", "-")
        print(f"| {row['concurrency']} | {row['requests']} | {cells} | {ratio} | {cached} |")
    if args.json:
        data = {"date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv)}
        data.update({"model": str(path), "parameters": params, "dtype": str(dtype), "model_impl": impl, "rows": rows})
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
