"""The host's share of a structured-output step: filling 64 rows' token masks and accepting
their tokens, per step, for ``bench/structured_output.py``'s schema.

Walks 64 matchers through the schema together, each step choosing a random allowed token per
row (what a random-weights model at temperature 1 does), and times the two grammar
operations a constrained decode step makes on the host: the masks (as the engine fills them,
row by row, and with xgrammar's threaded batch fill at several thread counts) and the
accepts (one by one, batched, and spread over a pool of Python threads), and the engine's
own path (``Grammars.masks`` advancing and filling each row, the rows dealt out over 1-8
threads). Writes JSON to ``--out`` if given.

    python bench/probes/grammar_host.py [--rows 64] [--threads 1,2,4,8] [--out grammar_host.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from structured_output import SCHEMA

from pdserve.engine.grammar import Grammars
from pdserve.engine.tiny_model import ensure_default_model
from pdserve.schemas import SamplingParams

VOCAB = 152064  # Qwen2.5's logits width: the masks' width on the GPU bench


def walk(grammars: Grammars, sampling: SamplingParams, rows: int, fill: str, threads: int, seed: int) -> dict[str, Any]:
    import xgrammar as xgr

    matchers = [grammars.matcher(sampling) for _ in range(rows)]
    raw = [m._matcher for m in matchers]
    batch = xgr.BatchGrammarMatcher(threads) if fill == "batch" else None
    pool = ThreadPoolExecutor(threads) if fill == "rows" and threads > 1 else None
    rng = random.Random(seed)
    mask_s: list[float] = []
    accept_s: list[float] = []
    while not all(m.is_terminated() for m in raw):
        for m in matchers:  # the paths below that accept through xgrammar's own objects
            m._terminated = bool(m._matcher.is_terminated())
        t0 = time.perf_counter()
        if batch is None:
            bitmask = grammars.masks(matchers, torch.device("cpu"))
        else:
            bitmask = grammars._xgr.allocate_token_bitmask(rows, grammars.text_vocab)  # the tokenizer's ids
            live = [r for r, m in enumerate(raw) if not m.is_terminated()]
            batch.batch_fill_next_token_bitmask([raw[r] for r in live], bitmask, live)
            bitmask &= grammars._plain
        mask_s.append(time.perf_counter() - t0)
        words = bitmask.numpy().view(np.uint8)
        tokens = [int(rng.choice(np.flatnonzero(np.unpackbits(words[r], bitorder="little")))) for r in range(rows)]
        t0 = time.perf_counter()
        if pool is not None:  # accepts spread over Python threads (worth it only if xgrammar lets go of the GIL)
            live = [r for r, m in enumerate(raw) if not m.is_terminated()]
            list(pool.map(lambda m, t: m.accept_token(t), [raw[r] for r in live], [tokens[r] for r in live]))
        elif batch is None:
            for m, t in zip(matchers, tokens, strict=True):
                if not m.is_terminated:
                    m.accept(t)
        else:
            live = [r for r, m in enumerate(raw) if not m.is_terminated()]
            xgr.BatchGrammarMatcher.batch_accept_token([raw[r] for r in live], [tokens[r] for r in live])
        accept_s.append(time.perf_counter() - t0)
    if pool is not None:
        pool.shutdown()
    return {
        "fill": fill,
        "accept": "thread pool" if pool is not None else "batch" if batch is not None else "one by one",
        "threads": threads,
        "steps": len(mask_s),
        "masks_ms_per_step": round(statistics.median(mask_s) * 1e3, 3),
        "accepts_ms_per_step": round(statistics.median(accept_s) * 1e3, 3),
    }


def walk_engine(grammars: Grammars, sampling: SamplingParams, rows: int, seed: int) -> dict[str, Any]:
    """What an overlapped constrained step does on the host (``Engine._catch_up`` then
    ``Grammars.masks``): each row's matcher takes the previous step's token and fills its
    mask, the rows dealt out over ``grammars.threads`` threads."""
    matchers = [grammars.matcher(sampling) for _ in range(rows)]
    rng = random.Random(seed)
    spent: list[float] = []
    advance = None
    while not all(m.is_terminated for m in matchers):
        t0 = time.perf_counter()
        bitmask = grammars.masks(matchers, torch.device("cpu"), advance)
        spent.append(time.perf_counter() - t0)
        words = bitmask.numpy().view(np.uint8)
        advance = [
            None
            if m.is_terminated
            else (m.seen, int(rng.choice(np.flatnonzero(np.unpackbits(words[r], bitorder="little")))))
            for r, m in enumerate(matchers)
        ]
    return {
        "fill": "engine",
        "accept": "engine",
        "threads": grammars.threads,
        "steps": len(spent),
        "accepts_and_masks_ms_per_step": round(statistics.median(spent) * 1e3, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", default="1,2,4,8", help="thread counts of the batch fill")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    from transformers import AutoTokenizer

    model = ensure_default_model(Path(tempfile.mkdtemp(prefix="pd-grammar-")))
    tokenizer = AutoTokenizer.from_pretrained(model)
    grammars = Grammars(tokenizer, VOCAB, [tokenizer.eos_token_id], threads=1)
    sampling = SamplingParams(json_schema=json.dumps(SCHEMA), temperature=1.0)
    runs = [walk(grammars, sampling, args.rows, "rows", 1, 0)]
    runs += [walk(grammars, sampling, args.rows, "batch", int(t), 0) for t in args.threads.split(",")]
    runs += [walk(grammars, sampling, args.rows, "rows", int(t), 0) for t in args.threads.split(",") if int(t) > 1]
    for t in args.threads.split(","):  # the engine's own path, at each thread count
        engine_grammars = Grammars(tokenizer, VOCAB, [tokenizer.eos_token_id], threads=int(t))
        runs.append(walk_engine(engine_grammars, sampling, args.rows, 0))
    runs.append(walk(grammars, sampling, args.rows, "rows", 1, 0))  # again: the machine's drift
    for r in runs:
        print(json.dumps(r))
    if args.out:
        result = {
            "date": datetime.date.today().isoformat(),
            "command": "python bench/probes/grammar_host.py " + " ".join(sys.argv[1:]),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
            "rows": args.rows,
            "runs": runs,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
