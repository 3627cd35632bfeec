"""Tensor parallelism in the engine, on the CPU over gloo: two real rank processes, the
model split by transformers' plan, the pool by KV heads. Greedy output with 2 ranks equals
1 rank's and ``transformers``' token for token (a request of 2 samples too: its fork's
page copy runs on every rank); a follower whose rank 0 dies ends, loudly."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine.loader import build_engine
from pdserve.engine.parallel import TPError, check_divisible, start_store
from tests.engine.reference import assert_greedy_equal
from tests.engine.tp_rank import CONFIG, assert_same, run

ROOT = Path(__file__).resolve().parents[2]


def cases() -> list[tuple[list[int], int, int]]:
    """(prompt, new tokens, samples): lengths around the 16-token page edges."""
    rng = random.Random(19)
    prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in (5, 16, 17, 40, 70)]
    return [(p, 10, 2 if i == 3 else 1) for i, p in enumerate(prompts)]


def fast_cases() -> list[tuple[list[int], int, int]]:
    """Fewer and shorter for the interpreter (the small model's vocabulary is 300): a prompt
    computed in two chunks, and one of two samples."""
    rng = random.Random(19)
    return [([rng.randrange(3, 300) for _ in range(n)], 4, s) for n, s in ((20, 1), (6, 2))]


def spec_cases() -> list[tuple[list[int], int, int]]:
    """The speculation tests' prompts (repeated text among them), one of 2 samples."""
    from tests.engine.test_speculative import _prompts

    return [(p, 12, 2 if i == 5 else 1) for i, p in enumerate(_prompts(1, 4000))]


def start_ranks(
    model: Path, out: Path, size: int, *extra: str, work: list[tuple[list[int], int, int]] | None = None
) -> list[subprocess.Popen[bytes]]:
    work = work if work is not None else fast_cases() if "fast" in extra else cases()
    out.with_name(out.name + ".prompts.json").write_text(json.dumps(work))
    store, address = start_store("127.0.0.1")
    start_ranks.store = store  # type: ignore[attr-defined]  # the master lives as long as the ranks
    argv = [sys.executable, "-m", "tests.engine.tp_rank"]
    return [
        subprocess.Popen(
            [*argv, str(r), str(size), address, str(model), str(out), *extra],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(size)
    ]


def test_two_ranks_equal_one_and_transformers(mixing_model_dir: Path, tmp_path: Path) -> None:
    """Rank 0 then ends without a word (``crash``): its follower must end too, saying why
    (the clean stop is ``tests/integration/test_tensor_parallel.py``'s)."""
    out = tmp_path / "tp2.json"
    leader, follower = start_ranks(mixing_model_dir, out, 2, "crash")
    one = run(build_engine(mixing_model_dir, CONFIG), cases())
    assert leader.wait(timeout=240) == 3, leader.communicate()[0].decode(errors="replace")
    log = follower.communicate(timeout=60)[0].decode(errors="replace")
    assert follower.returncode == 1, log
    assert "rank 0 of this worker is gone" in log
    two = json.loads(out.read_text())
    assert_same(two, one)
    assert sum(k.endswith(".prompt") for k in two) == 4  # the cases of one sample scored their prompts
    prompts = [p for p, _, _ in cases()]
    ours = [two[str(i)] if n == 1 else two[f"{i}#0"] for i, (_, _, n) in enumerate(cases())]
    assert two["3#0"] == two["3#1"]  # greedy samples agree, each decoded on its own pages
    assert len({tuple(o) for o in ours}) == len(ours) and len(set(ours[0])) > 1  # outputs vary
    model = AutoModelForCausalLM.from_pretrained(mixing_model_dir).eval()
    with torch.inference_mode():
        theirs = [
            model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p, new, _ in cases()
        ]
    assert_greedy_equal(model, prompts, ours, theirs)


def test_rank_0_speculates_and_its_followers_compute_the_verifies(mixing_model_dir: Path, tmp_path: Path) -> None:
    """N-gram speculation under tensor parallelism: rank 0 drafts, accepts and rolls back; the
    follower computes each verify's rows from the step command. Greedy output with 2 ranks
    speculating equals 1 rank's without speculation, and drafts were verified (on this model,
    whose output follows the whole context, one is: a token corrected from the verify's rows)."""
    out = tmp_path / "tp2spec.json"
    work = spec_cases()
    ranks = start_ranks(mixing_model_dir, out, 2, "spec", work=work)
    plain = run(build_engine(mixing_model_dir, CONFIG), work)
    logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(logs)
    assert_same(json.loads(out.read_text()), plain)
    spec = json.loads(out.with_name(out.name + ".spec.json").read_text())
    assert spec["verifies"] > 0, spec


def test_the_fast_path_splits_too(tmp_path: Path) -> None:
    """pdserve's own forward pass (fused projections, its all-reduces inline; the kernels in
    Triton's interpreter) with 2 ranks equals 1 rank's and ``transformers``'."""
    from pdserve.engine.engine import Engine
    from pdserve.engine.model_runner import ModelRunner, ModelSpec
    from tests.engine.tp_rank import FAST_CONFIG, fast_model

    out = tmp_path / "fast.json"
    ranks = start_ranks(Path("qwen2"), out, 2, "fast")
    model = fast_model()
    work = fast_cases()
    prompts = [p for p, _, _ in work]
    with torch.inference_mode():
        theirs = [
            model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p, new, _ in work
        ]
    one = run(Engine(ModelRunner(ModelSpec(Path("qwen2")), FAST_CONFIG, model=model), FAST_CONFIG), work)
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(logs)
    two = json.loads(out.read_text())
    assert_same(two, one)
    ours = [two[str(i)] if n == 1 else two[f"{i}#0"] for i, (_, _, n) in enumerate(work)]
    assert two["1#0"] == two["1#1"]
    assert_greedy_equal(model, prompts, ours, theirs)


def test_uneven_split_is_refused() -> None:
    class Config:
        num_attention_heads = 4
        num_key_value_heads = 2
        intermediate_size = 768

    check_divisible(Config(), 2)
    with pytest.raises(TPError, match="KV heads 2"):
        check_divisible(Config(), 4)
