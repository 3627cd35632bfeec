"""The engine against ``transformers``' own ``generate``: continuous batching, chunked
prefill, prefix hits, preemption, two architectures, the PD hand-off over Mooncake, and
sharded safetensors checkpoints."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import regex
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import build_engine, quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.outputs import RequestError
from pdserve.schemas import SamplingParams
from tests.engine.handoff import mooncake_pair, pull

GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)


def run_all(engine: Engine) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    for _ in range(100_000):
        if not engine.has_work():
            break
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
    assert not engine.has_work()
    return outs


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            g = model.generate(
                torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens
            )
            outs.append(g[0, len(p) :].tolist())
    return outs


def random_prompts(n: int, vocab: int, seed: int = 0, low: int = 3, high: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(10, 4000)
    prompts += [prompts[0][:100] + [7, 8, 9], prompts[1] + [11, 12]]  # shared prefixes
    return prompts, hf_greedy(tiny_model_dir, prompts, GREEDY.max_new_tokens)


def make_engine(model_dir: Path, **overrides: object) -> Engine:
    config = EngineConfig(**{"max_total_tokens": 32768, **overrides})  # type: ignore[arg-type]
    return build_engine(model_dir, config)


@pytest.mark.parametrize("chunk", [2048, 64])
def test_greedy_matches_transformers_under_continuous_batching(tiny_model_dir: Path, reference, chunk: int) -> None:
    prompts, expected = reference
    engine = make_engine(tiny_model_dir, chunked_prefill_size=chunk, max_num_seqs=4)
    for i, p in enumerate(prompts[:10]):
        engine.add_request(f"r{i}", p, GREEDY)
    outs = run_all(engine)
    for i, p in enumerate(prompts[10:], start=10):  # second wave: prefix hits
        engine.add_request(f"r{i}", p, GREEDY)
    outs.update(run_all(engine))
    assert [outs[f"r{i}"] for i in range(len(prompts))] == expected
    assert engine.stats.cached_tokens >= 96  # the shared prefixes came from the cache
    assert engine.pages.num_used_pages == 0
    engine.pages.check_invariants()


def test_requests_join_a_running_batch(tiny_model_dir: Path, reference) -> None:
    prompts, expected = reference
    engine = make_engine(tiny_model_dir, chunked_prefill_size=128)
    outs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_work():
        if pending:  # one new request per step while others decode
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
    assert [outs[f"r{i}"] for i in range(len(prompts))] == expected


def test_preemption_under_a_tiny_pool_completes_every_request(tiny_model_dir: Path) -> None:
    prompts = random_prompts(8, 4000, seed=5, low=40, high=80)
    params = SamplingParams(max_new_tokens=90, temperature=0.0, ignore_eos=True)
    expected = hf_greedy(tiny_model_dir, prompts, params.max_new_tokens)
    engine = make_engine(tiny_model_dir, max_total_tokens=16 * 30, chunked_prefill_size=256)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [outs[f"r{i}"] for i in range(len(prompts))] == expected
    assert engine.pages.num_used_pages == 0


def test_request_too_long_for_context_or_pool_is_refused(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_total_tokens=16 * 8)
    with pytest.raises(RequestError, match="KV pool"):
        engine.add_request("big", list(range(3, 200)), GREEDY)
    with pytest.raises(RequestError, match="context"):
        make_engine(tiny_model_dir).add_request("huge", [5] * 5000, GREEDY)


def test_second_architecture_llama(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    prompts = random_prompts(6, 1000, seed=3, high=120)
    expected = hf_greedy(tmp_path, prompts, 12)
    engine_config = EngineConfig(max_total_tokens=4096, chunked_prefill_size=48)
    engine = Engine(ModelRunner(ModelSpec(tmp_path), engine_config), engine_config)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs = run_all(engine)
    assert [outs[f"r{i}"] for i in range(len(prompts))] == expected


def test_abort_frees_pages_at_once_and_in_flight(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.add_request("a", list(range(3, 100)), GREEDY)
    engine.add_request("b", list(range(3, 50)), GREEDY)
    engine.step()
    assert engine.pages.num_used_pages > 0
    batch = engine.schedule()
    assert engine.abort("a")  # in flight: freed after the step
    engine.postprocess(batch, engine.execute(batch))
    assert engine.abort("b")
    assert not engine.has_work()
    assert engine.pages.num_used_pages == 0


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=3.0, top_p=0.95, top_k=200, seed=1234, ignore_eos=True)
    prompt = list(range(10, 60))
    alone = make_engine(tiny_model_dir)
    alone.add_request("x", prompt, params)
    crowd = make_engine(tiny_model_dir)
    for i in range(5):
        crowd.add_request(f"other{i}", list(range(20 + i, 90)), SamplingParams(max_new_tokens=16, temperature=1.0))
    crowd.add_request("x", prompt, params)
    assert run_all(alone)["x"] == run_all(crowd)["x"]
    other = SamplingParams(max_new_tokens=16, temperature=3.0, top_p=0.95, top_k=200, seed=99, ignore_eos=True)
    assert run_all_again(tiny_model_dir, prompt, other) != run_all_again(tiny_model_dir, prompt, params)


def run_all_again(model_dir: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine(model_dir)
    engine.add_request("x", prompt, params)
    return run_all(engine)["x"]


def test_stop_conditions(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = list(range(30, 80))
    free_run = run_all_again(tiny_model_dir, prompt, GREEDY)
    stop_id = free_run[5]
    engine.add_request("ids", prompt, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(stop_id,)))
    text = engine.detokenize(free_run[:8])  # type: ignore[misc]
    stop_text = text[-3:] if text[-3:].strip() else text[-4:]
    engine.add_request("text", prompt, SamplingParams(max_new_tokens=20, temperature=0.0, stop=(stop_text,)))
    engine.add_request("len", prompt, SamplingParams(max_new_tokens=3, temperature=0.0))
    finals = {}
    outs: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
            if o.finish_reason:
                finals[o.rid] = (o.finish_reason, o.stop_reason)
    assert outs["ids"] == free_run[: free_run.index(stop_id) + 1]
    assert finals["ids"] == ("stop", stop_id)
    assert finals["text"] == ("stop", stop_text)
    assert stop_text in engine.detokenize(outs["text"])  # type: ignore[misc]
    assert len(outs["text"]) <= 8
    assert outs["len"] == free_run[:3] and finals["len"] == ("length", None)


def test_a_stop_regex_ends_the_request_at_the_token_that_completes_a_match(tiny_model_dir: Path) -> None:
    """``stop_regex``: the request ends (reason ``stop``, the pattern named) at the first
    token after which the text of its last tokens matches; not before ``min_new_tokens``
    tokens, nor on an empty match; a pattern whose search runs past its time limit is given up
    for its request, counted."""
    engine = make_engine(tiny_model_dir)
    detok = engine.detokenize
    assert detok is not None
    prompt = [*range(30, 80), 276, 285, 279]  # its greedy output repeats one token of text
    free_run = run_all_again(tiny_model_dir, prompt, GREEDY)
    word = detok(free_run[:1])
    assert free_run == free_run[:1] * len(free_run) and word.strip() and "\ufffd" not in word, word
    three = f"(?:{regex.escape(word)}){{3}}"
    cases = {
        "regex": SamplingParams(max_new_tokens=20, temperature=0.0, stop_regex=("@@", three)),
        "late": SamplingParams(max_new_tokens=20, temperature=0.0, stop_regex=(three,), min_new_tokens=2),
        "never": SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_regex=(r"\b(?=@)", "@@")),
        # a pattern that backtracks without end once the text is ten tokens long: given up, counted
        "slow": SamplingParams(
            max_new_tokens=16, temperature=0.0, ignore_eos=True, stop_regex=(f"(?:.|..)+${regex.escape(word[0])}",)
        ),
    }
    for rid, params in cases.items():
        engine.add_request(rid, prompt, params)
    finals, outs = {}, {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
            if o.finish_reason:
                finals[o.rid] = (o.finish_reason, o.stop_reason)
    assert outs["regex"] == free_run[:3] and finals["regex"] == ("stop", three)
    assert outs["late"] == free_run[:5] and finals["late"] == ("stop", three)  # the match after the first two
    assert outs["never"] == free_run[:12] and finals["never"] == ("length", None)
    assert outs["slow"] == free_run[:16] and finals["slow"] == ("length", None)
    assert engine.stats.stop_regex_timeouts == 1


def test_logprobs_are_the_model_distribution(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.add_request(
        "lp", [5, 6, 7, 8], SamplingParams(max_new_tokens=2, temperature=0.0, logprobs=True, top_logprobs=3)
    )
    outs = [o for o in iter_outputs(engine)]
    first = outs[0].logprobs[0]
    assert first.top_ids[0] == outs[0].token_ids[0]
    assert first.logprob == pytest.approx(first.top_logprobs[0])
    assert list(first.top_logprobs) == sorted(first.top_logprobs, reverse=True)


def prompt_reference(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """``transformers``' log-softmax at every position of each prompt."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


@pytest.mark.parametrize("impl", ["pdserve", "transformers"])
def test_prompt_logprobs_equal_transformers_in_chunks_past_the_prefix_cache(tiny_model_dir: Path, impl: str) -> None:
    """Scored over chunks of 64 tokens (several steps, beside other requests), each token's
    log-probability, rank and alternatives are ``transformers``'; a prompt whose KV the prefix
    cache holds is computed again (a request that does not score still takes the cache)."""
    prompts = random_prompts(3, 4000, seed=3, low=2, high=300) + [[9, 10]]
    engine = make_engine(tiny_model_dir, chunked_prefill_size=64, model_impl=impl)
    engine.add_request("warm", prompts[1], SamplingParams(max_new_tokens=1, temperature=0.0))
    run_all(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, SamplingParams(max_new_tokens=3, temperature=0.0, prompt_logprobs=2))
    engine.add_request("plain", prompts[1], SamplingParams(max_new_tokens=3, temperature=0.0))
    scored, cached = {}, {}
    for o in iter_outputs(engine):
        if o.prompt_logprobs is not None:
            assert o.rid not in scored and o.index == 0  # once, with the first token
            scored[o.rid], cached[o.rid] = o.prompt_logprobs, o.cached_tokens
    assert "plain" not in scored
    for i, (p, ref) in enumerate(zip(prompts, prompt_reference(tiny_model_dir, prompts), strict=True)):
        got = scored[f"s{i}"]
        want = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])]
        assert torch.allclose(torch.tensor(got.logprobs), want, atol=1e-4)
        # a rank is the tokens above plus one: those within the logprobs' tolerance of the token's
        # own may fall either side (a rank 2765 read 2764 on another CPU's float32 sums, 2026-12-07)
        ranks = torch.tensor(got.ranks)
        assert (ranks >= (ref[:-1] > want[:, None] + 1e-4).sum(-1) + 1).all()
        assert (ranks <= (ref[:-1] > want[:, None] - 1e-4).sum(-1) + 1).all()
        top = ref[:-1].topk(2, dim=-1)
        assert torch.equal(torch.tensor(got.top_ids).view(-1, 2), top.indices)
        assert torch.allclose(torch.tensor(got.top_logprobs).view(-1, 2), top.values, atol=1e-4)
        assert cached[f"s{i}"] == 0
    assert engine.stats.scored_prompt_tokens == sum(len(p) - 1 for p in prompts)
    assert engine.stats.cached_tokens > 0  # the request that does not score took the cached prefix


def test_a_salted_prompt_shares_its_cached_prefix_only_with_the_same_salt(tiny_model_dir: Path) -> None:
    """``cache_salt``: the prompt's page hashes start from the salt, so the device's prefix
    cache gives a prompt's pages only to a request with the same salt (none to an unsalted or
    differently salted one, and a salted one takes nothing an unsalted one computed); outputs
    are the same."""
    (prompt,) = random_prompts(1, 4000, seed=12, low=70, high=70)
    engine = make_engine(tiny_model_dir)
    cached: dict[str, int] = {}
    outs: dict[str, list[int]] = {}
    for rid, salt in (
        ("plain", None),
        ("a", "tenant-a"),
        ("b", "tenant-b"),
        ("a-again", "tenant-a"),
        ("plain-again", None),
    ):
        engine.add_request(rid, prompt, SamplingParams(max_new_tokens=3, temperature=0.0, cache_salt=salt))
        for o in iter_outputs(engine):
            outs.setdefault(o.rid, []).extend(o.token_ids)
            cached.setdefault(o.rid, o.cached_tokens)
    assert cached == {"plain": 0, "a": 0, "b": 0, "a-again": 64, "plain-again": 64}
    assert len({tuple(v) for v in outs.values()}) == 1


def test_a_prompt_to_score_is_computed_in_bounded_chunks(tiny_model_dir: Path) -> None:
    """Every row of a scored prompt keeps its logits: its chunks are at most SCORED_ROWS
    tokens whatever the step's budget (a prompt not scored beside it takes the budget)."""
    from pdserve.engine.scheduler import SCORED_ROWS

    prompts = random_prompts(2, 4000, seed=9, low=SCORED_ROWS * 2 + 50, high=SCORED_ROWS * 2 + 60)
    engine = make_engine(tiny_model_dir, chunked_prefill_size=4096)
    engine.add_request("scored", prompts[0], SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=0))
    engine.add_request("plain", prompts[1], SamplingParams(max_new_tokens=2, temperature=0.0))
    chunks: dict[str, list[int]] = {"scored": [], "plain": []}
    schedule = engine.scheduler.schedule

    def recorded() -> Any:
        batch = schedule()
        for seq, n in batch.prefills:
            chunks[seq.rid].append(n)
        return batch

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    scored = [o.prompt_logprobs for o in iter_outputs(engine) if o.prompt_logprobs is not None]
    assert chunks["scored"] == [SCORED_ROWS, SCORED_ROWS, len(prompts[0]) - 2 * SCORED_ROWS]
    assert chunks["plain"] == [len(prompts[1])]
    assert len(scored) == 1 and len(scored[0].logprobs) == len(prompts[0]) - 1


def test_prompt_logprobs_survive_preemption(tiny_model_dir: Path) -> None:
    """Under a pool too small for the batch, sequences are preempted and recomputed: each
    prompt is still scored exactly once and right, and the outputs stay ``transformers``'."""
    prompts = random_prompts(8, 4000, seed=5, low=40, high=80)
    params = SamplingParams(max_new_tokens=90, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    expected = hf_greedy(tiny_model_dir, prompts, params.max_new_tokens)
    engine = make_engine(tiny_model_dir, max_total_tokens=16 * 30, chunked_prefill_size=32)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs: dict[str, list[int]] = {}
    scored: dict[str, list[float]] = {}
    for o in iter_outputs(engine):
        outs.setdefault(o.rid, []).extend(o.token_ids)
        if o.prompt_logprobs is not None:
            assert o.rid not in scored
            scored[o.rid] = list(o.prompt_logprobs.logprobs)
    assert engine.scheduler.num_preemptions > 0
    assert [outs[f"r{i}"] for i in range(len(prompts))] == expected
    for i, (p, ref) in enumerate(zip(prompts, prompt_reference(tiny_model_dir, prompts), strict=True)):
        want = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])]
        assert torch.allclose(torch.tensor(scored[f"r{i}"]), want, atol=1e-4)
    assert engine.pages.num_used_pages == 0


@pytest.mark.parametrize("spec", [False, True])
def test_min_new_tokens_equals_transformers(mixing_model_dir: Path, spec: bool) -> None:
    """A stop token the greedy output would take at once is held off for ``min_new_tokens``
    tokens, as ``generate``'s ``min_new_tokens`` holds off its end tokens (the model's end
    of sequence too); with n-gram speculation, the verified drafts the same. A stop string
    found in the first ``min_new_tokens`` tokens' text does not end it."""
    from pdserve.engine.loader import eos_ids

    rng = random.Random(4)
    prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in (12, 40, 70)]
    prompts += [p[:10] * 5 for p in prompts[1:]]  # repeated text: drafts that hit
    overrides = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3, "speculative_cost_ratio": 0.0}
    engine = make_engine(mixing_model_dir, **(overrides if spec else {}))
    free = hf_greedy(mixing_model_dir, prompts, 12)
    ends = sorted(eos_ids(mixing_model_dir))
    model = AutoModelForCausalLM.from_pretrained(mixing_model_dir, dtype=torch.float32).eval()
    for i, (p, run) in enumerate(zip(prompts, free, strict=True)):
        stop = run[1]  # taken at the second token (or the first) without a floor
        params = SamplingParams(max_new_tokens=16, min_new_tokens=6, temperature=0.0, stop_token_ids=(stop,))
        engine.add_request(f"m{i}", p, params)
        with torch.inference_mode():
            g = model.generate(
                torch.tensor([p]), max_new_tokens=16, min_new_tokens=6, do_sample=False, eos_token_id=[stop, *ends]
            )[0, len(p) :].tolist()
        outs = run_all(engine)[f"m{i}"]
        assert len(outs) >= 6 and stop not in outs[:6]
        assert outs == g
    # a stop string in the first tokens' text: it ends the output only once it comes after them
    word = engine.detokenize(free[0][:1])  # type: ignore[misc]
    assert word.strip()
    floor = SamplingParams(max_new_tokens=10, min_new_tokens=4, temperature=0.0, ignore_eos=True, stop=(word,))
    engine.add_request("s", prompts[0], floor)
    engine.add_request("s0", prompts[0], dataclasses.replace(floor, min_new_tokens=0))
    outs = run_all(engine)
    assert outs["s0"] == free[0][:1]  # at once without the floor
    assert len(outs["s"]) > 4 and outs["s"] == free[0][: len(outs["s"])]
    if spec:
        assert engine.speculator is not None and engine.speculator.stats.verifies > 0


def test_a_higher_priority_request_preempts_and_every_output_stays_greedy(tiny_model_dir: Path, reference) -> None:
    """A request of a higher priority takes a running one's seat mid-decode; the preempted one
    is recomputed from its cached prefix and its output goes on as transformers' would."""
    prompts, expected = reference
    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    low = dataclasses.replace(GREEDY, priority=1)
    for i in range(2):
        engine.add_request(f"r{i}", prompts[i], low)
    outs: dict[str, list[int]] = {}
    finished: list[str] = []
    for _ in range(5):
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
    engine.add_request("r2", prompts[2], dataclasses.replace(GREEDY, priority=-1))
    for o in iter_outputs(engine):
        outs.setdefault(o.rid, []).extend(o.token_ids)
        if o.finish_reason is not None:
            finished.append(o.rid)
    assert engine.scheduler.num_priority_preemptions == 1
    assert finished == ["r0", "r2", "r1"]  # r1, the newer of the two, gave its seat
    assert [outs[f"r{i}"] for i in range(3)] == expected[:3]


def iter_outputs(engine: Engine):
    while engine.has_work():
        yield from engine.step()


def test_pd_handoff_over_mooncake_equals_unified(tiny_model_dir: Path, reference) -> None:
    """Prefill engine holds KV, decode engine pulls it with one batched Mooncake read."""
    prompts, expected = reference
    prefill = make_engine(tiny_model_dir)
    decode = make_engine(tiny_model_dir)
    with mooncake_pair(prefill, decode) as ends:
        for i, p in enumerate(prompts):
            prefill.add_request(f"r{i}", p, GREEDY, prefill_only=True)
        firsts = {o.rid: o for o in iter_outputs(prefill)}
        assert all(o.held for o in firsts.values())
        for i, p in enumerate(prompts):
            pull(ends, prefill, decode, f"r{i}", p, firsts[f"r{i}"].token_ids, GREEDY)
        assert prefill.pages.num_used_pages == 0
        outs = run_all(decode)
        assert [firsts[f"r{i}"].token_ids + outs[f"r{i}"] for i in range(len(prompts))] == expected
        assert decode.pages.num_used_pages == 0


def test_resumed_request_hands_off_prompt_and_streamed_output(tiny_model_dir: Path, reference) -> None:
    """A request resumed with output already streamed: the prefill engine computes prompt +
    that output and holds its KV; the decode engine imports all of it and goes on exactly
    where an undisturbed run would (migration of a stream to another decode worker)."""
    prompts, expected = reference
    prefill = make_engine(tiny_model_dir)
    decode = make_engine(tiny_model_dir)
    with mooncake_pair(prefill, decode) as ends:
        for i, streamed in ((0, 7), (1, 16), (2, 1)):
            rid, prompt = f"m{i}", prompts[i]
            prefill.add_request(rid, prompt, GREEDY, expected[i][:streamed], prefill_only=True)
            (first,) = list(iter_outputs(prefill))
            assert first.held and first.index == streamed and first.token_ids == [expected[i][streamed]]
            moved = pull(ends, prefill, decode, rid, prompt, expected[i][: streamed + 1], GREEDY)
            assert moved == len(prompt) + streamed
            rest = [o for o in iter_outputs(decode)]
            assert rest[0].index == streamed + 1
            assert expected[i][: streamed + 1] + [t for o in rest for t in o.token_ids] == expected[i]
        assert prefill.pages.num_used_pages == 0 and decode.pages.num_used_pages == 0


def test_sharded_safetensors_load_and_decode_as_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="5MB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    assert not list(sharded.glob("*.bin"))

    engine = build_engine(sharded, EngineConfig(max_total_tokens=8192))
    prompts = random_prompts(2, 4000, seed=3, high=60)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    outs = run_all(engine)
    assert [outs[f"r{i}"] for i in range(len(prompts))] == hf_greedy(tiny_model_dir, prompts, GREEDY.max_new_tokens)


def test_parked_pages_come_back_as_steps_finish(tiny_model_dir: Path, reference) -> None:
    """With ``park_freed`` (on by default on a GPU) a page freed while a step is in flight
    waits for that step, so a transfer may write into any page it is given at once; the
    other requests' greedy output is unchanged and nothing stays parked."""
    prompts, expected = reference
    engine = make_engine(tiny_model_dir, chunked_prefill_size=2048, max_num_seqs=8)
    engine.park_freed = True
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", p, GREEDY)
    outs: dict[str, list[int]] = {}
    parked: list[int] = []
    step = 0
    while engine.has_work():
        step += 1
        if step in (2, 5):  # an import holds pages outside the steps, as on a decode worker
            held = engine.reserve_import(f"imp{step}", prompts[5], [], GREEDY)
            assert held is not None
        batch = engine.schedule()
        if step in (2, 5):  # its transfer fails while the step is in flight: its pages wait for the step
            engine.fail_import(held) if step == 2 else engine.abort(f"imp{step}")
            parked.append(engine.pages.num_parked_pages)
            assert engine.pages.num_free_pages + engine.pages.num_used_pages == engine.pages.num_pages
        if batch.is_empty:
            continue
        launched = engine.launch(batch)
        for o in engine.complete(launched, engine.collect(launched)):
            outs.setdefault(o.rid, []).extend(o.token_ids)
    # imp2's pages all wait; imp5 shares the full pages imp2 cached (never parked) but its last.
    assert parked[0] == -(-len(prompts[5]) // engine.pages.page_size) and parked[1] >= 1, parked
    assert [outs[f"r{i}"] for i in range(4)] == expected[:4]
    assert outs["imp2"] == expected[5]  # its failed import was computed here instead
    assert "imp5" not in outs
    assert engine.pages.num_parked_pages == 0 and engine.pages.park_tag is None
    assert engine.pages.num_used_pages == 0
    engine.pages.check_invariants()
