"""Token selection on CPU with hand-made logits."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from pdserve.engine.sampler import Sampler, SampleRequest, _filter, seed_for
from pdserve.schemas import SamplingParams

CPU = torch.device("cpu")


def _row(prompt: tuple[int, ...] = (0,), output: tuple[int, ...] = (), **params: Any) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), list(prompt), list(output))


def _probs_logits(probs: list[float], vocab: int | None = None) -> torch.Tensor:
    """Logits whose softmax is ``probs`` (padded with near-zero-probability tokens)."""
    values = list(probs) + [1e-12] * ((vocab or len(probs)) - len(probs))
    return torch.tensor(values).log()


@pytest.fixture
def sampler() -> Sampler:
    s = Sampler(CPU)
    s.reseed(1234)
    return s


def _draws(sampler: Sampler, logits: torch.Tensor, n: int, **params: Any) -> list[int]:
    """``n`` draws from one row of logits, each with its own seed (one batched call)."""
    rows = [_row(seed=1000 + i, **params) for i in range(n)]
    return sampler(logits.expand(n, -1).clone(), rows).token_ids


# ---- greedy ------------------------------------------------------------------------------


def test_greedy_picks_argmax(sampler: Sampler) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    rows = [_row(temperature=0.0) for _ in range(6)]
    out = sampler(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_ignores_seed_and_is_stable(sampler: Sampler) -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    for seed in (None, 1, 2):
        for _ in range(3):
            assert sampler(logits, [_row(temperature=0.0, seed=seed)]).token_ids == [1]


def test_half_precision_logits(sampler: Sampler) -> None:
    logits = torch.tensor([[0.5, -1.0, 4.0, 2.0]], dtype=torch.float16)
    assert sampler(logits, [_row(temperature=0.0)]).token_ids == [2]


def test_top_k_1_is_greedy(sampler: Sampler) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 100, generator=gen)
    rows = [_row(top_k=1, temperature=1.5, seed=i) for i in range(32)]
    assert sampler(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


# ---- seeds -----------------------------------------------------------------------------


def test_seed_for_is_deterministic_and_spread() -> None:
    assert seed_for(7, 3) == seed_for(7, 3)
    values = {seed_for(s, i) for s in range(20) for i in range(20)}
    assert len(values) == 400
    assert all(0 <= v < 2**63 for v in values)


def test_seeded_sampling_is_reproducible(sampler: Sampler) -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 1000, generator=gen)
    row = _row(seed=42, output=(5, 6, 7))
    first = sampler(logits, [row]).token_ids
    # the sampler's own state (unseeded draws, reseed) does not matter
    sampler(torch.randn(3, 1000, generator=gen), [_row(), _row(), _row()])
    sampler.reseed(99)
    assert sampler(logits, [row]).token_ids == first
    assert Sampler(CPU)(logits, [row]).token_ids == first


def test_seeded_sampling_independent_of_batch(sampler: Sampler) -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 500
    target_logits = torch.randn(vocab, generator=gen) * 2
    outputs_so_far = (11, 12)
    target = _row(seed=7, output=outputs_so_far, temperature=0.8)
    alone = [sampler(target_logits[None], [target]).token_ids[0]]
    # the same seed and output index in many batch positions, next to all kinds of rows
    others = [
        _row(temperature=0.0),
        _row(),  # unseeded
        _row(seed=8, output=outputs_so_far),
        _row(seed=7, output=(1,)),  # same seed, other output index
        _row(seed=7, output=outputs_so_far, temperature=1.3),
        _row(frequency_penalty=1.0, output=(1, 2, 2)),
        _row(repetition_penalty=1.5, prompt=(3, 4, 5), seed=1),
        _row(logprobs=True, top_logprobs=3, seed=2),
    ]
    for position in range(len(others) + 1):
        rows = [*others[:position], target, *others[position:]]
        logits = torch.randn(len(rows), vocab, generator=gen) * 2
        logits[position] = target_logits
        out = sampler(logits, rows)
        alone.append(out.token_ids[position])
    assert len(set(alone)) == 1, alone


def test_seeded_sampling_independent_of_filtered_neighbours(sampler: Sampler) -> None:
    """A row without filters gets the same token next to a row that uses top-k/top-p."""
    gen = torch.Generator().manual_seed(4)
    vocab = 300
    for seed in range(20):
        target_logits = torch.randn(vocab, generator=gen)
        target = _row(seed=seed)
        alone = sampler(target_logits[None], [target]).token_ids[0]
        neighbour = _row(top_k=5, top_p=0.8, min_p=0.1, seed=seed + 100)
        logits = torch.stack([torch.randn(vocab, generator=gen), target_logits])
        assert sampler(logits, [neighbour, target]).token_ids[1] == alone


def test_output_index_changes_the_draw(sampler: Sampler) -> None:
    logits = torch.zeros(1, 1000)  # uniform: any token is equally likely
    tokens = [sampler(logits, [_row(seed=5, output=tuple(range(i)))]).token_ids[0] for i in range(30)]
    assert len(set(tokens)) >= 25
    # and a different seed at the same index draws differently
    by_seed = [sampler(logits, [_row(seed=s, output=(1, 2))]).token_ids[0] for s in range(30)]
    assert len(set(by_seed)) >= 25


def test_unseeded_rows_reproducible_after_reseed() -> None:
    logits = torch.zeros(4, 1000)
    rows = [_row() for _ in range(4)]
    a, b = Sampler(CPU), Sampler(CPU)
    a.reseed(3)
    b.reseed(3)
    assert a(logits, rows).token_ids == b(logits, rows).token_ids
    draws = [a(logits, rows).token_ids for _ in range(5)]
    assert len({tuple(d) for d in draws}) > 1  # the generator advances


def test_sampling_follows_the_distribution(sampler: Sampler) -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 4000
    counts = Counter(_draws(sampler, _probs_logits(probs), n))
    for token, p in enumerate(probs):
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(counts[token] / n - p) < 5 * sd, (token, counts)


# ---- filters ------------------------------------------------------------------------------

PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.6}, {0, 1}),  # 0.4 < 0.6 <= 0.7
        ({"top_p": 0.3}, {0}),
        ({"top_p": 0.8}, {0, 1, 2}),  # 0.7 < 0.8 <= 0.85
        ({"min_p": 0.5}, {0, 1}),  # keep p >= 0.2
        ({"min_p": 0.3}, {0, 1, 2}),  # keep p >= 0.12
        ({"top_k": 3, "top_p": 0.6}, {0, 1}),
        ({"top_k": 4, "min_p": 0.7}, {0, 1}),  # keep p >= 0.28
        ({"top_p": 0.9, "min_p": 0.2}, {0, 1, 2, 3}),
        ({"min_p": 1.0}, {0}),
    ],
)
def test_filters_never_pick_masked_tokens(sampler: Sampler, params: dict[str, Any], allowed: set[int]) -> None:
    logits = _probs_logits(PROBS, vocab=64)
    n = 2000
    counts = Counter(_draws(sampler, logits, n, temperature=1.0, **params))
    assert set(counts) == allowed, counts  # nothing outside, and everything inside shows up
    # the kept tokens keep their relative odds
    mass = sum(PROBS[t] for t in allowed)
    for token in allowed:
        p = PROBS[token] / mass
        assert abs(counts[token] / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-9, (token, counts)


def test_filters_apply_per_row(sampler: Sampler) -> None:
    logits = _probs_logits(PROBS, vocab=16).expand(600, -1).clone()
    rows = [_row(seed=i, top_k=1 + i % 3) if i % 2 else _row(seed=i) for i in range(600)]
    tokens = sampler(logits, rows).token_ids
    for i, token in enumerate(tokens):
        if i % 2:
            assert token < 1 + i % 3
    unfiltered = {t for i, t in enumerate(tokens) if i % 2 == 0}
    assert unfiltered >= {0, 1, 2, 3, 4}


def test_min_p_and_top_p_apply_per_row(sampler: Sampler) -> None:
    """Different min_p / top_p values in one batch each use their own threshold."""
    logits = _probs_logits(PROBS, vocab=32).expand(900, -1).clone()
    settings = [{"min_p": 0.7}, {"min_p": 0.3}, {"min_p": 0.0}, {"top_p": 0.3}, {"top_p": 0.8}, {}]
    rows = [_row(seed=i, **settings[i % len(settings)]) for i in range(900)]
    tokens = sampler(logits, rows).token_ids
    allowed = [{0, 1}, {0, 1, 2}, None, {0}, {0, 1, 2}, None]
    for i, token in enumerate(tokens):
        ok = allowed[i % len(settings)]
        if ok is not None:
            assert token in ok, (settings[i % len(settings)], token)
    assert {t for i, t in enumerate(tokens) if i % len(settings) == 2} >= {0, 1, 2, 3, 4}


def test_filter_keeps_at_least_one_token() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    out = _filter(logits, [_row(top_p=1e-9, min_p=1.0)])
    assert torch.isfinite(out).sum() >= 1


def test_unfiltered_row_is_left_alone_by_filter() -> None:
    """A row with top_k <= 0, top_p == 1 and min_p == 0 passes through ``_filter`` unchanged
    when it shares the batch with a row that filters (realistic vocabulary size)."""
    gen = torch.Generator().manual_seed(5)
    vocab = 151_936
    logits = torch.randn(2, vocab, generator=gen) * 3
    out = _filter(logits, [_row(), _row(top_k=50)])
    masked = int(torch.isinf(out[0]).sum())
    assert masked == 0, f"{masked} of {vocab} tokens masked in a row that asked for no filtering"
    assert int(torch.isfinite(out[1]).sum()) == 50


# ---- temperature ---------------------------------------------------------------------------


def test_temperature_near_zero_concentrates(sampler: Sampler) -> None:
    logits = torch.tensor([1.0, 1.5, 0.5, 1.4])
    assert set(_draws(sampler, logits, 500, temperature=0.01)) == {1}
    # at temperature 1 the others do show up
    assert len(set(_draws(sampler, logits, 500, temperature=1.0))) == 4


def test_high_temperature_flattens(sampler: Sampler) -> None:
    logits = torch.tensor([4.0, 0.0, 0.0, 0.0])
    cold = Counter(_draws(sampler, logits, 2000, temperature=0.5))
    hot = Counter(_draws(sampler, logits, 2000, temperature=50.0))
    assert cold[0] > 1950
    assert 400 < hot[0] < 650  # ~ e^0.08 / (e^0.08 + 3) = 0.27


# ---- penalties ------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(sampler: Sampler) -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    # token 0 is in the prompt: 2.0 / 1.2 = 1.67 < 1.9
    assert sampler(logits, [_row(prompt=(0,), temperature=0.0, repetition_penalty=1.2)]).token_ids == [1]
    # token 0 in the output counts too
    assert sampler(logits, [_row(prompt=(3,), output=(0,), temperature=0.0, repetition_penalty=1.2)]).token_ids == [1]
    # without it, the argmax stays
    assert sampler(logits, [_row(prompt=(3,), temperature=0.0, repetition_penalty=1.0)]).token_ids == [0]
    # negative logits are made more negative: -1.0 * 1.2 = -1.2 < -1.1
    neg = torch.tensor([[-1.0, -1.1, -5.0]])
    assert sampler(neg, [_row(prompt=(0,), temperature=0.0, repetition_penalty=1.2)]).token_ids == [1]
    # a penalty below 1 favours seen tokens: 1.9 / 0.5 = 3.8
    assert sampler(logits, [_row(prompt=(1,), temperature=0.0, repetition_penalty=0.5)]).token_ids == [1]


def test_frequency_penalty_scales_with_count(sampler: Sampler) -> None:
    logits = torch.tensor([[3.0, 2.0, 1.5, 0.0]])
    # token 0 seen once: 3.0 - 0.8 = 2.2 > 2.0
    assert sampler(logits, [_row(output=(0,), temperature=0.0, frequency_penalty=0.8)]).token_ids == [0]
    # seen twice: 3.0 - 1.6 = 1.4 < 2.0
    assert sampler(logits, [_row(output=(0, 0), temperature=0.0, frequency_penalty=0.8)]).token_ids == [1]
    # negative frequency penalty encourages repeats: 1.5 + 2 * 1.0 = 3.5
    assert sampler(logits, [_row(output=(2, 2), temperature=0.0, frequency_penalty=-1.0)]).token_ids == [2]


def test_presence_penalty_is_flat(sampler: Sampler) -> None:
    logits = torch.tensor([[3.0, 2.0, 1.5, 0.0]])
    # 3.0 - 0.8 = 2.2 > 2.0, however often token 0 was produced
    assert sampler(logits, [_row(output=(0,) * 5, temperature=0.0, presence_penalty=0.8)]).token_ids == [0]
    # 3.0 - 1.2 = 1.8 < 2.0
    assert sampler(logits, [_row(output=(0,), temperature=0.0, presence_penalty=1.2)]).token_ids == [1]


def test_frequency_and_presence_ignore_the_prompt(sampler: Sampler) -> None:
    logits = torch.tensor([[3.0, 2.0, 1.5, 0.0]])
    row = _row(prompt=(0, 0, 0), temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
    assert sampler(logits, [row]).token_ids == [0]


def test_penalties_do_not_leak_between_rows(sampler: Sampler) -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    rows = [_row(output=(0,), temperature=0.0, presence_penalty=2.0), _row(output=(0,), temperature=0.0)]
    assert sampler(logits, rows).token_ids == [1, 0]
    assert logits[0, 0] == 3.0  # the caller's logits are not modified


def test_penalties_shift_sampled_choices(sampler: Sampler) -> None:
    logits = torch.zeros(8)
    counts = Counter(_draws(sampler, logits, 2000, output=(0, 0, 1), frequency_penalty=2.0))
    # token 0: weight e^-4, token 1: e^-2, others e^0
    assert counts[0] < 20
    assert counts[1] < 80
    assert all(counts[t] > 200 for t in range(2, 8))


# ---- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution(sampler: Sampler) -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 40, generator=gen) * 2
    rows = [
        _row(logprobs=True, top_logprobs=5, temperature=0.0),
        _row(logprobs=True, top_logprobs=20, temperature=0.3, seed=1, repetition_penalty=2.0, prompt=(1, 2, 3)),
        _row(logprobs=True, top_logprobs=0, seed=2, top_k=3, frequency_penalty=1.0, output=(4, 4)),
        _row(logprobs=False, seed=3),
    ]
    out = sampler(logits.clone(), rows)
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i, (row, token, lp) in enumerate(zip(rows, out.token_ids, out.logprobs, strict=True)):
        if not row.params.logprobs:
            assert lp is None
            continue
        assert lp is not None
        assert lp.logprob == pytest.approx(ref[i, token].item(), abs=1e-5)
        n = row.params.top_logprobs
        assert len(lp.top_ids) == len(lp.top_logprobs) == n
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        if n:
            values, ids = ref[i].topk(n)
            assert list(lp.top_ids) == ids.tolist()
            assert lp.top_logprobs == pytest.approx(values.tolist(), abs=1e-5)
            for tid, value in zip(lp.top_ids, lp.top_logprobs, strict=True):
                assert value == pytest.approx(ref[i, tid].item(), abs=1e-5)
    # greedy row: the chosen token is the best one
    assert out.logprobs[0] is not None
    assert out.logprobs[0].top_ids[0] == out.token_ids[0]
    assert out.logprobs[0].logprob == pytest.approx(out.logprobs[0].top_logprobs[0])


def test_logprobs_are_normalised(sampler: Sampler) -> None:
    logits = torch.tensor([[10.0, 10.0, -100.0, 0.0]])
    out = sampler(logits, [_row(logprobs=True, top_logprobs=4, temperature=0.0)])
    lp = out.logprobs[0]
    assert lp is not None
    assert math.fsum(math.exp(v) for v in lp.top_logprobs) == pytest.approx(1.0, abs=1e-5)
    assert lp.logprob == pytest.approx(math.log(0.5), abs=1e-4)
    assert set(lp.top_ids[:2]) == {0, 1}
    assert lp.top_ids[2:] == (3, 2)


def test_no_logprobs_requested(sampler: Sampler) -> None:
    out = sampler(torch.randn(3, 10), [_row(), _row(temperature=0.0), _row(seed=1)])
    assert out.logprobs == [None, None, None]
    assert all(0 <= t < 10 for t in out.token_ids)


def test_min_new_tokens_masks_the_end_tokens_below_the_floor() -> None:
    """Below ``min_new_tokens`` the model's end tokens (unless ``ignore_eos``) and the stop
    tokens cannot be drawn, greedy or sampled, on the host or the device path; from the floor
    on they can; the reported log-probabilities stay the raw distribution's."""
    sampler = Sampler(CPU, frozenset({2}))
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])  # 2 (end) > 3 > 4 > 1 > 0

    def draw(output: tuple[int, ...], **params: Any) -> int:
        row = _row(output=output, temperature=0.0, max_new_tokens=8, **params)
        on_device = sampler.sample_on_device(logits.clone(), [row])
        host = sampler(logits.clone(), [row]).token_ids
        assert on_device is not None and on_device.tolist() == host
        return host[0]

    assert draw((), min_new_tokens=2) == 3
    assert draw((7,), min_new_tokens=2) == 3
    assert draw((7, 7), min_new_tokens=2) == 2  # the floor is reached
    assert draw((), min_new_tokens=2, stop_token_ids=(3,)) == 4
    assert draw((), min_new_tokens=2, ignore_eos=True) == 2  # the end does not end it: allowed
    assert draw((), min_new_tokens=2, ignore_eos=True, stop_token_ids=(2,)) == 3
    hot = _row(temperature=1.0, seed=5, max_new_tokens=8, min_new_tokens=1)
    assert all(sampler(logits.clone(), [hot]).token_ids[0] != 2 for _ in range(50))
    scored = _row(temperature=0.0, max_new_tokens=8, min_new_tokens=1, logprobs=True, top_logprobs=1)
    out = sampler(logits.clone(), [scored])
    assert out.token_ids == [3]
    assert out.logprobs[0] is not None and out.logprobs[0].top_ids == (2,)  # the raw distribution's best


def test_allowed_token_ids_keep_only_those() -> None:
    """vLLM's allowed_token_ids: greedy and sampled rows draw among them only, on the host and
    the device path; a row without them in the same batch is untouched."""
    sampler = Sampler(CPU)
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]] * 3)
    rows = [
        _row(temperature=0.0, allowed_token_ids=(0, 1)),
        _row(temperature=0.0),
        _row(temperature=1.0, seed=3, allowed_token_ids=(4,)),
    ]
    assert sampler(logits.clone(), rows).token_ids == [1, 2, 4]
    on_device = sampler.sample_on_device(logits.clone(), rows)
    assert on_device is not None and on_device.tolist() == [1, 2, 4]
    many = [_row(temperature=2.0, seed=i, allowed_token_ids=(0, 3)) for i in range(40)]
    assert set(sampler(logits[:1].expand(40, -1).clone(), many).token_ids) == {0, 3}
