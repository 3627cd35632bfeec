"""What structured output costs: output tokens per second with a JSON-schema constraint
against none, 64 requests at once, in one run of one system.

One `pdserve up` (cold: a fresh data directory, started by this script), the built-in tiny
model unless ``--model-path``. Rounds come in pairs, schema then none: each pair shares
the machine's mood. Every round sends ``--concurrency`` requests at once through
``/generate`` with fresh random prompts (its own seed) and flushes every worker's prefix
cache first (``/flush_cache``), so no cache helps either side. A constrained request ends
when its grammar does; an unconstrained one (``ignore_eos``) runs as long as its
constrained twin in the pair did, so both sides do the same work
(``--no-same-lengths``: to ``--max-new-tokens``, which charges the constrained side for
its spread of lengths and for spreading each round's fixed costs over fewer tokens).
The figure is the median over pairs of schema/none output tokens per second (goal: within
10%, a ratio of at least 0.9). Every constrained output is checked against the schema.

    python bench/structured_output.py                 # writes docs/data/structured_output_cpu.json
    python bench/structured_output.py --mode pd --out docs/data/structured_output_pd_cpu.json

``--profile PATH``: py-spy's stacks of the server's processes (raw format) over the first
measured constrained round's first seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import py_spy, start_pdserve, stop_pdserve

from pdserve.engine.tiny_model import ensure_default_model

# Tens of tokens of output whatever the model wants: 15 words from a closed set.
SCHEMA = {
    "type": "object",
    "properties": {
        "words": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 15, "maxItems": 15}
    },
    "required": ["words"],
    "additionalProperties": False,
}


async def one_round(
    url: str, constrained: bool, seed: int, args: argparse.Namespace, lengths: list[int] | None = None
) -> dict[str, Any]:
    """``lengths``: an unconstrained round's output length per request (default: all
    ``--max-new-tokens``)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 4000) for _ in range(args.prompt_tokens)] for _ in range(args.concurrency)]
    params: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0}
    if constrained:
        params["json_schema"] = json.dumps(SCHEMA)
    else:
        params["ignore_eos"] = True
    wanted = lengths or [args.max_new_tokens] * len(prompts)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        assert (await http.post("/flush_cache")).status_code == 200
        started = time.perf_counter()
        replies = await asyncio.gather(
            *(
                http.post("/generate", json={"input_ids": p, "sampling_params": {**params, "max_new_tokens": n}})
                for p, n in zip(prompts, wanted, strict=True)
            )
        )
        seconds = time.perf_counter() - started
    bodies = [r.json() for r in replies]
    assert all(r.status_code == 200 for r in replies), [b for b in bodies if "error" in b][:1]
    tokens = sum(b["meta_info"]["completion_tokens"] for b in bodies)
    valid, invalid = 0, []
    if constrained:
        for b in bodies:
            try:
                jsonschema.validate(json.loads(b["text"]), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                invalid.append({"finish_reason": b["meta_info"]["finish_reason"], "text": b["text"]})
    return {
        "constrained": constrained,
        "seconds": round(seconds, 3),
        "output_tokens": tokens,
        "output_tokens_per_second": round(tokens / seconds, 1),
        "cached_tokens": sum(b["meta_info"]["cached_tokens"] for b in bodies),
        "lengths": [b["meta_info"]["completion_tokens"] for b in bodies],
        "valid_json": valid,
        "invalid": invalid[:3],
    }


async def run(url: str, args: argparse.Namespace, server_pid: int) -> list[dict[str, Any]]:
    await one_round(url, True, 999, args)  # warm both paths once (grammar compiled, pages touched)
    await one_round(url, False, 998, args)
    rounds = []
    for pair in range(args.pairs):
        # The constrained round first: its requests' lengths are the unconstrained ones'
        # (same work; without it, the constrained side's spread of lengths and fixed
        # per-round costs over fewer tokens weigh on it, not the constraint).
        spy = py_spy(server_pid, args.profile, args.profile_seconds, rate=1000) if args.profile and pair == 0 else None
        constrained = await one_round(url, True, 2 * pair + 1, args)
        if spy is not None:
            spy.wait(timeout=60)
        lengths = constrained["lengths"] if args.same_lengths else None
        plain = await one_round(url, False, 2 * pair, args, lengths)
        for r in (plain, constrained):
            print(json.dumps({k: v for k, v in r.items() if k != "lengths"}), flush=True)
            rounds.append(r)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="unified", choices=("unified", "pd"))
    parser.add_argument("--model-path", type=Path)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument(
        "--same-lengths",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each unconstrained request as long as its constrained twin (default: on)",
    )
    parser.add_argument("--extra", default="", help="more `pdserve up` flags, space-separated")
    parser.add_argument("--out", type=Path, default=Path("docs/data/structured_output_cpu.json"))
    parser.add_argument("--profile", type=Path, help="py-spy stacks of the first constrained round (raw format)")
    parser.add_argument("--profile-seconds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-so-") as tmp:
        model = args.model_path or ensure_default_model(Path(tmp) / "data")
        flags = ["--model-path", str(model), "--enable-flush-cache", *args.extra.split()]
        proc, url = start_pdserve(args.mode, Path(tmp) / "up", flags)
        try:
            rounds = asyncio.run(run(url, args, proc.pid))
        finally:
            stop_pdserve(proc)
    pairs = [(rounds[i], rounds[i + 1]) for i in range(0, len(rounds), 2)]
    ratios = [c["output_tokens_per_second"] / n["output_tokens_per_second"] for n, c in pairs]
    result = {
        "what": "output tok/s with a JSON-schema constraint against none, same run, alternating rounds",
        "date": datetime.date.today().isoformat(),
        "command": "python bench/structured_output.py " + " ".join(sys.argv[1:]),
        "mode": args.mode,
        "model": str(args.model_path or "built-in tiny model (random weights)"),
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "same_lengths": args.same_lengths,
        "schema": SCHEMA,
        "rounds": rounds,
        "ratio_per_pair": [round(r, 3) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
        "goal": "median ratio >= 0.9",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"median schema/none output tok/s: {result['median_ratio']} -> {args.out}")


if __name__ == "__main__":
    main()
