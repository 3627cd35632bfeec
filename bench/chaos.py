"""Issue 8's reliability table: each failure case against a real `pdserve up` (2 prefill +
2 decode workers, its own nats-server, real Mooncake over tcp), at full size.

    .venv/bin/python bench/chaos.py                     # every case, the built-in model
    .venv/bin/python bench/chaos.py --cases decode-kill,disconnects --json docs/data/chaos.json

Prints one markdown row per case (case, pass, figure measured); exits 1 if any fails.
The cases are in pdserve/bench/chaos_cases.py; tests/integration/test_chaos.py runs them small.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.chaos import CaseResult, ChaosSystem, write_json
from pdserve.bench.chaos_cases import CASES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--model-path", type=Path, help="default: the built-in tiny model (made in the data dir)")
    parser.add_argument("--data-dir", type=Path, help="default: a temporary directory")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        parser.error(f"unknown cases: {', '.join(unknown)}")
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    model = args.model_path
    if model is None:
        from pdserve.engine.tiny_model import ensure_default_model

        model = ensure_default_model(data_dir / "data")
    system = ChaosSystem(data_dir, model).start()
    results: list[CaseResult] = []
    try:
        for name in names:
            system.wait_ready()
            started = time.monotonic()
            result = asyncio.run(CASES[name](system))
            result.details["seconds"] = round(time.monotonic() - started, 1)
            results.append(result)
            print(f"| {result.case} | {'pass' if result.passed else 'FAIL'} | {result.figure} |", flush=True)
    finally:
        system.stop()
    print("\n| case | pass | figure measured |\n| --- | --- | --- |")
    for r in results:
        print(f"| {r.case} | {'pass' if r.passed else 'FAIL'} | {r.figure} |")
    if args.json:
        write_json(
            args.json,
            {
                "machine": platform.node(),
                "python": sys.version.split()[0],
                "command": "bench/chaos.py " + " ".join(sys.argv[1:]),
                "results": [{"case": r.case, "passed": r.passed, "figure": r.figure, **r.details} for r in results],
            },
        )
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
