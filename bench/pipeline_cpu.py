"""Where the pipeline's CPU goes, per output token: each process of `pdserve up` (the API,
nats-server, the workers) and the benchmark client, while 64 streams run.

CPU seconds are read from ``/proc`` before and after each run, so the figure is the work
each part does per token, and is far less sensitive to a busy machine than throughput
is. Every run draws fresh prompts (cached prompt tokens are reported). ``--checkout DIR``
runs another source tree's `pdserve up` (e.g. a `git worktree` of an earlier commit) with
this script's client, so commits can be compared on the same machine:

    python bench/pipeline_cpu.py --json /tmp/now.json
    python bench/pipeline_cpu.py --commits 47115e6,8414cf9,HEAD --json docs/data/pipeline_cpu.json

(``--commits``: each commit is checked out in a temporary `git worktree` and measured in
turn, twice over in alternating order, so a busy spell of the machine does not fall on
one commit alone.)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import process_cpu_seconds, start_pdserve, stop_pdserve
from engine_bench import workload
from pipeline_vs_offline import CLIENTS, cpu_per_token, through_http

from pdserve.engine.tiny_model import ensure_default_model


def measure(args: argparse.Namespace, mode: str, model: Path) -> dict:
    data_dir = Path(tempfile.mkdtemp(prefix="pdserve-cpu-"))
    extra = ["--model-path", str(model), *args.up_args.split()]
    proc, url = start_pdserve(mode, data_dir, extra, checkout=args.checkout)
    runs = []
    try:
        asyncio.run(through_http(url, workload(4, 1, 4000, 16, 64, 4, 8), 4, client=args.client))  # warm-up
        for i in range(args.repeat):
            reqs = workload(
                args.requests, args.seed + i, 4000, args.input_len, args.input_len, args.output_len, args.output_len
            )
            tokens = sum(r.output_len for r in reqs)
            before, client = process_cpu_seconds(proc.pid), time.process_time()
            seconds, _, cached, _ = asyncio.run(through_http(url, reqs, args.requests, client=args.client))
            spent = cpu_per_token(proc.pid, before, time.process_time() - client, tokens)
            runs.append({"out_tok_s": tokens / seconds, "cached_tokens": cached, "us_per_token": spent})
            print(
                f"{mode}: {tokens / seconds:,.0f} tok/s; us per token "
                + ", ".join(f"{k} {v:.0f}" for k, v in sorted(spent.items())),
                file=sys.stderr,
                flush=True,
            )
    finally:
        stop_pdserve(proc)
    roles = sorted({role for run in runs for role in run["us_per_token"]})
    median = {role: statistics.median(run["us_per_token"].get(role, 0.0) for run in runs) for role in roles}
    return {"us_per_token_median": median, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--commits", help="comma-separated commits to compare (each in a temporary worktree)")
    parser.add_argument("--modes", default="unified,pd")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--seed", type=int, default=int(time.time()) % 100_000, help="first run's seed (default: fresh)"
    )
    parser.add_argument("--up-args", default="")
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="httpx",
        help="how the streams are read; httpx (the default here) keeps the client column comparable with "
        "docs/performance.md's table, measured with it (default: %(default)s)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = ensure_default_model(Path(tempfile.mkdtemp(prefix="pdserve-cpu-model-")))
    repo = Path(__file__).resolve().parents[1]
    result: dict = {
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(sys.argv),
        "workload": f"{args.requests} requests of {args.input_len} in / {args.output_len} out, all in flight, "
        "fresh prompts per run",
    }
    if not args.commits:
        args.checkout = args.checkout.resolve()
        result["checkout_commit"] = git(args.checkout, "rev-parse", "--short", "HEAD")
        result["modes"] = {mode: measure(args, mode, model) for mode in args.modes.split(",")}
        report(result["checkout_commit"], result["modes"])
    else:
        commits = [git(repo, "rev-parse", "--short", c) for c in args.commits.split(",")]
        trees = {c: Path(tempfile.mkdtemp(prefix=f"pdserve-at-{c}-")) for c in commits}
        try:
            for c, tree in trees.items():
                subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", "--detach", str(tree), c], check=True)
            per: dict[str, dict[str, list[dict]]] = {c: {} for c in commits}
            for order in (commits, commits[::-1]):
                for c in order:
                    args.checkout = trees[c]
                    for mode in args.modes.split(","):
                        per[c].setdefault(mode, []).append(measure(args, mode, model))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)
        result["commits"] = {}
        for c in commits:
            modes = {}
            for mode, rounds in per[c].items():
                runs = [run for r in rounds for run in r["runs"]]
                roles = sorted({role for run in runs for role in run["us_per_token"]})
                median = {role: statistics.median(run["us_per_token"].get(role, 0.0) for run in runs) for role in roles}
                modes[mode] = {"us_per_token_median": median, "runs": runs}
            result["commits"][c] = {"subject": git(repo, "log", "-1", "--format=%s", c)[:120], "modes": modes}
            report(c, modes)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def git(where: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(where), *argv], capture_output=True, text=True, check=True).stdout.strip()


def report(commit: str, modes: dict) -> None:
    for mode, r in modes.items():
        print(f"{commit} {mode}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["us_per_token_median"].items()))


if __name__ == "__main__":
    sys.exit(main())
