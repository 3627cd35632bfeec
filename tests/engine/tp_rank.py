"""One rank of a tensor-parallel engine, for ``tests/engine/test_parallel.py``:
``python -m tests.engine.tp_rank RANK SIZE STORE MODEL OUT [crash] [fast] [spec]``. Rank 0
runs the prompts of ``OUT.prompts.json`` greedily and writes the outputs to ``OUT``; then says
stop, or with ``crash`` ends at once without a word. The others follow until stopped
(exit 0) or until rank 0 is gone (exit 1). ``fast``: pdserve's own forward pass (its
kernels in Triton's interpreter) on :func:`fast_model` instead of the stock one on MODEL.
``spec``: n-gram speculative decoding on (every rank's config); rank 0 writes its
speculation counts to ``OUT.spec.json``."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__" and "fast" in sys.argv[6:]:
    from pdserve.engine.kernels import use_interpreter

    use_interpreter()

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.loader import build_engine
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.parallel import connect_store, join_group
from pdserve.schemas import SamplingParams
from pdserve.workers.config import WorkerConfig
from pdserve.workers.tensor_parallel import serve_follower

CONFIG = EngineConfig(max_total_tokens=4096, num_threads=1)
# The fast path in the interpreter: small chunks, so prompts are computed in pieces.
FAST_CONFIG = EngineConfig(
    max_total_tokens=1024, num_threads=1, model_impl="pdserve", chunked_prefill_size=16, cuda_graph_max_batch=0
)


def fast_model() -> Any:
    """The fast-path tests' 2-layer Qwen2 (4 heads, 2 KV heads), seeded: the same on every rank."""
    from pdserve.bench import shapes

    return shapes.small_model("qwen2", "cpu")


def main() -> int:
    from pdserve.launch import _exit_now

    rank, size, store, model, out = sys.argv[1:6]
    crash, fast, spec = ("crash" in sys.argv[6:]), ("fast" in sys.argv[6:]), ("spec" in sys.argv[6:])
    tp = join_group(int(rank), int(size), connect_store(store), torch.device("cpu"))
    config = FAST_CONFIG if fast else CONFIG
    if spec:
        config = speculating(config)
    if tp.rank:
        runner = ModelRunner(ModelSpec(Path(model)), config, model=fast_model() if fast else None, tp=tp)
        worker = WorkerConfig(role="unified", model_path=Path(model), model_name="m", nats_url="")
        try:
            serve_follower(worker, runner)
        except RuntimeError:  # rank 0 is gone: ends as pdserve's follower does (launch._exit_now)
            _exit_now(1)
        tp.close()
        return 0
    if fast:
        from pdserve.engine.engine import Engine

        engine = Engine(ModelRunner(ModelSpec(Path(model)), config, model=fast_model(), tp=tp), config)
        assert engine.runner.model_impl == "pdserve"
    else:
        engine = build_engine(Path(model), config, tp=tp)
    outputs = run(engine, json.loads(Path(out + ".prompts.json").read_text()))
    Path(out).write_text(json.dumps(outputs))
    if spec:
        assert engine.speculator is not None, "speculation is on under tensor parallelism"
        stats = engine.speculator.stats
        Path(out + ".spec.json").write_text(json.dumps({"verifies": stats.verifies, "accepted": stats.accepted}))
    if crash:
        os._exit(3)
    engine.runner.stop_followers()
    tp.close()
    return 0


def speculating(config: EngineConfig) -> EngineConfig:
    """``config`` with n-gram drafts of up to 3 tokens, every draft verified (no backoff)."""
    return dataclasses.replace(
        config, speculative_algorithm="ngram", speculative_num_draft_tokens=3, speculative_cost_ratio=0.0
    )


def run(engine: object, cases: list[tuple[list[int], int, int]]) -> dict[str, list[Any]]:
    """Greedy outputs by rid (``i`` or, for a case of ``n`` samples, ``i#s``); a case of one
    sample also scores its prompt (the rows past the last layer then differ from the sampled
    ones on every rank), its log-probabilities under ``i.prompt``."""
    from pdserve.engine.engine import Engine

    assert isinstance(engine, Engine)
    for i, (prompt, new, n) in enumerate(cases):
        scoring = 0 if n == 1 else None
        sampling = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True, n=n, prompt_logprobs=scoring)
        engine.add_request(str(i), prompt, sampling)
    outputs: dict[str, list[Any]] = {}
    while engine.has_work():
        for o in engine.step():
            outputs.setdefault(o.rid, []).extend(o.token_ids)
            if o.prompt_logprobs is not None:
                outputs[f"{o.rid}.prompt"] = list(o.prompt_logprobs.logprobs)
    return outputs


def assert_same(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> None:
    """The same tokens; the same prompt log-probabilities up to the order of the ranks' sums."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key.endswith(".prompt"):
            assert value == pytest.approx(got[key], abs=1e-4), key
        else:
            assert got[key] == value, key


if __name__ == "__main__":
    sys.exit(main())
