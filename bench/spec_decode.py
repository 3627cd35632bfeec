"""Speculative decoding with n-gram drafts on the default model (SmolLM2-135M-Instruct) on
this CPU: the engine offline with and without ``--speculative-algorithm ngram``, in one run.

Workloads (chat-templated, greedy, fresh: every prompt is new to both engines, each engine
starts empty and sees each prompt once):

  * ``grounded``: rewrite / repeat / edit text or code given in the prompt (n-grams hit),
  * ``chat``: open-ended questions (drafts mostly miss: speculation should back off),

each at batch 1 (one request at a time: TPOT = (last token - first token) / (tokens - 1)),
and a mix of both with ``--in-flight`` requests at once (output tokens per second, totals over
``--in-flight-repeat`` rounds of new prompts, the modes' order alternating). Modes
alternate per workload (plain, speculative, plain, ...) so a noisy neighbour hits both.
Reports TPOT, acceptance (accepted / drafted), tokens per verify, steps saved, and whether
greedy output is identical with and without speculation.

    python bench/spec_decode.py --json docs/data/spec_decode.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.default_model import ensure_default_model
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import build_engine, quiet_transformers
from pdserve.schemas import SamplingParams

SUBJECTS = ["the river", "a small bakery", "the city council", "our new library", "the mountain trail", "a robot"]
VERBS = ["opened", "closed", "announced", "repaired", "visited", "described", "painted", "measured"]
OBJECTS = ["the old bridge", "a public garden", "the annual report", "twelve new benches", "the train station"]
TAILS = ["on Monday morning", "after a long delay", "with help from volunteers", "for the first time", "in March"]
NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana"]
TOPICS = [
    "why the sky looks blue",
    "how bees make honey",
    "a good way to learn a new language",
    "the history of the bicycle",
    "what makes a story exciting",
    "how to plan a weekend trip",
    "why sleep matters",
    "how volcanoes form",
    "tips for keeping a plant alive",
    "what a computer's memory does",
]
ASKS = ["Explain {}.", "Tell me about {}.", "Write a short paragraph on {}.", "Give me some thoughts on {}."]


def passage(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        who = rng.choice(SUBJECTS + NAMES)
        out.append(
            f"{who[0].upper()}{who[1:]} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)} "
            f"({rng.randint(2, 98)} people were there)."
        )
    return " ".join(out)


def code(rng: random.Random) -> str:
    name = rng.choice(["total", "count_items", "average", "merge_lists", "scale"])
    var = rng.choice(["values", "items", "numbers", "data"])
    k = rng.randint(2, 9)
    return (
        f"def {name}({var}):\n"
        f"    result = 0\n"
        f"    for x in {var}:\n"
        f"        if x > {k}:\n"
        f"            result += x * {k}\n"
        f"        else:\n"
        f"            result -= x\n"
        f"    return result\n"
    )


def grounded(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return f"Repeat the following text exactly, word for word:\n\n{passage(rng, 4)}"
    if kind == 1:
        text = passage(rng, 4)
        return f"Rewrite this text, replacing every number with the word 'many':\n\n{text}"
    new = rng.choice(["compute", "process", "tally"])
    return f"Rename the function below to `{new}` and print the whole code again:\n\n```python\n{code(rng)}```"


def chat(rng: random.Random) -> str:
    return rng.choice(ASKS).format(rng.choice(TOPICS)) + f" (Ask #{rng.randint(1, 10**6)})"


def encode(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(templated, add_special_tokens=False)


def prompt_counts(engine: Engine, before: tuple[int, int]) -> dict:
    """Prompt tokens, and of them cached ones, since ``before`` (:func:`counts_now`)."""
    prompt, cached = counts_now(engine)
    return {"prompt_tokens": prompt - before[0], "cached_tokens": cached - before[1]}


def counts_now(engine: Engine) -> tuple[int, int]:
    return engine.stats.prompt_tokens, engine.stats.cached_tokens


def run_batch1(engine: Engine, prompts: list[list[int]], max_new: int, tag: str) -> dict:
    tpots, outputs, tokens = [], [], 0
    before = counts_now(engine)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_new_tokens=max_new, temperature=0.0))
        first = last = None
        out: list[int] = []
        while engine.has_work():
            for o in engine.step():
                now = time.perf_counter()
                if first is None:
                    first = now
                last = now
                out += o.token_ids
        assert first is not None and last is not None
        outputs.append(out)
        tokens += len(out)
        if len(out) > 1:
            tpots.append((last - first) / (len(out) - 1))
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "tpot_ms_median": round(statistics.median(tpots) * 1e3, 2),
        "tpot_ms_mean": round(statistics.mean(tpots) * 1e3, 2),
        "seconds": round(time.perf_counter() - started, 2),
        **prompt_counts(engine, before),
        "outputs": outputs,
    }


def run_in_flight(engine: Engine, prompts: list[list[int]], max_new: int, tag: str) -> dict:
    before = counts_now(engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_new_tokens=max_new, temperature=0.0))
    outs: dict[str, list[int]] = {}
    started = time.perf_counter()
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
    seconds = time.perf_counter() - started
    tokens = sum(len(v) for v in outs.values())
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "out_tok_s": round(tokens / seconds, 1),
        **prompt_counts(engine, before),
        "outputs": [outs[f"{tag}-{i}"] for i in range(len(prompts))],
    }


def same(a: list[list[int]], b: list[list[int]]) -> str:
    """How many requests' greedy outputs are identical, as ``n/total``."""
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def spec_delta(engine: Engine, before: dict) -> dict:
    s = engine.stats.spec
    if s is None:
        return {}
    now = {
        "verifies": s.verifies,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "emitted": s.emitted,
        "backoffs": s.backoffs,
        "probes": s.probes,
        "probes_deferred": s.probes_deferred,
    }
    d = {k: now[k] - before.get(k, 0) for k in now}
    d["acceptance"] = round(d["accepted"] / d["drafted"], 3) if d["drafted"] else 0.0
    d["tokens_per_verify"] = round(d["emitted"] / d["verifies"], 2) if d["verifies"] else 0.0
    d["steps_saved"] = d["accepted"]
    d["lengths"] = list(s.lengths)
    d["_now"] = now
    return d


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6, help="batch-1 requests per workload (default: %(default)s)")
    parser.add_argument("--in-flight", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument(
        "--in-flight-repeat", type=int, default=4, help="rounds of new prompts at --in-flight (default: %(default)s)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--draft-tokens", type=int, default=4, help="K (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=None, help="prompts' seed (default: from the clock: fresh)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-bench")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    quiet_transformers()
    from transformers import AutoTokenizer

    path = ensure_default_model(args.data_dir, progress=lambda m: print(m, file=sys.stderr))
    tokenizer = AutoTokenizer.from_pretrained(path)
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    workloads = {
        "grounded": [encode(tokenizer, grounded(rng)) for _ in range(args.requests)],
        "chat": [encode(tokenizer, chat(rng)) for _ in range(args.requests)],
    }
    mixes = [
        [encode(tokenizer, grounded(rng) if i % 2 else chat(rng)) for i in range(args.in_flight)]
        for _ in range(args.in_flight_repeat)
    ]
    pool = args.in_flight * (600 + args.max_new_tokens) + 4096
    base = {"max_total_tokens": pool, "max_num_seqs": max(args.in_flight, 32)}
    spec = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": args.draft_tokens}
    engines = {
        "plain": build_engine(path, EngineConfig(**base), dtype=args.dtype),  # type: ignore[arg-type]
        "ngram": build_engine(path, EngineConfig(**base, **spec), dtype=args.dtype),  # type: ignore[arg-type]
    }
    warm = encode(tokenizer, "Say hello.")
    for engine in engines.values():  # one short request each: first-call costs out of the figures
        run_batch1(engine, [warm], 8, "warm")
    results: dict = {"batch1": {}, "in_flight": {}}
    before = spec_delta(engines["ngram"], {})["_now"]
    for name, prompts in workloads.items():
        row = {}
        for mode, engine in engines.items():
            print(f"{name} batch 1: {mode}", file=sys.stderr, flush=True)
            row[mode] = run_batch1(engine, prompts, args.max_new_tokens, f"{name}-{mode}")
        delta = spec_delta(engines["ngram"], before)
        before = delta.pop("_now")
        row["ngram"]["spec"] = delta
        row["tpot_speedup"] = round(row["plain"]["tpot_ms_median"] / row["ngram"]["tpot_ms_median"], 3)
        row["identical_requests"] = same(row["plain"].pop("outputs"), row["ngram"].pop("outputs"))
        results["batch1"][name] = row
        print(json.dumps({name: row}), file=sys.stderr, flush=True)
    # Rounds of fresh prompts, the modes' order alternating: one pair of runs on two shared
    # cores moves by +-15% from one minute to the next; the totals over rounds hold better.
    runs: dict[str, list[dict]] = {mode: [] for mode in engines}
    pair_ratios, identical = [], 0
    for r, mixed in enumerate(mixes):
        for mode in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            print(f"{args.in_flight} in flight, round {r + 1}: {mode}", file=sys.stderr, flush=True)
            runs[mode].append(run_in_flight(engines[mode], mixed, args.max_new_tokens, f"mix{r}-{mode}"))
        plain, ngram = runs["plain"][-1], runs["ngram"][-1]
        pair_ratios.append(round(ngram["out_tok_s"] / plain["out_tok_s"], 3))
        identical += sum(x == y for x, y in zip(plain.pop("outputs"), ngram.pop("outputs"), strict=True))
    row: dict = {}
    for mode, done in runs.items():
        tokens, seconds = sum(d["output_tokens"] for d in done), sum(d["seconds"] for d in done)
        row[mode] = {
            "requests": sum(d["requests"] for d in done),
            "output_tokens": tokens,
            "seconds": round(seconds, 2),
            "out_tok_s": round(tokens / seconds, 1),
            "rounds_out_tok_s": [d["out_tok_s"] for d in done],
            "prompt_tokens": sum(d["prompt_tokens"] for d in done),
            "cached_tokens": sum(d["cached_tokens"] for d in done),
        }
    delta = spec_delta(engines["ngram"], before)
    delta.pop("_now")
    row["ngram"]["spec"] = delta
    row["throughput_ratio"] = round(row["ngram"]["out_tok_s"] / row["plain"]["out_tok_s"], 3)
    row["round_ratios"] = pair_ratios
    row["identical_requests"] = f"{identical}/{args.in_flight * len(mixes)}"
    results["in_flight"] = {str(args.in_flight): row}
    print(json.dumps(results["in_flight"]), file=sys.stderr, flush=True)
    a, b, c = engines["ngram"].speculator.cost.params if engines["ngram"].speculator else (0.0, 0.0, 0.0)
    report = {
        "date": datetime.date.today().isoformat(),
        "model": path.name,
        "dtype": str(next(engines["plain"].runner.model.parameters()).dtype).removeprefix("torch."),
        "command": "python " + " ".join(sys.argv),
        "seed": seed,
        "max_new_tokens": args.max_new_tokens,
        "draft_tokens": args.draft_tokens,
        "ngram": [EngineConfig.speculative_ngram_min, EngineConfig.speculative_ngram_max],
        "step_cost_fit": {
            "a_ms": round(a * 1e3, 2),
            "b_ms_per_token": round(b * 1e3, 3),
            "c_ms_per_verify": round(c * 1e3, 3),
        },
        **results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
