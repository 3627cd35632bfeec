"""What placement buys: the same seeded workload against `pdserve up --mode pd` with a
placement flag on and off, one run each, in one invocation.

``mixed``: short prompts (``--short-len`` ± 30 %, at most 125 tokens) and long ones
(``--long-len`` ± 30 %) under load, with SLOs: the short prompts' mean TTFT with
``--conditional-disagg`` against always disaggregated (goal: at least 30 % lower), and the
goodput of all (goal: no loss). ``short``: short prompts alone; ``crossover``: always local
against always disaggregated over prompt lengths, for the default
``--local-prefill-max-tokens`` (neither run by default).
``prefix``: shared-prefix multi-tenant chat on 2 prefill workers; prefix-cache hit rate and
P90 TTFT with ``--prefix-aware-placement`` against ``off`` (goal: hit rate >= 90 %, P90 TTFT
>= 3x lower). ``unique``: what the default (``auto``) costs where it cannot help: one prefill
worker, unique prompts, the default against ``--prefix-aware-placement off`` (goal: no loss
within noise).

Both systems run at once, each with a fresh data directory (its own broker), and are
measured in turn: ``--rounds`` pairs, alternating which side goes first, each round with its
own seed (drawn once per invocation, recorded, + the round) shared by both sides, so every
request meets a cold prefix cache and each pair the same machine mood (the machine is
shared with other builds). Figures are the medians of the pairs' ratios. The
built-in tiny model unless ``--model-path``. Requests go to ``/generate`` as token ids
(exact lengths), through ``pdserve bench``; the placement decisions come from the API's
``/metrics``.

    python bench/placement.py                     # every case, writes docs/data/placement.json
    python bench/placement.py --cases short mixed
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
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import git_commit, start_pdserve, stop_pdserve

from pdserve.engine.tiny_model import ensure_default_model

ROOT = Path(__file__).resolve().parents[1]
CASES = ("short", "mixed", "prefix", "unique", "crossover")
DEFAULT_CASES = ("mixed", "prefix", "unique")


WORKER_TOTALS = {
    "pdserve_local_prefills": "local_prefills",
    "pdserve_kv_pulls": "kv_pulls",
    "pdserve_recomputes": "recomputes",
    "pdserve_prompt_tokens": "prompt_tokens",
    "pdserve_prefix_cache_hit_tokens": "cached_tokens",
}


def read_metrics(url: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The API's placement decisions by path, and the workers' totals that tell the paths
    apart, summed by role (from ``/metrics``)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    decisions: dict[str, float] = {}
    roles: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if family.name == "pdserve_placement_decisions":
                decisions[sample.labels["path"]] = sample.value
            elif family.name in WORKER_TOTALS:
                mine = roles.setdefault(sample.labels.get("role", "?"), {})
                key = WORKER_TOTALS[family.name]
                mine[key] = mine.get(key, 0.0) + sample.value
    return decisions, roles


def bench(url: str, model_dir: Path, out: Path, seed: int, args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pdserve", "bench", "--base-url", url, "--backend", "generate"]
    cmd += ["--tokenizer", str(model_dir), "--seed", str(seed), "--output-json", str(out), "--quiet", *args]
    cmd += ["--request-timeout", "180"]  # a wedged system fails its round instead of waiting 10 minutes
    subprocess.run(cmd, check=True, cwd=ROOT)
    result = json.loads(out.read_text())
    points = result.get("points") or result.get("runs") or [result]
    point = points[0]
    metrics = dict(point.get("metrics", point))
    metrics["requests"] = point.get("requests", [])
    return metrics


def measure(url: str, model_dir: Path, seed: int, bench_args: list[str], out: Path) -> dict[str, Any]:
    """One round against a running system, every worker's prefix cache flushed first; the
    workers' totals are read before and after."""
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    before, roles_before = read_metrics(url)
    metrics = bench(url, model_dir, out, seed, bench_args)
    after, roles_after = read_metrics(url)
    metrics["placement_decisions"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
    metrics["workers"] = {
        role: {k: v - roles_before.get(role, {}).get(k, 0.0) for k, v in totals.items()}
        for role, totals in roles_after.items()
    }
    return metrics


def summary(m: dict[str, Any]) -> dict[str, Any]:
    keep = ("completed", "failed", "request_throughput", "output_throughput", "goodput", "goodput_fraction")
    out = {k: m[k] for k in keep if k in m}
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        if isinstance(m.get(name), dict):
            out[name] = {k: m[name][k] for k in ("mean", "p50", "p90", "p99") if k in m[name]}
    for key in ("total_input_tokens", "total_cached_tokens", "prefix_cache_hit_rate", "placement_decisions", "workers"):
        if key in m:
            out[key] = m[key]
    return out


def short_ttft(requests: list[dict[str, Any]], limit: int = 128) -> dict[str, float]:
    """Mean and P90 TTFT (ms) of the completed requests of at most ``limit`` prompt tokens."""
    ttfts = sorted(r["ttft"] * 1000 for r in requests if r["ok"] and r["prompt_tokens"] <= limit)
    if not ttfts:
        return {"count": 0}
    p90 = ttfts[min(len(ttfts) - 1, round(0.9 * (len(ttfts) - 1)))]
    return {"count": len(ttfts), "mean": sum(ttfts) / len(ttfts), "p90": p90}


def run_case(case: str, model_dir: Path, seed: int, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Both systems up at once (idle while the other is measured); rounds alternate which
    goes first, each round a fresh seed shared by both sides, so each pair meets the same
    machine and the same cold workload."""
    load = ["--num-prompts", str(a.num_prompts), "--request-rate", str(a.rate), "--warmup", "0", "--save-requests"]
    out = ["--output-len", str(a.output_len)]
    if case == "short":
        bench_args = [*load, "--dataset", "random", "--input-len", str(a.short_len), "--range-ratio", "0.3", *out]
        flag, up = "--conditional-disagg", []
    elif case == "mixed":
        bench_args = [*load, "--dataset", "random", "--input-len", str(a.long_len), "--range-ratio", "0.3", *out]
        bench_args += ["--short-fraction", str(a.short_fraction), "--short-len", str(a.short_len)]
        bench_args += ["--slo-ttft", str(a.slo_ttft), "--slo-itl", str(a.slo_itl)]
        flag, up = "--conditional-disagg", []
    elif case == "unique":  # the default where placement cannot help: is it free?
        bench_args = [*load, "--dataset", "random", "--input-len", str(a.long_len), "--range-ratio", "0.3", *out]
        flag, up = "", []
    else:
        bench_args = [*load, "--dataset", "prefix-chat", "--num-groups", str(a.groups), "--prefix-len"]
        bench_args += [str(a.prefix_len), "--num-turns", "2", "--turn-len", str(a.turn_len), *out]
        flag, up = "--prefix-aware-placement", ["--prefill-workers", "2", "--max-total-tokens", str(a.pool_tokens)]
    common = ["--model-path", str(model_dir), "--enable-flush-cache", *up]
    sides: dict[str, list[str]] = {"off": [], "on": [flag]}  # conditional disaggregation: without, with
    if case in ("prefix", "unique"):  # prefix-aware placement: off, and on (prefix) or the default (unique)
        sides = {"off": ["--prefix-aware-placement", "off"], "on": [flag] if flag else []}
    systems: dict[str, tuple[Any, str]] = {}
    rounds: list[dict[str, Any]] = []
    try:
        for side, extra in sides.items():
            systems[side] = start_pdserve("pd", work / f"{case}-{side}", [*common, *extra])
        for r in range(a.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            pair: dict[str, Any] = {"seed": seed + r}
            for side in order:
                m = measure(systems[side][1], model_dir, seed + r, bench_args, work / f"{case}-{side}-{r}.json")
                pair[side] = summary(m)
                if case in ("short", "mixed"):
                    pair[side]["short_prompts_ttft_ms"] = short_ttft(m["requests"])
            rounds.append(pair)
            print(case, r, json.dumps(ratios(pair)), flush=True)
    finally:
        for proc, _ in systems.values():
            stop_pdserve(proc)
    result: dict[str, Any] = {"flag": flag, "up_flags": up, "bench_args": bench_args, "rounds": rounds}
    each = [ratios(p) for p in rounds]
    result["median"] = {k: statistics.median(e[k] for e in each) for k in each[0]}
    return result


def run_crossover(model_dir: Path, seed: int, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Where local prefill stops paying: prompts of each length in ``--crossover-lens``,
    always disaggregated against always local (``--local-prefill-max-tokens`` above any
    prompt), at ``--rate``; the mean TTFT and TPOT of each. The default limit is the
    longest length at which local prefill gives a lower mean TTFT without a TPOT more than
    25 % higher."""
    flags = ["--conditional-disagg", "--local-prefill-max-tokens", "100000"]
    flags += ["--local-prefill-max-tokens-busy", "100000"]
    common = ["--model-path", str(model_dir), "--enable-flush-cache"]
    systems: dict[str, tuple[Any, str]] = {}
    points = []
    try:
        for side, extra in (("off", []), ("on", flags)):
            systems[side] = start_pdserve("pd", work / f"crossover-{side}", [*common, *extra])
        for i, length in enumerate(a.crossover_lens):
            args = ["--num-prompts", str(a.crossover_prompts), "--request-rate", str(a.rate), "--dataset", "random"]
            args += ["--input-len", str(length), "--range-ratio", "0.1", "--output-len", str(a.output_len)]
            point: dict[str, Any] = {"input_len": length}
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                m = measure(systems[side][1], model_dir, seed + i, args, work / f"crossover-{side}-{length}.json")
                point[side] = {"ttft_mean_ms": m["ttft_ms"]["mean"], "tpot_mean_ms": m["tpot_ms"]["mean"]}
                point[side]["placement_decisions"] = m["placement_decisions"]
            point["ttft_ratio"] = point["on"]["ttft_mean_ms"] / point["off"]["ttft_mean_ms"]
            point["tpot_ratio"] = point["on"]["tpot_mean_ms"] / point["off"]["tpot_mean_ms"]
            print("crossover", length, round(point["ttft_ratio"], 3), round(point["tpot_ratio"], 3), flush=True)
            points.append(point)
    finally:
        for proc, _ in systems.values():
            stop_pdserve(proc)
    good = [p["input_len"] for p in points if p["ttft_ratio"] < 1.0 and p["tpot_ratio"] <= 1.25]
    return {"points": points, "suggested_local_prefill_max_tokens": max(good, default=0)}


def ratios(pair: dict[str, Any]) -> dict[str, float]:
    """On against off in one round."""
    on, off = pair["on"], pair["off"]
    out = {
        "ttft_mean_ratio": on["ttft_ms"]["mean"] / off["ttft_ms"]["mean"],
        "ttft_p90_speedup": off["ttft_ms"]["p90"] / on["ttft_ms"]["p90"],
        "tpot_mean_ratio": on["tpot_ms"]["mean"] / off["tpot_ms"]["mean"],
    }
    if "short_prompts_ttft_ms" in on and on["short_prompts_ttft_ms"].get("count"):
        out["short_ttft_mean_ratio"] = on["short_prompts_ttft_ms"]["mean"] / off["short_prompts_ttft_ms"]["mean"]
    if "goodput" in on:
        out["goodput_ratio"] = on["goodput"] / max(off["goodput"], 1e-9)
    if on.get("output_throughput") and off.get("output_throughput"):
        out["output_throughput_ratio"] = on["output_throughput"] / off["output_throughput"]
    for side, m in (("on", on), ("off", off)):
        prefill = m.get("workers", {}).get("prefill", {})
        if prefill.get("prompt_tokens"):
            # The prefill workers' own hits: in PD a response's usage.cached_tokens counts the
            # decode worker's (the pages it did not pull), not the prefill worker's.
            out[f"prefill_hit_rate_{side}"] = prefill.get("cached_tokens", 0.0) / prefill["prompt_tokens"]
    return out


def recompute(data: dict[str, Any]) -> None:
    """The medians of every case's rounds again (after a change to :func:`ratios`)."""
    for result in data.values():
        if isinstance(result, dict) and result.get("rounds"):
            each = [ratios(p) for p in result["rounds"]]
            result["median"] = {k: statistics.median(e[k] for e in each) for k in each[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(DEFAULT_CASES))
    p.add_argument("--model-path", type=Path, help="default: the built-in tiny model")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rate", type=float, default=1.5, help="requests/s, Poisson arrivals")
    p.add_argument("--short-len", type=int, default=96, help="short prompts: mean tokens (±30 %%, so <= 125)")
    p.add_argument("--long-len", type=int, default=1024, help="mixed: the long prompts' mean tokens (±30 %%)")
    p.add_argument("--short-fraction", type=float, default=0.5, help="mixed: share of short prompts")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slo-ttft", type=float, default=1000.0, help="mixed: TTFT SLO in ms")
    p.add_argument("--slo-itl", type=float, default=100.0, help="mixed: TPOT SLO in ms")
    p.add_argument("--groups", type=int, default=4, help="prefix: tenants, each with its own system prompt")
    p.add_argument("--prefix-len", type=int, default=2048, help="prefix: tokens of each system prompt")
    p.add_argument("--turn-len", type=int, default=32, help="prefix: tokens of each user turn")
    p.add_argument(
        "--pool-tokens",
        type=int,
        default=6144,
        help="prefix: each worker's KV pool (--max-total-tokens): fewer than all the groups' prefixes, "
        "more than half of them",
    )
    p.add_argument("--crossover-lens", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256, 512, 1024])
    p.add_argument("--crossover-prompts", type=int, default=24, help="crossover: prompts per length and side")
    p.add_argument("--rounds", type=int, default=3, help="pairs of runs (off and on, alternating first)")
    p.add_argument("--seed", type=int, help="the workload's seed (default: a fresh one, recorded)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "data" / "placement.json")
    p.add_argument("--recompute", action="store_true", help="only recompute the medians of --out from its rounds")
    a = p.parse_args()
    if a.recompute:
        data = json.loads(a.out.read_text())
        recompute(data)
        a.out.write_text(json.dumps(data, indent=2) + "\n")
        return
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    commit = git_commit()  # the code the systems start with
    with tempfile.TemporaryDirectory(prefix="pd-placement-") as tmp:
        work = Path(tmp)
        model_dir = a.model_path or ensure_default_model(work / "model")
        data = json.loads(a.out.read_text()) if a.out.exists() else {}
        for case in a.cases:
            if case == "crossover":
                result = run_crossover(model_dir, seed, work, a)
            else:
                result = run_case(case, model_dir, seed, work, a)
            result.update(
                seed=seed,
                commit=commit,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                machine=f"{os.cpu_count()} CPUs, shared with other builds",
                command=" ".join(["python", "bench/placement.py", *sys.argv[1:]]),
            )
            data[case] = result
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(data, indent=2) + "\n")
            print(case, "median", json.dumps(result.get("median", result.get("suggested_local_prefill_max_tokens"))))


if __name__ == "__main__":
    main()
