"""First GPU reading of the engine: correctness and speed beside transformers.

On one device, for the default tiny model (fp32) and a model of Qwen2.5-7B dimensions
with random bf16 weights, in one run:

  * greedy output of pdserve's engine against ``transformers.generate`` on the same
    weights and device (tokens that agree, per prompt);
  * decode milliseconds per token at batch 1 (512-token prompt, 128 new tokens);
  * output tokens/s for 64 requests of 512 in / 128 out (pdserve continuous batching
    against ``generate`` on one static batch of 64).

    python bench/probes/gpu_reading.py --device cuda --json gpu.json
    python bench/probes/gpu_reading.py --device cpu --small          # a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.engine import attention
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.tiny_model import ensure_default_model
from pdserve.schemas import SamplingParams


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def use_attention(model: torch.nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers
        for module in model.modules():
            cfg = getattr(module, "config", None)
            if cfg is not None:
                cfg._attn_implementation = name


def hf_generate(
    model: torch.nn.Module, prompts: list[list[int]], n: int, device: torch.device, pad: int = 0
) -> tuple[list[list[int]], float]:
    use_attention(model, "sdpa")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        sync(device)
        t = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad
        )
        sync(device)
        seconds = time.perf_counter() - t
    use_attention(model, attention.ATTN_IMPLEMENTATION)
    return out[:, width:].tolist(), seconds


def engine_run(engine: Engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float, float]:
    """Outputs, seconds for everything, seconds to the first token of the last request."""
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    tag = str(time.perf_counter())
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    outs: dict[str, list[int]] = {}
    sync(engine.runner.device)
    t = time.perf_counter()
    first = 0.0
    while engine.has_work():
        for o in engine.step():
            if o.rid not in outs:
                first = time.perf_counter() - t
            outs.setdefault(o.rid, []).extend(o.token_ids)
    sync(engine.runner.device)
    return [outs[f"{tag}-{i}"] for i in range(len(prompts))], time.perf_counter() - t, first


def agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def measure(
    name: str,
    model: torch.nn.Module,
    device: torch.device,
    vocab: int,
    max_tokens: int,
    requests: int,
    prompt_len: int,
    new: int,
) -> dict[str, object]:
    config = EngineConfig(
        device=str(device), max_total_tokens=max_tokens, max_num_seqs=max(requests, 8), chunked_prefill_size=8192
    )
    engine = Engine(ModelRunner(ModelSpec(Path(name)), config, model=model), config)
    rng = random.Random(0)
    row: dict[str, object] = {
        "model": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype),
    }
    # correctness: 4 prompts of different lengths, 32 greedy tokens
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (17, 130, 300, 511)]
    say(f"{name}: greedy equality")
    ours, _, _ = engine_run(engine, prompts, 32)
    theirs = [hf_generate(model, [p], 32, device)[0][0] for p in prompts]
    row["greedy_tokens_agreeing"] = [agree(a, b) for a, b in zip(ours, theirs, strict=True)]
    row["greedy_equal"] = ours == theirs
    # batch 1 decode
    say(f"{name}: batch 1")
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    engine_run(engine, [prompt], 4)  # warm-up
    _, total, first = engine_run(engine, [prompt], new)
    row["pdserve_ms_per_token_b1"] = (total - first) / (new - 1) * 1e3
    hf_generate(model, [prompt], 4, device)
    _, t1 = hf_generate(model, [prompt], 1, device)
    _, tn = hf_generate(model, [prompt], new, device)
    row["hf_ms_per_token_b1"] = (tn - t1) / (new - 1) * 1e3
    # many requests
    say(f"{name}: {requests} requests")
    batch = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    _, seconds, _ = engine_run(engine, batch, new)
    row[f"pdserve_out_tok_s_{requests}"] = requests * new / seconds
    _, seconds = hf_generate(model, batch, new, device)
    row[f"hf_static_out_tok_s_{requests}"] = requests * new / seconds
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small stand-in for the 7B model (script check)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    quiet_transformers()
    from transformers import AutoModelForCausalLM, Qwen2Config

    device = torch.device(args.device)
    impl = attention.register()
    rows = []
    tiny_dir = ensure_default_model(Path(tempfile.mkdtemp()))
    tiny = (
        AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation=impl).to(device).eval()
    )
    rows.append(measure("tiny-qwen2 (default)", tiny, device, 4000, 200_000, args.requests, 512, 128))
    del tiny
    dims = dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    )
    if args.small:
        dims = dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
        )
    config = Qwen2Config(**dims, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    say("building the 7B-dimension model with random weights")
    with device:
        big = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=impl).eval()
    rows.append(
        measure(
            "qwen2.5-7b dims, random " + str(dtype).removeprefix("torch."),
            big,
            device,
            min(dims["vocab_size"], 150000) - 1,
            64 * 700,
            args.requests,
            512,
            128,
        )
    )
    if device.type == "cuda":
        bytes_ = sum(p.numel() * p.element_size() for p in big.parameters())
        rows[-1]["weight_bytes"] = bytes_
        rows[-1]["name_of_device"] = torch.cuda.get_device_name(device)
    print(json.dumps(rows, indent=2))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
