"""One decode step of pdserve's CPU pass alone (``ModelRunner.execute``), A/B between engine
configurations that share one model's weights, interleaved round by round (``fast.NAME=VALUE``
sets an attribute of the CPU pass, for A/B of a code path).

    python bench/probes/cpu_decode_step.py --batch 16 --input-len 256,320 \
        "" fast.blocks=0 [--profile]

Each configuration's engine takes the same ``--batch`` random prompts, prefills them, and
then one of its all-decode steps is run ``--steps`` times a round (the same step again: it
writes the same slots, so the context does not grow); medians (min-max) of the rounds'
median step in ms, and the fastest step of all; a round during which other processes took more than a
tenth of a core is run again (``--tries``). ``--profile``: torch.profiler's per-op table of one round per configuration.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.default_model import ensure_default_model
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import build_engine, quiet_transformers
from pdserve.engine.sequence import ScheduledBatch
from pdserve.schemas import SamplingParams


def decode_step(engine: Engine, prompts: list[list[int]]) -> ScheduledBatch:
    """The engine's first step that decodes every prompt's sequence (and nothing else)."""
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    for _ in range(1000):
        batch = engine.schedule()
        if len(batch.decodes) == len(prompts) and not batch.prefills and not batch.verifies:
            return batch
        engine.postprocess(batch, engine.execute(batch))
    raise RuntimeError("never an all-decode step")


def busy_seconds() -> float:
    """CPU seconds every process of this machine has run, from ``/proc/stat``."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq + iowait * 0) / os.sysconf("SC_CLK_TCK")


def quiet_steps(run: object, steps: int, tries: int) -> list[float]:
    """``steps`` calls of ``run`` timed (ms); again (up to ``tries`` times) while other processes
    took more than a tenth of a core meanwhile (the shared machine's other work)."""
    assert callable(run)
    for _ in range(tries):
        busy, mine, began = busy_seconds(), time.process_time(), time.perf_counter()
        ms = []
        for _ in range(steps):
            started = time.perf_counter()
            run()
            ms.append((time.perf_counter() - started) * 1e3)
        others = busy_seconds() - busy - (time.process_time() - mine)
        if others < 0.1 * (time.perf_counter() - began):
            break
        time.sleep(1.0)
    return ms


def parse_config(text: str) -> tuple[dict[str, object], dict[str, object]]:
    """``EngineConfig`` knobs and, under ``fast.``, attributes of the CPU pass to set."""
    knobs: dict[str, object] = {}
    attrs: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        parsed = int(value) if value.isdigit() else value
        if key.startswith("fast."):
            attrs[key.removeprefix("fast.")] = parsed
        else:
            knobs[key] = parsed
    return knobs, attrs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (the default model) or a model directory")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", default="256,320", help="min,max prompt tokens")
    parser.add_argument("--configs", nargs="+", default=[""], help="EngineConfig knobs, key=value,key=value")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--steps", type=int, default=10, help="steps a round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--tries", type=int, default=20, help="re-runs of a round that others disturbed")
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: as the engine sets them)")
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-bench")
    parser.add_argument("--json", type=Path, help="append this run's figures to a JSON file (a list of runs)")
    args = parser.parse_args()
    quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = ensure_default_model(args.data_dir) if args.model == "smollm2" else Path(args.model)
    lo, hi = (int(x) for x in args.input_len.split(","))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(rng.randint(lo, hi))] for _ in range(args.batch)]
    tokens = args.batch * (hi + 64) + 1024
    engines: dict[str, Engine] = {}
    steps: dict[str, ScheduledBatch] = {}
    model = None
    for text in args.configs:
        knobs, attrs = parse_config(text)
        config = EngineConfig(max_total_tokens=tokens, model_impl="pdserve", **knobs)  # type: ignore[arg-type]
        engine = build_engine(path, config, dtype=args.dtype, model=model)
        for key, value in attrs.items():
            assert hasattr(engine.runner.fast, key), key
            setattr(engine.runner.fast, key, value)
        model = engine.runner.model
        engines[text] = engine
        steps[text] = decode_step(engine, prompts)
        for _ in range(3):  # warm: buffers, oneDNN's primitives
            engine.runner.execute(steps[text])
    times: dict[str, list[float]] = {text: [] for text in args.configs}  # each round's median step
    fastest: dict[str, float] = dict.fromkeys(args.configs, float("inf"))
    for _ in range(args.rounds):
        for text, engine in engines.items():
            ms = quiet_steps(lambda e=engine, t=text: e.runner.execute(steps[t]), args.steps, args.tries)
            times[text].append(statistics.median(ms))
            fastest[text] = min(fastest[text], *ms)
    for text, ms in times.items():
        print(
            f"{text or 'defaults'}: {statistics.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f}), fastest step "
            f"{fastest[text]:.1f} ms, at batch {args.batch}, pool {engines[text].runner.layout.dtype}",
            flush=True,
        )
    if args.json:
        runs = json.loads(args.json.read_text()) if args.json.is_file() else []
        runs.append(
            {
                "date": datetime.date.today().isoformat(),
                "commit": subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
                ).stdout.strip(),
                "command": " ".join(["python", *sys.argv]),
                "batch": args.batch,
                "input_len": args.input_len,
                "configs": {
                    text or "defaults": {
                        "median_ms": statistics.median(ms),
                        "round_medians_ms": ms,
                        "fastest_ms": fastest[text],
                        "pool": str(engines[text].runner.layout.dtype),
                    }
                    for text, ms in times.items()
                },
            }
        )
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for text, engine in engines.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    engine.runner.execute(steps[text])
            print(f"== {text or 'defaults'}: per step, self CPU time")
            for event in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]:
                print(
                    f"  {event.key:45s} {event.self_cpu_time_total / 1e3 / args.steps:7.2f} ms"
                    f" {event.count // args.steps:5d} calls"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
