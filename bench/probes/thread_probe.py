"""Does the engine run slower when driven the way a worker drives it? The same cold work
(the mixed workload, all in flight, greedy) through the same engine, each way in a process
of its own (OpenMP thread pools outlive the runs that made them), ways alternating:

* ``main``: built and stepped (``Engine.step``) on the main thread: the offline figure's loop;
* ``split``: built on the main thread; an asyncio loop schedules and postprocesses, one
  executor thread runs ``launch`` and ``collect``: how workers ran before 2026-12-02;
* ``engine_thread``: the same loop, the engine built in the executor thread that steps it:
  what ``pdserve prefill|decode|unified`` do now;
* ``loop_thread``: built and stepped on the main thread, the asyncio loop in another thread.

Each prints output tok/s, seconds in forward passes and the process's thread count. On a
CPU a thread that runs a parallel torch operation gets its own OpenMP pool; with two pools
libgomp counts more threads than cores and no longer lets idle ones spin between
operations, which ``split`` shows.

    python bench/probes/thread_probe.py --repeat 2 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_bench import Request, run_pdserve, workload

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import build_engine
from pdserve.engine.tiny_model import ensure_default_model
from pdserve.schemas import SamplingParams

WAYS = ("main", "split", "engine_thread", "loop_thread")


class CallerThread(concurrent.futures.Executor):
    """Runs what is submitted on the thread that calls :meth:`serve`, until :meth:`stop`."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None]
        self._calls = queue.SimpleQueue()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((future, lambda: fn(*args, **kwargs)))
        return future

    def stop(self) -> None:
        self._calls.put(None)

    def serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn = call
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)


def build(model: Path) -> Engine:
    engine = build_engine(model, EngineConfig(max_total_tokens=300_000, max_num_seqs=256))
    run_pdserve(engine, workload(2, 99, 4000, 16, 64, 4, 8), 2)
    return engine


async def on_loop(engine: Engine, reqs: list[Request], steps_in: concurrent.futures.Executor) -> float:
    """The worker's loop: schedule and postprocess here, the forward pass in ``steps_in``."""
    loop = asyncio.get_running_loop()
    for i, r in enumerate(reqs):
        engine.add_request(
            f"p{i}", r.prompt, SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        )
    started = time.perf_counter()
    while engine.has_work():
        batch = engine.schedule()
        launched = await loop.run_in_executor(steps_in, engine.launch, batch)
        result = await loop.run_in_executor(steps_in, engine.collect, launched)
        engine.complete(launched, result)
    return time.perf_counter() - started


def one_way(way: str, seed: int, requests: int) -> dict[str, Any]:
    reqs = workload(requests, seed, 4000, 16, 1024, 16, 256)
    directory = Path(tempfile.mkdtemp(prefix="pdserve-probe-"))
    if way == "engine_thread":  # the model is made there too: no torch work on the main thread
        pool = concurrent.futures.ThreadPoolExecutor(1)
        engine = pool.submit(lambda: build(ensure_default_model(directory))).result()
    else:
        engine = build(ensure_default_model(directory))
    busy = engine.stats.busy_seconds
    if way == "main":
        seconds = run_pdserve(engine, reqs, len(reqs))
    elif way == "loop_thread":
        here, out = CallerThread(), []
        loop = threading.Thread(target=lambda: (out.append(asyncio.run(on_loop(engine, reqs, here))), here.stop()))
        loop.start()
        here.serve()
        loop.join()
        seconds = out[0]
    else:
        seconds = asyncio.run(
            on_loop(engine, reqs, concurrent.futures.ThreadPoolExecutor(1) if way == "split" else pool)
        )
    return {
        "way": way,
        "out_tok_s": round(sum(r.output_len for r in reqs) / seconds, 1),
        "forward_seconds": round(engine.stats.busy_seconds - busy, 3),
        "threads": len(os.listdir("/proc/self/task")),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=500, help="each round's work is drawn with the next seed")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this way once, print its JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_way(args.one, args.seed, args.requests)))
        return 0
    runs = []
    for rep in range(args.repeat):
        for way in args.ways.split(","):
            cmd = [
                sys.executable,
                __file__,
                "--one",
                way,
                "--seed",
                str(args.seed + rep),
                "--requests",
                str(args.requests),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900).stdout
            runs.append({"round": rep, **json.loads(out.strip().splitlines()[-1])})
            print(json.dumps(runs[-1]), file=sys.stderr)
    env = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS") if k in os.environ}
    result = {
        "command": "python bench/probes/thread_probe.py " + " ".join(sys.argv[1:]),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "env": env,
        "runs": runs,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
