"""Where an end-to-end run's time goes: the unified worker's step timeline (its
``--log-level DEBUG`` lines, see ``gpu_engine.py --e2e-step-log``) laid over the clients'
start and finish (``client_span`` in the JSON, the same ``perf_counter`` clock).

    python bench/probes/step_timeline.py e2e.log gpu_engine_e2e.json [--out summary.json]

Per pair: time from the clients' start to the worker's first step, the steps (prefill
phase, decode phase), and from the last step to the clients' finish, beside the offline
engine's seconds for the same work.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def steps_of(log: Path) -> list[dict[str, float]]:
    out = []
    for line in log.read_text().splitlines():
        if "pdserve.workers.runtime: step " in line:
            out.append({k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)})
    return out


def summarise(steps: list[dict[str, float]], pair: dict) -> dict[str, float]:
    began, finished = pair["client_span"]
    mine = [s for s in steps if s["launched_at"] >= began - 0.01 and s["done_at"] <= finished + 0.5]
    first, last = mine[0]["launched_at"], mine[-1]["done_at"]
    prefill_end = max(s["done_at"] for s in mine if s["prefill_tokens"])
    # The work's size (older JSON lacks it: estimated from the pipeline's own figure).
    tokens = pair.get("output_tokens") or pair["pipeline_out_tok_s"] * (finished - began)
    return {
        "ratio": round(pair["pipeline_out_tok_s"] / pair["offline_out_tok_s"], 3),
        "client_seconds": round(finished - began, 3),
        "to_first_step": round(first - began, 3),
        "steps": len(mine),
        "steps_seconds": round(last - first, 3),
        "prefill_phase_seconds": round(prefill_end - first, 3),
        "decode_phase_seconds": round(last - prefill_end, 3),
        "after_last_step": round(finished - last, 3),
        "offline_seconds": round(tokens / pair["offline_out_tok_s"], 3),
        "offline_steps": pair.get("offline_steps", 0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path)
    parser.add_argument("result", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    steps = steps_of(args.log)
    result = json.loads(args.result.read_text())
    rows = []
    for n, by in result["e2e_by_api_processes"].items():
        for pair in by["pairs"]:
            row = {"api_processes": int(n), "client_processes": pair.get("client_processes", 1)}
            row.update(summarise(steps, pair))
            rows.append(row)
            print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps({"source": [str(args.log), str(args.result)], "pairs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
