"""A restarted worker's loads from its disk tier, the first against the later ones, with and
without the start-up warm-up (``KVTiers.warm_up``).

A first process computes ``--prompts`` prompts of ``--prefix`` tokens with a disk tier (writing
their page groups) and exits; then fresh processes, by turns without and with the warm-up
(``--rounds`` each), serve the same prompts with a short new message each, loading every
prefix from the disk (``--kv-tier-load always``: the loads are what is timed, not the rule).
Each load is timed on the engine's thread, the device's copies included (on a GPU the stream
is synchronized after it), and so is the lookup before it (``find``). A process's reading: its
first load, and the median of its later ones.

    python bench/probes/first_load_probe.py [--out docs/data/first_load_probe_cpu.json]
    python3 bench/probes/first_load_probe.py --device cuda --model /tmp/m7b --load-format dummy --prefix 512
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
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pdserve.engine import kv_tiers  # noqa: E402
from pdserve.engine.config import EngineConfig, KVTierConfig  # noqa: E402
from pdserve.engine.loader import build_engine  # noqa: E402
from pdserve.engine.tiny_model import ensure_default_model  # noqa: E402
from pdserve.schemas import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One process: ``write`` computes the prompts, ``cold`` / ``warm`` load them (warm-up
    off / on); the loads' and lookups' milliseconds, in order."""
    kv_tiers.WARM_UP = args.child != "cold"
    config = EngineConfig(
        max_total_tokens=args.pool_tokens,
        device=args.device,
        kv_tiers=KVTierConfig(disk_dir=args.disk, load="always"),
    )
    engine = build_engine(args.model, config, load_format=args.load_format)
    tiers = engine.tiers
    assert tiers is not None
    tiers.drain()
    gpu = args.device == "cuda"
    timed: dict[str, list[float]] = {"find": [], "load": []}

    def clocked(name: str) -> None:
        call = getattr(tiers, name)

        def run(*a: Any, **k: Any) -> Any:
            began = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                if gpu:
                    torch.cuda.synchronize()
                timed[name].append(round((time.perf_counter() - began) * 1e3, 3))

        setattr(tiers, name, run)

    for name in timed:
        clocked(name)
    for i in range(args.prompts):
        prompt = [random.Random(f"{args.seed}-{i}").randrange(3, 4000) for _ in range(args.prefix)]
        if args.child != "write":
            prompt += [7, 8, 9, 10]  # a new message: the prefix's groups are loaded
        engine.add_request(f"p{i}", prompt, GREEDY)
        while engine.has_work():
            engine.step()
        tiers.drain()
    hit = tiers.stats.tiers["disk"].hit_pages
    engine.close()
    return timed | {"hit_pages": hit}


def run_child(args: argparse.Namespace, mode: str, disk: str, seed: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--disk",
        disk,
        "--seed",
        str(seed),
        "--device",
        args.device,
        "--prefix",
        str(args.prefix),
        "--prompts",
        str(args.prompts),
        "--pool-tokens",
        str(args.pool_tokens),
        "--load-format",
        args.load_format,
        *(["--model", str(args.model)] if args.model else []),
    ]
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode} process failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", type=Path, default=None, help="default: the built-in tiny model")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--prefix", type=int, default=512, help="tokens of each prompt's cached prefix")
    p.add_argument("--prompts", type=int, default=6, help="prompts a process serves (its loads)")
    p.add_argument("--pool-tokens", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3, help="restarted processes without and with the warm-up, each")
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one per run")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", choices=("write", "cold", "warm"), help=argparse.SUPPRESS)
    p.add_argument("--disk", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model = args.model or ensure_default_model(Path(tempfile.gettempdir()) / "pdserve-bench-data")
    if args.child:
        print(json.dumps(child(args)))
        return
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "seed": seed,
        "params": {k: str(v) for k, v in vars(args).items() if k not in ("out", "child", "disk")},
        "processes": [],
    }
    with tempfile.TemporaryDirectory() as disk:
        run_child(args, "write", disk, seed)
        for r in range(args.rounds):
            for mode in ("cold", "warm"):
                reading = run_child(args, mode, disk, seed)
                loads = reading["load"]
                reading |= {
                    "warm_up": mode == "warm",
                    "first_load_ms": loads[0] if loads else None,
                    "later_loads_median_ms": statistics.median(loads[1:]) if len(loads) > 1 else None,
                }
                results["processes"].append(reading)
                print(mode, r, "first", reading["first_load_ms"], "later", reading["later_loads_median_ms"], flush=True)
    for warm in (False, True):
        mine = [r for r in results["processes"] if r["warm_up"] is warm]
        results["warm_up" if warm else "no_warm_up"] = {
            "first_load_ms_median": statistics.median(r["first_load_ms"] for r in mine),
            "later_loads_ms_median": statistics.median(r["later_loads_median_ms"] for r in mine),
            "first_find_ms_median": statistics.median(r["find"][0] for r in mine),
            "later_finds_ms_median": statistics.median(statistics.median(r["find"][1:]) for r in mine),
        }
    summary = {k: results[k] for k in ("no_warm_up", "warm_up")}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
