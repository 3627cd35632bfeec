"""The engine thread's time in the KV tiers' calls of a chat whose disk the rule declines.

Four users take turns on the built-in tiny model (a 512-token opening, 16 new tokens a turn,
4 answered), an engine with a disk tier and a device pool of 1.5 contexts; after two rounds
the disk is priced too slow to pay (as a 7B model's 512-token turns price it on an H100), and
the later rounds time, per turn, each call the engine's thread makes into the tiers: the
lookup (``find``, the rule's gate ``_cannot_pay`` inside it), the decision (``worth_loading``),
the offers of computed pages to the writer (``offer``), and the rule's fit (``_fit``). Run
twice in one process: as the engine runs (the fit made as a step launches,
``CostEstimates.refresh``), and with that refresh off (the fit made where an estimate is next
read: in the next request's lookup, before its step, as before ``619b01a``).

    python bench/probes/tier_rule_host.py [--rounds 6] [--out docs/data/tier_rule_host_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.engine.config import EngineConfig, KVTierConfig  # noqa: E402
from pdserve.engine.loader import build_engine  # noqa: E402
from pdserve.engine.tiny_model import ensure_default_model  # noqa: E402
from pdserve.schemas import SamplingParams  # noqa: E402

CALLS = ("find", "_cannot_pay", "worth_loading", "offer")


def timed(obj: Any, name: str, into: dict[str, float]) -> None:
    """Wrap ``obj.name`` to add each call's seconds to ``into[name]``."""
    f = getattr(obj, name)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            into[name] = into.get(name, 0.0) + time.perf_counter() - began

    setattr(obj, name, wrapper)


def chat(model: Path, rounds: int, refresh: bool, seed: int) -> dict[str, Any]:
    """Microseconds a turn of each call, over the rounds after the first two."""
    work = Path(tempfile.mkdtemp(prefix="tier-rule-host-"))
    config = EngineConfig(max_total_tokens=768, kv_tiers=KVTierConfig(disk_dir=str(work / "disk")))
    engine = build_engine(model, config)
    tiers = engine.tiers
    assert tiers is not None
    spent: dict[str, float] = {}
    for name in CALLS:
        timed(tiers, name, spent)
    timed(tiers.estimates, "_fit", spent)
    if not refresh:
        tiers.estimates.refresh = lambda: None  # type: ignore[method-assign]
    rng = random.Random(seed)
    users = [[rng.randrange(10, 900) for _ in range(512)] for _ in range(4)]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    turns = 0
    ttfts: list[float] = []
    for turn in range(rounds):
        if turn == 2:  # the rule has its readings: the disk priced too slow, the timing starts
            tiers.estimates.bytes_per_s["disk"] = 1e6
            spent.clear()
        for u, context in enumerate(users):
            context += [rng.randrange(10, 900) for _ in range(16)]
            began = time.perf_counter()
            first = None
            engine.add_request(f"u{u}t{turn}", context, params)
            answer: list[int] = []
            while engine.has_work():
                for out in engine.step():
                    if first is None:
                        first = time.perf_counter() - began
                    answer += out.token_ids
            context += answer
            if turn >= 2:
                turns += 1
                ttfts.append(first or 0.0)
    disk = tiers.stats.tiers["disk"]
    engine.close()
    return {
        "us_a_turn": {name: round(spent.get(name, 0.0) / turns * 1e6, 1) for name in (*CALLS, "_fit")},
        "turns_timed": turns,
        "ttft_ms_median": round(statistics.median(ttfts) * 1e3, 2),
        "disk": {
            "hit_pages": disk.hit_pages,
            "declined_pages": disk.declined_pages,
            "skipped_lookups": disk.skipped_lookups,
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=4, help="runs of each, in alternating order")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from common import git_commit

    model = ensure_default_model(Path(tempfile.gettempdir()) / "pdserve-bench-data")
    seed = random.randrange(1 << 30)
    runs: dict[str, list[dict[str, Any]]] = {"fit_at_launch": [], "fit_in_lookup": []}
    for i in range(args.repeats):
        for name in list(runs) if i % 2 == 0 else reversed(list(runs)):  # the order alternating
            runs[name].append(chat(model, args.rounds, name == "fit_at_launch", seed + i))
            print(name, json.dumps(runs[name][-1]), flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python bench/probes/tier_rule_host.py", *sys.argv[1:]]),
        "seed": seed,
        "code_commit": git_commit(),
        "runs": runs,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
