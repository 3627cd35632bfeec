"""A prompt's prefill after a prefix (cached, or its own earlier chunks), the chunks after the
prefix through the paged prefill kernel against flash attention over their gathered pages
(``LlamaFamily.prefixed_sdpa_rows``: 0 never, 1 every such chunk, the default from
:data:`pdserve.engine.models.llama.PREFIXED_SDPA_ROWS` rows).

Two kinds of prompt, each timed to its first token (one engine, the default chunk of 2,048
tokens, fresh random tokens at every repeat so nothing but the intended prefix is cached, the
three settings by turns): a prompt of ``--prefix`` tokens served first and then the same
tokens followed by ``--rows`` new ones (the second timed; its cached tokens reported), and
fresh prompts of ``--lengths`` tokens (past 2,048 their later chunks come after a prefix).

    python3 bench/probes/prefixed_probe.py --device cuda --model /tmp/m7b --load-format dummy \\
        --out docs/data/prefixed_probe_gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.loader import build_engine  # noqa: E402
from pdserve.engine.models import llama  # noqa: E402
from pdserve.engine.tiny_model import ensure_default_model  # noqa: E402
from pdserve.schemas import SamplingParams  # noqa: E402

ONE = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


def ttft(engine: Engine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the prompt's first token, and its cached tokens."""
    began = time.perf_counter()
    engine.add_request(rid, prompt, ONE)
    seconds, cached = 0.0, 0
    while engine.has_work():
        for out in engine.step():
            if out.rid == rid and out.token_ids and not seconds:
                seconds, cached = time.perf_counter() - began, out.cached_tokens
    return seconds, cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", type=Path, default=None, help="default: the built-in tiny model")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--prefix", default="128 2048", help="cached prefixes' tokens")
    p.add_argument("--rows", default="64 128 256 512 1024 1920", help="new tokens after a cached prefix")
    p.add_argument("--lengths", default="2048 4096 8192", help="fresh prompts' tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one per run")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    model = args.model or ensure_default_model(Path("/tmp/pdserve-bench-data"))
    prefixes = [int(x) for x in args.prefix.split()]
    rows = [int(x) for x in args.rows.split()]
    lengths = [int(x) for x in args.lengths.split()]
    longest = max([a + b for a in prefixes for b in rows] + lengths)
    engine = build_engine(
        model, EngineConfig(max_total_tokens=4 * longest, device=args.device), load_format=args.load_format
    )
    fast = engine.runner.fast
    if not isinstance(fast, llama.LlamaFamily):
        raise SystemExit("this probe times pdserve's GPU pass (LlamaFamily): run it with --device cuda")
    vocab = min(30000, engine.runner.vocab_size)
    settings = {"paged": 0, "gathered": 1, "default": llama.PREFIXED_SDPA_ROWS}
    count = 0

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    def cached_case(prefix: int, new: int, setting: str) -> tuple[float, int]:
        nonlocal count
        count += 1
        fast.prefixed_sdpa_rows = settings[setting]
        head = tokens(prefix)
        ttft(engine, f"p{count}", head)
        return ttft(engine, f"q{count}", head + tokens(new))

    def fresh_case(length: int, setting: str) -> tuple[float, int]:
        nonlocal count
        count += 1
        fast.prefixed_sdpa_rows = settings[setting]
        return ttft(engine, f"f{count}", tokens(length))

    for setting in settings:  # every shape once before the clock (the kernels' first launches)
        for prefix in prefixes:
            for new in rows:
                cached_case(prefix, new, setting)
        for length in lengths:
            fresh_case(length, setting)
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "seed": seed,
        "model": model.name,
        "device": args.device,
        "default_prefixed_sdpa_rows": llama.PREFIXED_SDPA_ROWS,
        "cached": [],
        "fresh": [],
    }
    for prefix in prefixes:
        for new in rows:
            times: dict[str, list[float]] = {s: [] for s in settings}
            cached: set[int] = set()
            for _ in range(args.repeats):
                for setting in settings:
                    seconds, hit = cached_case(prefix, new, setting)
                    times[setting].append(seconds * 1000)
                    cached.add(hit)
            row = {"prefix": prefix, "rows": new, "cached_tokens": sorted(cached)}
            row.update({f"{s}_ms": round(statistics.median(t), 2) for s, t in times.items()})
            row["gathered_vs_paged"] = round(row["gathered_ms"] / row["paged_ms"], 3)
            results["cached"].append(row)
            print(json.dumps(row), flush=True)
    for length in lengths:
        times = {s: [] for s in settings}
        cached = set()
        for _ in range(args.repeats):
            for setting in settings:
                seconds, hit = fresh_case(length, setting)
                times[setting].append(seconds * 1000)
                cached.add(hit)
        row = {"length": length, "cached_tokens": sorted(cached)}
        row.update({f"{s}_ms": round(statistics.median(t), 2) for s, t in times.items()})
        row["gathered_vs_paged"] = round(row["gathered_ms"] / row["paged_ms"], 3)
        results["fresh"].append(row)
        print(json.dumps(row), flush=True)
    engine.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
