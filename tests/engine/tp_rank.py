"""One rank of a tensor-parallel engine, for ``tests/engine/test_parallel.py``:
``python -m tests.engine.tp_rank RANK SIZE STORE MODEL OUT [crash]``. Rank 0 runs the
prompts of ``OUT.prompts.json`` greedily and writes the outputs to ``OUT``; then says stop,
or with ``crash`` ends at once without a word. The others follow until stopped (exit 0)
or until rank 0 is gone (exit 1)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.loader import build_engine
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.parallel import connect_store, join_group
from pdserve.schemas import SamplingParams
from pdserve.workers.config import WorkerConfig
from pdserve.workers.tensor_parallel import serve_follower

CONFIG = EngineConfig(max_total_tokens=4096, num_threads=1)


def main() -> int:
    rank, size, store, model, out = sys.argv[1:6]
    crash = sys.argv[6:] == ["crash"]
    tp = join_group(int(rank), int(size), connect_store(store), torch.device("cpu"))
    if tp.rank:
        runner = ModelRunner(ModelSpec(Path(model)), CONFIG, tp=tp)
        config = WorkerConfig(role="unified", model_path=Path(model), model_name="m", nats_url="")
        try:
            serve_follower(config, runner)
        except RuntimeError:
            return 1
        return 0
    engine = build_engine(Path(model), CONFIG, tp=tp)
    outputs = run(engine, json.loads(Path(out + ".prompts.json").read_text()))
    Path(out).write_text(json.dumps(outputs))
    if crash:
        os._exit(3)
    engine.runner.stop_followers()
    return 0


def run(engine: object, cases: list[tuple[list[int], int, int]]) -> dict[str, list[int]]:
    """Greedy outputs by rid (``i`` or, for a case of ``n`` samples, ``i#s``)."""
    from pdserve.engine.engine import Engine

    assert isinstance(engine, Engine)
    for i, (prompt, new, n) in enumerate(cases):
        engine.add_request(str(i), prompt, SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True, n=n))
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            outputs.setdefault(o.rid, []).extend(o.token_ids)
    return outputs


if __name__ == "__main__":
    sys.exit(main())
