"""Speculative decoding with n-gram drafts (``engine/speculative.py``): the index, greedy
output token for token as without speculation and as ``generate``'s, the accept/resample rule
keeping the target distribution (a tiny vocabulary, chi-square bounds, fixed seeds), stop
conditions inside a step's several tokens, pages given back, backoff and counters."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.bench import shapes
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import build_engine, quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.outputs import VerifyResult
from pdserve.engine.sampler import Sampler, SampleRequest
from pdserve.engine.speculative import NgramIndex, SpecState, StepCost, best_length, verify
from pdserve.schemas import SamplingParams
from tests.engine.reference import assert_greedy_equal, hf_greedy

CPU = torch.device("cpu")
SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}
ALWAYS = {**SPEC, "speculative_cost_ratio": 0.0}  # draft whenever there is a match


# ---- the index ---------------------------------------------------------------------
def test_ngram_index_takes_the_longest_suffix_seen_before() -> None:
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 7], [])
    # suffix [7]: never seen before
    assert index.propose(3) == ([], 0)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 7], [2, 3])
    # suffix [2, 3] last followed by 5 (positions 5-6), so the draft is what came after it
    assert index.propose(3) == ([5, 7, 2], 2)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 7], [2, 3, 4])
    # [2, 3, 4]: the 3-gram at the start wins over the shorter [3, 4] / [4]
    assert index.propose(2) == ([9, 2], 3)


def test_ngram_index_is_kept_as_tokens_arrive_and_repeats_periodic_text() -> None:
    index = NgramIndex(2, 4)
    prompt = [5, 6, 7]
    index.extend(prompt, [])
    assert index.propose(4) == ([], 0)
    index.extend(prompt, [5, 6])
    assert index.propose(4) == ([7, 5, 6, 7], 2)  # its continuation runs into the suffix: a period of 3
    fresh = NgramIndex(2, 4)
    fresh.extend(prompt, [5, 6])
    assert fresh.tables == index.tables  # incremental equals built at once


# ---- greedy identity ---------------------------------------------------------------
def _run(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            assert o.index == len(outs.get(o.rid, []))
            outs.setdefault(o.rid, []).extend(o.token_ids)
    engine.pages.check_invariants()
    assert engine.pages.num_used_pages == 0 or engine.config.enable_prefix_cache
    return [outs[str(i)] for i in range(len(prompts))]


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 90))] for _ in range(5)]
    prompts += [p[:12] * 4 for p in prompts[:3]]  # repeated text: drafts that hit
    return prompts


@pytest.mark.parametrize("impl", ["auto", "transformers"])  # auto: the CPU pass (Triton runs interpreted here)
@pytest.mark.parametrize("chunk", [2048, 16])
def test_greedy_is_the_same_with_and_without_speculation(tiny_model_dir: Path, impl: str, chunk: int) -> None:
    prompts = _prompts(1, 4000)
    base = EngineConfig(max_total_tokens=8192, model_impl=impl, chunked_prefill_size=chunk)
    plain = _run(build_engine(tiny_model_dir, base), prompts, 30)
    engine = build_engine(tiny_model_dir, EngineConfig(**{**base.__dict__, **ALWAYS}))  # type: ignore[arg-type]
    assert engine.speculator is not None and not engine.overlap
    assert _run(engine, prompts, 30) == plain
    spec = engine.stats.spec
    assert spec is not None and spec.verifies > 0 and spec.accepted > 0
    assert spec.emitted == spec.accepted + spec.verifies
    assert sum(spec.lengths) == spec.verifies
    assert engine.stats.generated_tokens == 30 * len(prompts)
    assert engine.stats.steps < 30 * 2  # fewer steps than tokens


@pytest.mark.parametrize("kind", ["llama", "smollm2-2l", "qwen2"])
def test_greedy_with_speculation_equals_generate(kind: str) -> None:
    """pdserve's CPU pass with drafts (mostly rejected on random weights: the rollback) and
    on repeated text against ``transformers``' ``generate``."""
    quiet_transformers()
    model = shapes.small_model(kind, CPU)
    prompts = _prompts(2, 300)
    expected = hf_greedy(model, prompts, 12)
    config = EngineConfig(device="cpu", max_total_tokens=4096, model_impl="pdserve", **ALWAYS)  # type: ignore[arg-type]
    engine = Engine(ModelRunner(ModelSpec(Path("m")), config, model=model, allow_interpreter=False), config)
    ours = _run(engine, prompts, 12)
    assert_greedy_equal(model, prompts, ours, expected)
    assert engine.stats.spec is not None and engine.stats.spec.verifies > 0


@pytest.mark.slow
def test_the_default_model_with_speculation_equals_without(smollm2_dir: Path) -> None:
    """SmolLM2-135M-Instruct as served (auto dtype, pdserve's CPU pass): a rewrite prompt whose
    drafts hit, token for token as without speculation. Drafting whenever a match is found
    (the adaptive rule's choice follows measured step times, which a busy machine moves)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "The quick brown fox jumps over the lazy dog near the river bank on a sunny day."
    prompts = [tokenizer.encode(f"Repeat this sentence exactly: {text}\nRepeated: {text[:20]}")]
    plain = _run(build_engine(smollm2_dir, EngineConfig(max_total_tokens=4096)), prompts, 32)
    engine = build_engine(smollm2_dir, EngineConfig(max_total_tokens=4096, **ALWAYS))  # type: ignore[arg-type]
    assert _run(engine, prompts, 32) == plain
    assert engine.stats.spec is not None and engine.stats.spec.accepted > 0


# ---- stop conditions ---------------------------------------------------------------
def test_stops_inside_a_step_of_several_tokens(tiny_model_dir: Path) -> None:
    prompt = [9, 10, 11, 12] * 6
    free = _run(build_engine(tiny_model_dir, EngineConfig(max_total_tokens=8192)), [prompt], 24)[0]
    engine = build_engine(tiny_model_dir, EngineConfig(max_total_tokens=8192, **ALWAYS))  # type: ignore[arg-type]
    stop_id = free[6]
    cases = {
        "ids": SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(stop_id,)),
        "len": SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True),
        "one": SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
    }
    text = engine.detokenize(free[:10])  # type: ignore[misc]
    stop_text = text[-3:] if text[-3:].strip() else text[-4:]
    cases["text"] = SamplingParams(max_new_tokens=24, temperature=0.0, stop=(stop_text,))
    for rid, params in cases.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[int]] = {}
    finals = {}
    multi = 0
    while engine.has_work():
        for o in engine.step():
            multi += len(o.token_ids) > 1
            outs.setdefault(o.rid, []).extend(o.token_ids)
            if o.finish_reason:
                assert o.rid not in finals
                finals[o.rid] = (o.finish_reason, o.stop_reason, o.completion_tokens)
    assert multi > 0
    first = free.index(stop_id)
    assert outs["ids"] == free[: first + 1] and finals["ids"] == ("stop", stop_id, first + 1)
    assert outs["len"] == free[:7] and finals["len"] == ("length", None, 7)
    assert outs["one"] == free[:1] and finals["one"] == ("length", None, 1)
    assert finals["text"][:2] == ("stop", stop_text) and len(outs["text"]) <= 10
    assert outs["text"] == free[: len(outs["text"])]
    engine.pages.check_invariants()
    assert engine.num_running == 0


def test_logprobs_with_speculation_are_those_without(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    prompt = [7, 8, 9] * 8

    def logprobs(**knobs: object) -> list:
        engine = build_engine(tiny_model_dir, EngineConfig(max_total_tokens=8192, **knobs))  # type: ignore[arg-type]
        engine.add_request("lp", prompt, params)
        out = []
        while engine.has_work():
            for o in engine.step():
                out += o.logprobs
        return out

    plain, spec = logprobs(), logprobs(**ALWAYS)
    assert len(plain) == len(spec) == 12
    for a, b in zip(plain, spec, strict=True):
        assert a.top_ids == b.top_ids
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_seeded_sampling_with_speculation_is_reproducible(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)

    def sample() -> list[int]:
        engine = build_engine(tiny_model_dir, EngineConfig(max_total_tokens=8192, **ALWAYS))  # type: ignore[arg-type]
        engine.add_request("s", [3, 4, 5, 6] * 5, params)
        out: list[int] = []
        while engine.has_work():
            for o in engine.step():
                out += o.token_ids
        engine.pages.check_invariants()
        assert engine.stats.spec is not None and engine.stats.spec.verifies > 0
        return out

    first = sample()
    assert len(first) == 20 and sample() == first


# ---- the accept/resample rule keeps the distribution --------------------------------
CHI2_DF5_999 = 20.52  # the 0.999 quantile of chi-square with 5 degrees of freedom


def chi2(counts: list[int], probs: list[float]) -> float:
    """Pearson's statistic of ``counts`` against ``probs`` (a token of probability 0 never drawn)."""
    n = sum(counts)
    assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def draw_verifies(
    sampler: Sampler,
    logits: torch.Tensor,
    draft: list[int],
    params: SamplingParams,
    n: int = 6000,
    masks: torch.Tensor | None = None,
) -> tuple[list[VerifyResult], list[int], list[int]]:
    """``n`` verifies of ``draft`` over the same three rows of six-token ``logits`` (and
    ``masks``): the results, and how often each token was emitted first and second (each
    result checked: the draft's prefix accepted, then one token)."""
    rows = [[SampleRequest(params, [1], [], index=t) for t in range(3)] for _ in range(n)]
    results = verify(sampler, logits.repeat(n, 1), [draft] * n, rows, None if masks is None else masks.repeat(n, 1))
    first, second = [0] * 6, [0] * 6
    for r in results:
        assert r.tokens[: r.accepted] == draft[: r.accepted] and len(r.tokens) == r.accepted + 1
        first[r.tokens[0]] += 1
        if r.accepted >= 1:
            second[r.tokens[1]] += 1
    return results, first, second


@pytest.mark.parametrize("draft", [[1, 4], [5, 5], [0, 2]])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rejection_sampling_keeps_the_target_distribution(draft: list[int], temperature: float) -> None:
    """Six tokens; row 0 and row 1 distributions differ. The first emitted token is drawn as
    from row 0's distribution whatever the draft, and the second (when the first is the
    accepted draft token) as from row 1's."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0, 0.0, 1.5], [0.0, 1.0, 2.0, 0.5, -0.5, 1.0], [1.0] * 6])
    p = [torch.softmax(logits[i] / temperature, -1).tolist() for i in range(3)]
    sampler = Sampler(CPU)
    sampler.reseed(1234)
    n = 6000
    results, first, second = draw_verifies(
        sampler, logits, draft, SamplingParams(temperature=temperature, max_new_tokens=8), n
    )
    assert chi2(first, p[0]) < CHI2_DF5_999
    assert chi2(second, p[1]) < CHI2_DF5_999
    # the draft's first token is accepted about as often as the target gives it
    accepted = sum(r.accepted >= 1 for r in results) / n
    assert accepted == pytest.approx(p[0][draft[0]], abs=0.03)


def test_rejection_keeps_top_p_and_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -5.0], [0.0, 0.0, 4.0, 0.0]])
    sampler = Sampler(CPU)
    sampler.reseed(5)
    top = SamplingParams(temperature=1.0, top_p=0.5, max_new_tokens=4)
    rows = [[SampleRequest(top, [1], [], index=0), SampleRequest(top, [1], [], index=1)] for _ in range(300)]
    results = verify(sampler, logits.repeat(300, 1), [[1]] * 300, rows)
    assert all(r.tokens[0] == 0 and r.accepted == 0 for r in results)  # 1 is outside the top-p set
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    rows = [[SampleRequest(greedy, [1], [], index=t) for t in range(2)]]
    assert verify(sampler, logits, [[0]], rows)[0].tokens == [0, 2]
    assert verify(sampler, logits, [[1]], rows)[0].tokens == [0]


# ---- backoff and counters ----------------------------------------------------------
def test_a_request_whose_drafts_do_not_pay_stops_drafting(tiny_model_dir: Path) -> None:
    """At a cost ratio its acceptance does not reach, a request drafts only its probes (after
    cooldowns that double); at one no acceptance could reach, it never drafts."""

    def spec_at(ratio: float):  # type: ignore[no-untyped-def]
        knobs = {**SPEC, "speculative_cost_ratio": ratio}
        engine = build_engine(tiny_model_dir, EngineConfig(max_total_tokens=8192, **knobs))  # type: ignore[arg-type]
        engine.add_request("b", [3, 4, 5, 6] * 5, SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True))
        while engine.has_work():
            engine.step()
        assert engine.stats.spec is not None
        return engine.stats.spec, engine.stats.steps

    spec, steps = spec_at(0.999)
    assert 0 < spec.probes <= 7  # cooldowns of 1, 2, 4, ... 64 steps
    assert spec.verifies == spec.probes and steps > 60
    spec, steps = spec_at(1.5)
    assert spec.verifies == spec.probes == 0 and steps == 120


def test_probes_cost_no_more_than_their_share_of_the_steps(tiny_model_dir: Path) -> None:
    """32 requests whose drafts do not pay, each due to probe after its cooldowns: the probes
    are paid out of one budget (PROBE_SHARE of the sequences' steps, starting with
    PROBE_BUDGET_PROBES probes), so they are a few, not seven per request."""
    from pdserve.engine import speculative

    knobs = {**SPEC, "speculative_cost_ratio": 0.999}
    engine = build_engine(tiny_model_dir, EngineConfig(max_total_tokens=32 * 160, **knobs))  # type: ignore[arg-type]
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(32):
        engine.add_request(f"r{i}", [3 + i, 4, 5, 6] * 5, params)
    sequence_steps = 0
    while engine.has_work():
        sequence_steps += len(engine.scheduler.running)
        engine.step()
    spec = engine.stats.spec
    assert spec is not None and spec.verifies == spec.probes  # nothing but probes drafts here
    full_probe = SPEC["speculative_num_draft_tokens"] * 0.999  # a probe's price: its tokens, no row
    afforded = speculative.PROBE_BUDGET_PROBES * full_probe + speculative.PROBE_SHARE * sequence_steps
    assert 0 < spec.drafted * 0.999 <= afforded
    assert spec.probes < 32  # unbudgeted, every request probed at once and after each cooldown
    assert spec.probes_deferred > 0


def test_the_step_cost_fit_and_the_acceptance_estimate() -> None:
    cost = StepCost()
    for _ in range(300):
        for tokens, verifies in ((1, 0), (3, 1), (5, 1), (32, 0), (40, 4)):
            cost.observe(tokens, verifies, 0.020 + 0.002 * tokens + 0.003 * verifies)
    a, b, c = cost.params
    assert a == pytest.approx(0.020, rel=0.05) and b == pytest.approx(0.002, rel=0.05)
    assert c == pytest.approx(0.003, rel=0.05)
    token, row = cost.price(1)
    assert token == pytest.approx(0.002 / 0.022, rel=0.05) and row == pytest.approx(0.003 / 0.022, rel=0.05)
    assert cost.price(32)[0] > cost.price(1)[0]
    assert best_length(0.9, (0.1, 0.1), 4) == 4
    assert best_length(0.5, (0.2, 0.1), 4) == 2  # 0.5, 0.25 pay; 0.125 does not
    assert best_length(0.3, (0.2, 0.2), 4) == 0  # 0.3 - 0.2 does not pay for the row
    state = SpecState(NgramIndex(1, 2))
    for _ in range(30):
        state.record(4, 4)
    assert state.alpha > 0.95
    for _ in range(30):
        state.record(4, 0)
    assert state.alpha < 0.2  # accepted tokens outweigh single rejections: it falls over tens of verifies


def test_the_counters_reach_prometheus(tiny_model_dir: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.workers.metrics import _Speculative

    engine = build_engine(tiny_model_dir, EngineConfig(max_total_tokens=8192, **ALWAYS))  # type: ignore[arg-type]
    _run(engine, [[3, 4, 5, 6] * 5], 20)
    spec = engine.stats.spec
    assert spec is not None and spec.accepted > 0
    registry = CollectorRegistry()
    registry.register(_Speculative(spec))
    text = generate_latest(registry).decode()
    assert f"pdserve_spec_accepted_tokens_total {float(spec.accepted)}" in text
    assert f"pdserve_spec_steps_saved_total {float(spec.accepted)}" in text
    assert f'pdserve_spec_acceptance_length_bucket{{le="+Inf"}} {float(spec.verifies)}' in text
    assert f"pdserve_spec_acceptance_length_count {float(spec.verifies)}" in text


def test_the_flags_sglang_and_vllm_spellings() -> None:
    import argparse

    from pdserve import configs, flags

    parser = argparse.ArgumentParser()
    flags.add_flags(parser, flags.ENGINE, "engine")
    args = parser.parse_known_args(
        ["--speculative-algorithm", "ngram", "--speculative-ngram-max-match-window-size", "6"]
    )
    assert configs.speculative_settings(args[0])["speculative_ngram_max"] == 6
    vllm = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'
    settings = configs.speculative_settings(parser.parse_known_args(["--speculative-config", vllm])[0])
    assert settings["speculative_num_draft_tokens"] == 3 and settings["speculative_ngram_min"] == 2
    assert configs.speculative_settings(parser.parse_known_args([])[0])["speculative_algorithm"] == ""
    with pytest.raises(configs.UsageError):
        configs.speculative_settings(parser.parse_known_args(["--speculative-config", '{"method": "eagle"}'])[0])
