"""The load-or-recompute rule of the KV tiers (``engine/kv_cost.py``), with numbers."""

from __future__ import annotations

import pytest

from pdserve.engine import kv_cost
from pdserve.engine.kv_cost import (
    CostEstimates,
    Decision,
    marginal_cost,
    overlap_split,
    pages_worth_loading,
    prefill_model,
)

PAGE_BYTES = 1 << 20  # 1 MiB a page
PAGE_TOKENS = 16


def estimates(prefill_us_per_token: float, **mib_per_s: float) -> CostEstimates:
    """Estimates from one prefill reading (microseconds a token) and one load reading a tier
    (MiB a second)."""
    e = CostEstimates()
    e.note_prefill(1000, prefill_us_per_token * 1000 / 1e6)
    for tier, rate in mib_per_s.items():
        e.note_load(tier, 1 << 20, 1.0 / rate)
    return e


def test_a_fast_tier_is_loaded_whole() -> None:
    # host: 1 MiB in 0.1 ms; computing a page: 16 x 1 ms
    d = pages_worth_loading([("host", 10)], PAGE_BYTES, PAGE_TOKENS, estimates(1000.0, host=10_000))
    assert d.pages == 10 and d.saved_seconds == pytest.approx(10 * (0.016 - 0.0001))


def test_a_tier_slower_than_computing_is_declined() -> None:
    # a GPU that computes a page in 16 x 23 us, a disk at 1 GB/s (a page in ~1 ms)
    d = pages_worth_loading([("disk", 8)], PAGE_BYTES, PAGE_TOKENS, estimates(23.0, disk=1000))
    assert d == Decision(0, 0.0)


def test_a_fast_run_before_a_slow_one_is_loaded_and_the_slow_one_computed() -> None:
    e = estimates(23.0, host=20_000, store=500)
    d = pages_worth_loading([("host", 4), ("store", 8)], PAGE_BYTES, PAGE_TOKENS, e)
    assert d.pages == 4 and d.saved_seconds is not None and d.saved_seconds > 0


def test_a_slow_run_before_a_fast_one_is_taken_when_the_whole_pays() -> None:
    # a page of store costs 0.2 ms more than computing it, a page of host saves 0.35 ms:
    # two store pages and four host pages save more than none
    e = CostEstimates(
        bytes_per_s={"store": PAGE_BYTES / 0.0006, "host": PAGE_BYTES / 0.00005},
        prefill_s_per_token=0.0004 / PAGE_TOKENS,
    )
    d = pages_worth_loading([("store", 2), ("host", 4)], PAGE_BYTES, PAGE_TOKENS, e)
    assert d.pages == 6 and d.saved_seconds == pytest.approx(4 * 0.00035 - 2 * 0.0002)


def test_break_even_is_declined() -> None:
    e = CostEstimates(bytes_per_s={"disk": PAGE_BYTES / 0.001}, prefill_s_per_token=0.001 / PAGE_TOKENS)
    assert pages_worth_loading([("disk", 3)], PAGE_BYTES, PAGE_TOKENS, e).pages == 0


def test_unmeasured_inputs_load_to_measure() -> None:
    assert pages_worth_loading([("disk", 5)], PAGE_BYTES, PAGE_TOKENS, CostEstimates()) == Decision(5, None)
    e = estimates(1000.0, host=10_000)  # disk not measured yet, behind a host run that pays
    assert pages_worth_loading([("host", 2), ("disk", 3)], PAGE_BYTES, PAGE_TOKENS, e) == Decision(5, None)
    # a prefix's groups come a run each: an unmeasured tier is loaded whole, not its first group
    e = estimates(1000.0)
    assert pages_worth_loading([("disk", 8)] * 16, PAGE_BYTES, PAGE_TOKENS, e) == Decision(128, None)
    e = estimates(23.0, disk=100)  # a losing disk run, then an unmeasured store: stop before it
    assert pages_worth_loading([("disk", 2), ("store", 3)], PAGE_BYTES, PAGE_TOKENS, e).pages == 0


def test_a_disk_or_store_is_not_loaded_before_it_is_measured() -> None:
    """Named in ``measure_first``: no rate, no load (its pages are computed); a memory tier
    before it that pays is still loaded."""
    e = estimates(1000.0, host=10_000)
    d = pages_worth_loading([("host", 2), ("store", 8)], PAGE_BYTES, PAGE_TOKENS, e, {"disk", "store"})
    assert d.pages == 2 and d.unmeasured == ("store",)
    d = pages_worth_loading([("disk", 8)] * 4, PAGE_BYTES, PAGE_TOKENS, estimates(1000.0), {"disk"})
    assert d == Decision(0, 0.0, ("disk",))
    # measured, it is priced like any tier
    d = pages_worth_loading([("disk", 8)], PAGE_BYTES, PAGE_TOKENS, estimates(1000.0, disk=10_000), {"disk"})
    assert d.pages == 8 and d.unmeasured == ()


def test_nothing_found_loads_nothing() -> None:
    assert pages_worth_loading([], PAGE_BYTES, PAGE_TOKENS, CostEstimates()) == Decision(0, 0.0)


def test_the_estimates_follow_readings_and_ignore_empty_ones() -> None:
    e = CostEstimates()
    e.note_load("disk", 1000, 0.001)
    e.note_load("disk", 0, 1.0)  # nothing moved: no reading
    e.note_load("disk", 1000, 0.0)  # no time: no reading
    assert e.bytes_per_s["disk"] == pytest.approx(1e6)
    e.note_load("disk", 1000, 0.002)
    assert 5e5 < e.bytes_per_s["disk"] < 1e6  # moved toward the new reading, smoothed
    assert e.load_seconds("store", 10) is None and e.recompute_seconds(10) is None


def test_the_prefill_rate_is_the_marginal_cost_of_a_token() -> None:
    """A chat's later turns compute a short message beside a loaded prefix: a 36-token step
    that costs mostly its fixed part must not make the prefix look dear to compute (it did:
    on an H200 the disk tier was loaded at 4x the cost of computing, 2026-12-04)."""
    e = CostEstimates()
    e.note_prefill(8224, 0.25)  # turn 0: a whole 8,192-token context, ~30 us a token
    for _ in range(8):
        e.note_prefill(36, 0.015)  # later turns: a short message, ~420 us a token
    assert e.prefill_s_per_token == pytest.approx((0.25 - 0.015) / (8224 - 36), rel=1e-6)
    # a disk at 400 MB/s (a 1 MiB page in 2.6 ms) against computing its 16 tokens (0.46 ms)
    e.note_load("disk", PAGE_BYTES, 0.0026)
    assert pages_worth_loading([("disk", 8)], PAGE_BYTES, PAGE_TOKENS, e) == Decision(0, 0.0)


def test_the_marginal_cost_without_a_spread_of_sizes() -> None:
    assert marginal_cost([]) == 0.0
    # one size only: the cheapest rate, an upper bound (the fixed part is in it)
    assert marginal_cost([(36, 0.015)] * 4) == pytest.approx(0.015 / 36)
    assert marginal_cost([(2048, 0.05), (2048, 0.06)]) == pytest.approx(0.05 / 2048)
    # noisy readings whose slope comes out negative: the cheapest large step's rate
    assert marginal_cost([(1024, 0.05), (4096, 0.04)]) == pytest.approx(0.04 / 4096)
    # a slope above a reading's own rate (a negative fixed part) is capped by that rate
    assert marginal_cost([(100, 0.001), (1000, 0.1)]) == pytest.approx(0.001 / 100)


def chunk(n: int, before: int) -> float:
    """The (query, key) pairs of a chunk of ``n`` tokens after ``before`` computed ones."""
    return n * (before + n / 2)


# a 7B model on an H200, as its turns measured (2026-12-05): 5 ms a step, 18.7 us a token, and
# 2.7 ns a pair attended (a 2,048-token prompt 49 ms, an 8,192-token one 249 ms)
FIXED, A, B = 0.005, 18.7e-6, 2.7e-9


def timed(n: int, before: int) -> tuple[int, float, float]:
    return n, FIXED + A * n + B * chunk(n, before), chunk(n, before)


def test_the_prefill_model_tells_the_attention_s_share_apart() -> None:
    """The probes a worker runs at start (256, 1024, and 4,096 tokens in two chunks of 2,048)
    give both terms back; the later tokens of a long prefix then cost more than the first, so
    an 8,192-token prefix is priced near what computing it takes (249 ms; one term: 153 ms)."""
    readings = [timed(256, 0), timed(1024, 0), timed(2048, 0), timed(2048, 2048)]
    a, b = prefill_model(readings)
    assert a == pytest.approx(A, rel=1e-6) and b == pytest.approx(B, rel=1e-6)
    e = CostEstimates()
    for t, sec, pairs in readings:
        e.note_prefill(t, sec, pairs)
    assert e.recompute_seconds(8192) == pytest.approx(A * 8192 + B * 8192 * 4096, rel=1e-6)
    assert e.recompute_seconds(8192) == pytest.approx(0.244, abs=0.001)
    late, early = e.recompute_seconds(2048, start=6144), e.recompute_seconds(2048)
    assert late is not None and early is not None and late > 1.5 * early
    # a disk at 2 GB/s (a 16-token page of 7B KV, 0.9 MB, in 0.46 ms): dearer than computing a
    # prefix's first pages, cheaper than its last ones
    page = 917504
    e.note_load("disk", page, page / 2e9)
    assert pages_worth_loading([("disk", 128)], page, PAGE_TOKENS, e).pages == 0
    assert pages_worth_loading([("disk", 128)], page, PAGE_TOKENS, e, start_tokens=6144).pages == 128


def test_the_prefill_model_keeps_one_term_where_the_steps_cannot_tell_two() -> None:
    linear = [(t, FIXED + A * t) for t in (256, 1024, 4096)]
    # no pairs known (0): the marginal cost alone
    assert prefill_model([(t, sec, 0.0) for t, sec in linear]) == (marginal_cost(linear), 0.0)
    # two readings only, or sizes too close together
    assert prefill_model([timed(256, 0), timed(1024, 0)])[1] == 0.0
    assert prefill_model([timed(1000, 0), timed(1100, 0), timed(1200, 0)])[1] == 0.0
    # pairs in proportion to tokens (every chunk after the same context): no second term
    assert prefill_model([timed(256, 100_000), timed(1024, 100_000), timed(2048, 100_000)])[1] == 0.0
    # noise that makes the attention's share negative: the one-term fit
    noisy = [(256, 0.010, chunk(256, 0)), (1024, 0.030, chunk(1024, 0)), (4096, 0.070, chunk(4096, 0))]
    assert prefill_model(noisy) == (marginal_cost([(t, sec) for t, sec, _ in noisy]), 0.0)


def test_a_slower_tier_loads_a_tail_while_the_head_is_computed() -> None:
    # computing a page: 16 x 62.5 us = 1 ms; the disk: a page in 2 ms (512 MiB/s)
    e = estimates(62.5, disk=512)
    split = overlap_split([("disk", 30)], PAGE_BYTES, PAGE_TOKENS, e)
    assert split is not None and (split.head, split.tail) == (20, 10)  # both take 20 ms, against 30
    assert split.seconds == pytest.approx(0.020) and split.saved == pytest.approx(0.010)
    # a disk as fast as computing (which the up-front rule declines: it saves nothing) halves the time
    split = overlap_split([("disk", 30)], PAGE_BYTES, PAGE_TOKENS, estimates(62.5, disk=1024))
    assert split is not None and (split.head, split.tail) == (15, 15) and split.seconds == pytest.approx(0.015)
    # 6 ms of loads queued ahead of it (one loader serves them in turn): a shorter tail
    split = overlap_split([("disk", 30)], PAGE_BYTES, PAGE_TOKENS, estimates(62.5, disk=512), queued=0.006)
    assert split is not None and (split.head, split.tail) == (22, 8) and split.load == pytest.approx(8 / 512)
    # two tiers: the tail's pages are priced at their own tier's rate
    split = overlap_split([("disk", 10), ("store", 20)], PAGE_BYTES, PAGE_TOKENS, estimates(62.5, disk=512, store=256))
    assert split is not None and split.head + split.tail == 30 and split.seconds <= 0.030 * 0.8


def test_no_split_where_nothing_is_measured_or_nothing_hides() -> None:
    assert overlap_split([("disk", 8)], PAGE_BYTES, PAGE_TOKENS, CostEstimates()) is None  # nothing measured
    assert overlap_split([("disk", 8)], PAGE_BYTES, PAGE_TOKENS, estimates(62.5)) is None  # the disk not measured
    # a page's load takes longer than computing all eight: not one page is worth it
    assert overlap_split([("disk", 8)], PAGE_BYTES, PAGE_TOKENS, estimates(62.5, disk=100)) is None
    assert overlap_split([], PAGE_BYTES, PAGE_TOKENS, estimates(62.5, disk=512)) is None


def test_the_prefill_probes_spread_within_a_small_pool() -> None:
    """A worker times its prefill at start at sizes far enough apart to fit a slope (one size
    priced a page by a step's fixed part as well, and a store slower than computing was loaded
    at 512 tokens on an H200): all the probes where they fit, else a quarter, a half and all
    of what fits (on a GPU, three sizes, for the attention's term)."""
    from pdserve.engine.engine import PREFILL_PROBES, probe_sizes

    assert probe_sizes(6144, gpu=True) == list(PREFILL_PROBES)
    assert probe_sizes(6144, gpu=False) == list(PREFILL_PROBES[:3])
    assert probe_sizes(384, gpu=True) == [96, 192, 384]
    assert probe_sizes(1536, gpu=True) == [384, 768, 1536]
    assert probe_sizes(1536, gpu=False) == [64, 256, 1024]
    assert probe_sizes(512, gpu=False) == [128, 512]
    assert probe_sizes(63, gpu=True) == []
    for limit in (64, 384, 1536, 4095):
        sizes = probe_sizes(limit, gpu=True)
        assert max(sizes) <= limit and max(sizes) >= 2 * min(sizes)  # a spread kv_cost's fit takes


def test_a_negative_fixed_part_keeps_the_attention_s_term() -> None:
    """Steps whose full fit comes out with a negative fixed part (a short probe timed a little
    fast) are fitted through the origin, both terms kept: the dearest pages of a long prefix
    are priced near their cost, not at the one-term slope (which there priced an 8,192-token
    prefix's last page below a disk's load, and a restarted worker computed the prefix)."""
    readings = [timed(256, 0), timed(1024, 0), timed(2048, 0), timed(2048, 2048)]
    readings = [(t, sec - FIXED, p) for t, sec, p in readings]  # no fixed part,
    readings[0] = (readings[0][0], readings[0][1] - 0.0005, readings[0][2])  # and the first fast
    a, b = prefill_model(readings)
    assert a == pytest.approx(A, rel=0.05) and b == pytest.approx(B, rel=0.05)
    dearest = 16 * (a + b * 8192)
    assert dearest == pytest.approx(16 * (A + B * 8192), rel=0.02)
    one_term = marginal_cost([(t, sec) for t, sec, _ in readings])
    assert 16 * one_term < dearest / 2


def test_a_step_that_paid_one_time_costs_is_not_a_reading() -> None:
    """A fresh process on an H100 (2026-12-06, 7B dimensions): probes of 96, 192 and 384 tokens,
    then its first 544-token step at 60 ms (that shape's first kernels). Fitted with it, a token
    cost 25 us and a 512-token prefix in a store at 2.8 GB/s looked cheaper to load than to
    compute (the load took 1.58x the cold time); without it, 4.6 us, and the load is declined
    (the two faster probes show the step's floor, which bounds what computing 32 fewer of the
    prompt's 544 tokens saves). A steady step is kept however much larger it is, and of two
    steps alike the slower one goes."""
    from pdserve.engine.kv_cost import steady

    def fresh(tokens: int, ms: float) -> tuple[int, float, float]:
        return tokens, ms / 1e3, tokens * tokens / 2

    probes = [fresh(96, 8.519), fresh(192, 8.407), fresh(384, 9.735)]
    first = fresh(544, 59.76)
    assert steady([*probes, first]) == probes
    a, b = prefill_model([*probes, first])
    assert a == pytest.approx(4.6e-6, rel=0.05) and b == 0.0
    page_bytes = 28 * 2 * 4 * 128 * 16 * 2  # a 16-token page of Qwen2.5-7B's KV in bf16
    e = CostEstimates()
    for r in (*probes, first):
        e.note_prefill(*r)
    e.note_load("store", page_bytes * 32, page_bytes * 32 / 2.8e9)
    assert e.measure_floor()  # (the probes', as a worker takes it at start)
    assert pages_worth_loading([("store", 32)], page_bytes, 16, e, {"store"}, end_tokens=544).pages == 0
    # nor for the estimates' line: alone above the floor, that step priced a token at 117 us (a
    # restarted worker's disk, 2026-12-06), where the 384-token probe's rate is 25
    assert e.prefill_s_per_token == pytest.approx(9.735e-3 / 384)
    big = [fresh(2048, 42.0), fresh(8192, 250.0)]  # 4x the tokens, 16x the pairs: 6x the time
    assert steady(big) == big
    twins = [(1024, 0.020, 0.0), (1024, 0.035, 0.0), (1024, 0.021, 0.0)]
    assert steady(twins) == [twins[0], twins[2]]


def test_steady_is_the_rule_it_states_on_random_readings() -> None:
    """Against the rule written out a reading at a time: kept unless a reading with no more
    tokens and pairs, scaled by the larger growth and ONE_TIME, is faster still; and steady
    again on its own output changes nothing."""
    import random

    from pdserve.engine.kv_cost import ONE_TIME, steady

    def by_hand(readings: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
        kept = []
        for i, (t, s, p) in enumerate(readings):
            bounds = [
                s2 * max(t / t2, p / p2 if p > 0 and p2 > 0 else 0.0) * ONE_TIME
                for j, (t2, s2, p2) in enumerate(readings)
                if j != i and t2 <= t and p2 <= p
            ]
            if not bounds or s <= min(bounds):
                kept.append((t, s, p))
        return kept

    rng = random.Random(3)
    for _ in range(200):
        readings = []
        for _ in range(rng.randint(0, 12)):
            t = rng.choice([16, 64, 256, 1024, 2048])
            p = rng.choice([0.0, t * t / 2, t * (t / 2 + rng.randint(0, 4096))])
            readings.append((t, (t * 1e-5 + 0.008) * rng.choice([1.0, 1.0, 1.2, 3.0, 8.0]), p))
        kept = steady(readings)
        assert kept == by_hand(readings)
        # its own output it keeps whole (a dropped reading only loosens the others' bounds), so a
        # fit of readings already steady need not ask again
        assert steady(kept) == kept
        assert kv_cost.prefill_line(readings) == kv_cost.prefill_line(kept, is_steady=True)
        assert kv_cost.spreads(readings) == kv_cost.spreads(kept, is_steady=True)


def test_the_prefill_is_fitted_when_read_not_at_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's reading is only kept; the fit (~0.1 ms of the interpreter) runs once, when the
    rule next reads the estimate, over every reading since, and gives what fitting each gives."""
    from pdserve.engine import kv_cost

    fits: list[int] = []
    fit = kv_cost.prefill_line
    monkeypatch.setattr(
        kv_cost, "prefill_line", lambda readings, *steady: (fits.append(len(readings)), fit(readings, *steady))[1]
    )
    e = CostEstimates()
    steps = [(36, 0.015, 36 * 18.0), (2048, 0.05, 2048 * 1024.0), (8224, 0.25, 8224 * 4112.0), (512, 0.02, 512 * 256.0)]
    for tokens, seconds, pairs in steps:
        e.note_prefill(tokens, seconds, pairs)
    assert fits == []
    assert (e.prefill_fixed_s, e.prefill_s_per_token, e.prefill_s_per_pair) == fit(steps) and fits == [len(steps)]
    assert e.recompute_seconds(16) is not None and fits == [len(steps)]  # fitted once until a new reading
    e.prefill_s_per_pair = 0.0  # a value set stays (the readings before it were fitted first)
    assert e.prefill_s_per_pair == 0.0 and fits == [len(steps)]


def test_readings_of_one_size_keep_the_line_measured_when_they_spread() -> None:
    """A worker's start-up probes spread in size and give a line; a chat's turns, all of one
    length, then push them out: the line stays, not the turns' whole rate (their fixed part
    in it). A worker that never saw sizes spread has the cheapest step's rate, its upper bound."""
    e = CostEstimates()
    for tokens, ms in ((256, 12.0), (1024, 26.0), (4096, 90.0)):
        e.note_prefill(tokens, ms / 1e3)
    line = (e.prefill_fixed_s, e.prefill_s_per_token)
    assert line[1] == pytest.approx(20.5e-6, rel=0.02) and line[0] == pytest.approx(6.0e-3, rel=0.02)
    for _ in range(kv_cost.READINGS):
        e.note_prefill(2080, 0.05)
    assert (e.prefill_fixed_s, e.prefill_s_per_token) == line  # the turns' own rate: 24 us a token
    fresh = CostEstimates()
    fresh.note_prefill(2080, 0.05)
    assert (fresh.prefill_fixed_s, fresh.prefill_s_per_token) == (0.0, pytest.approx(0.05 / 2080))
    e.note_prefill(8224, 0.25)  # sizes spread again: a new line
    assert e.prefill_s_per_token != line[1]


def test_of_probes_timed_twice_each_size_s_fastest_is_kept_and_shows_the_floor() -> None:
    """A restarted worker's probes on an H100 in one timed round: 96, 192 and 384 tokens in
    36.7, 19.1 and 28.0 ms (a slow spell of the host), no floor, and its disk loaded 512-token
    prefixes at 1.7x a fresh process's computing them (2026-12-07). With a second round at the
    usual ~10 ms, each size's fastest reading is kept, in its place, and the floor shows."""
    e = CostEstimates()
    slow = [(96, 36.7e-3, 4608.0), (192, 19.1e-3, 18432.0), (384, 28.0e-3, 73728.0)]
    usual = [(96, 10.0e-3, 4608.0), (192, 20.5e-3, 18432.0), (384, 10.6e-3, 73728.0)]
    for r in slow:
        e.note_prefill(*r)
    assert not e.measure_floor()
    for r in usual:
        e.note_prefill(*r)
    e.keep_fastest()
    assert list(e.prefill_readings) == [usual[0], slow[1], usual[2]]
    assert e.measure_floor() and e.prefill_floor_s == pytest.approx(10.0e-3, rel=0.1)
    again = list(e.prefill_readings)
    e.keep_fastest()  # nothing left to merge
    assert list(e.prefill_readings) == again
    e.note_prefill(96, 9.0e-3, 1000.0)  # another size of pairs (a chunk after others) is another reading
    e.keep_fastest()
    assert len(e.prefill_readings) == 4


def test_the_floor_of_a_step_bounds_what_a_load_saves() -> None:
    """On an H100 a 7B model's prefill steps of 96 to 384 tokens all took ~10 ms (the host's
    launches), one of 544 tokens 14-15: loading 480 of a chat turn's 548 tokens saves the ~5 ms
    above that floor, not 480 tokens at a line's rate. Probes at the floor gave a line of
    0.3 us a token, and the rule declined even host memory; the turns' own rate (27 us) would
    load a disk's 480 tokens as if they saved 13 ms. Measured once, the floor stays while the
    turns push the probes out (none of them is at it), and bounds the saving: host memory loads
    all 480 tokens, the disk none (its run is loaded whole or not at all)."""
    e = CostEstimates()
    for tokens, ms in ((96, 10.0), (192, 10.1), (384, 10.6)):
        e.note_prefill(tokens, ms / 1e3, tokens * tokens / 2)
    assert e.prefill_floor_s == 0.0  # read from the start-up probes only, when asked
    assert e.measure_floor()
    floor = (e.prefill_floor_s, e.prefill_floor_s_per_token)
    assert floor[0] == pytest.approx(9.83e-3, rel=0.01) and floor[1] == pytest.approx(2.0e-9 * 1000, rel=0.1)
    for _ in range(kv_cost.READINGS):
        e.note_prefill(548, 0.0148, 548 * 274)
    assert (e.prefill_floor_s, e.prefill_floor_s_per_token) == floor
    # computing 64 of the 544 tokens takes the floor's 9.96 ms: loading 480 saves ~4.7 ms
    assert e.headroom_seconds(0, 544, 480) == pytest.approx(0.0148 * 544 / 548 - e.floor_seconds(64), rel=0.02)
    assert e.headroom_seconds(0, None) == float("inf")
    # a chat's steps that look flat (a chunk, a noisy spell) set no floor: one at a whole turn's
    # time declined host memory (1.04x no tier on an H100)
    chat = CostEstimates()
    turns = [(270, 0.0146, 270 * 135.0), (560, 0.0147, 560 * 280.0), (600, 0.0150, 600 * 300.0)]
    for r in turns:
        chat.note_prefill(*r)
    assert kv_cost.prefill_floor(turns) is not None and chat.prefill_floor_s == 0.0
    page = 28 * 2 * 4 * 128 * 16 * 2  # a 16-token page of Qwen2.5-7B's KV in bf16
    e.note_load("host", page * 30, page * 30 / 60e9)
    e.note_load("disk", page * 30, page * 30 / 6.3e9)
    host = pages_worth_loading([("host", 30)], page, 16, e, {"disk"}, 0, 544)
    assert host.pages == 30 and host.saved_seconds == pytest.approx(e.headroom_seconds(0, 544, 480) - page * 30 / 60e9)
    assert pages_worth_loading([("disk", 4)] * 7 + [("disk", 2)], page, 16, e, {"disk"}, 0, 544).pages == 0
    assert pages_worth_loading([("disk", 30)], page, 16, e, {"disk"}).pages == 30  # unbounded: 13 ms "saved"
    assert kv_cost.some_run_pays(e, "disk", page * 4, 64, 0, 8, 544)  # (a lookup asks: a part could pay)
    e.bytes_per_s["disk"] = 1.5e9  # a slower disk: no part of it pays
    assert not kv_cost.some_run_pays(e, "disk", page * 4, 64, 0, 8, 544)


def test_a_run_is_loaded_whole_or_not_at_all() -> None:
    """Past the page whose loading leaves the step at its floor, each further page only adds
    its load (less the floor's own slope): a tier's run is still weighed whole, its groups one
    run (a part cut near the floor, where neither the step's time nor a short load's is well
    measured, was measured slower than computing on an H100)."""
    e = CostEstimates(
        bytes_per_s={"disk": PAGE_BYTES / 0.0002, "host": PAGE_BYTES / 0.000005},
        prefill_s_per_token=2e-5,
        prefill_floor_s=0.01,
    )
    end = 100 * PAGE_TOKENS  # 32 ms computed whole: 22 above the floor
    # the disk's 100 pages: 20 ms of loads (25 weighed) against 22 saved: not loaded, though its
    # first 69 would save 8 by the estimate
    assert pages_worth_loading([("disk", 4)] * 25, PAGE_BYTES, PAGE_TOKENS, e, {"disk"}, end_tokens=end).pages == 0
    assert pages_worth_loading([("disk", 100)], PAGE_BYTES, PAGE_TOKENS, e, (), end_tokens=end).pages == 100  # 20 < 22
    host = pages_worth_loading([("host", 100)], PAGE_BYTES, PAGE_TOKENS, e, {"disk"}, end_tokens=end)
    assert host.pages == 100 and host.saved_seconds == pytest.approx(0.022 - 0.0005)
    # host memory's pages, then the disk's: the host's alone
    d = pages_worth_loading([("host", 50), ("disk", 50)], PAGE_BYTES, PAGE_TOKENS, e, {"disk"}, end_tokens=end)
    assert d.pages == 50


def test_with_cut_runs_a_tier_s_leading_groups_load_where_they_save_the_most() -> None:
    """``cut_runs``: a tier's groups in a row may be taken in part, the leading ones, at the
    part that saves the most (ties: fewer); where the whole saves the most, the whole; a part
    of a later tier only after the earlier tiers' pages whole; the same saving as
    :func:`some_run_pays` finds for the groups' leading run."""
    from pdserve.engine.kv_cost import some_run_pays

    e = CostEstimates(
        bytes_per_s={"disk": PAGE_BYTES / 0.0002, "host": PAGE_BYTES / 0.000005},
        prefill_s_per_token=2e-5,
        prefill_floor_s=0.01,
    )
    end = 100 * PAGE_TOKENS  # 32 ms computed whole: 22 above the floor
    groups = [("disk", 4)] * 25
    whole = pages_worth_loading(groups, PAGE_BYTES, PAGE_TOKENS, e, {"disk"}, end_tokens=end)
    cut = pages_worth_loading(groups, PAGE_BYTES, PAGE_TOKENS, e, {"disk"}, end_tokens=end, cut_runs=True)
    assert whole.pages == 0 and cut.pages > 0 and cut.pages % 4 == 0 and cut.saved_seconds > 0
    # the part that saves the most, of every leading part (a group a step)
    savings = {}
    for g in range(1, 26):
        pages = 4 * g
        computed = min(pages * PAGE_TOKENS * 2e-5, e.headroom_seconds(0, end, pages * PAGE_TOKENS))
        savings[pages] = computed - (e.load_seconds("disk", pages * PAGE_BYTES) or 0.0) * kv_cost.GROUP_LOAD_MARGIN
    best = max(savings, key=lambda pages: (savings[pages], -pages))
    assert cut.pages == best and cut.saved_seconds == pytest.approx(savings[best])
    assert some_run_pays(e, "disk", 4 * PAGE_BYTES, 4 * PAGE_TOKENS, 0, 25, end)
    # host memory's pages as far as the step's floor (69 leave 31 computed: 10 ms), not past it
    host = pages_worth_loading([("host", 1)] * 100, PAGE_BYTES, PAGE_TOKENS, e, {"disk"}, end_tokens=end, cut_runs=True)
    assert host.pages == 69 and host.saved_seconds > 0.022 - 0.0005  # more than the whole's
    # the host's pages, then the disk's: the host's whole, then a part of the disk's
    mixed = [("host", 1)] * 20 + [("disk", 4)] * 20
    d = pages_worth_loading(mixed, PAGE_BYTES, PAGE_TOKENS, e, {"disk"}, end_tokens=end, cut_runs=True)
    assert d.pages > 20 and (d.pages - 20) % 4 == 0
    assert pages_worth_loading(mixed, PAGE_BYTES, PAGE_TOKENS, e, {"disk"}, end_tokens=end).pages == 20
    # a tier not measured yet: no part of it weighed (loaded whole to measure it, as without)
    blind = CostEstimates(prefill_s_per_token=2e-5, prefill_floor_s=0.01)
    assert (
        pages_worth_loading([("mem", 4)] * 3, PAGE_BYTES, PAGE_TOKENS, blind, (), end_tokens=end, cut_runs=True).pages
        == 12
    )


def test_cut_runs_weigh_a_few_parts_and_find_what_every_part_weighed_finds() -> None:
    """With ``cut_runs`` the rule weighs a few leading parts of each run (the first, those
    either side of where the computing reaches the step's floor, those past each chunk
    boundary, the whole), not every one; on random estimates and runs (host pages one by one,
    groups of a disk, a store's) it finds the same best part as weighing every part does:
    the decision for each leading part, taken whole, compared."""
    import random

    rng = random.Random(11)
    checked = 0
    for _ in range(400):
        e = CostEstimates(
            bytes_per_s={
                "disk": PAGE_BYTES / rng.uniform(20e-6, 400e-6),
                "host": PAGE_BYTES / rng.uniform(2e-6, 20e-6),
            },
            prefill_s_per_token=rng.uniform(0.2e-6, 4e-6),
            prefill_s_per_pair=rng.choice([0.0, rng.uniform(1e-10, 1e-8)]),
            prefill_floor_s=rng.choice([0.0, rng.uniform(1e-3, 20e-3)]),
            prefill_fixed_s=rng.choice([0.0, rng.uniform(0.0, 10e-3)]),
        )
        e.chunk_tokens = rng.choice([0, 256, 1024])
        if rng.random() < 0.5:
            e.note_call("disk", rng.uniform(0.0, 2e-4))
        runs: list[tuple[str, int]] = [("host", 1)] * rng.randrange(0, 40) + [("disk", 4)] * rng.randrange(1, 40)
        pages = sum(n for _, n in runs)
        start, end = rng.randrange(0, 64), None
        end = rng.choice([None, (start + pages + rng.randrange(0, 64)) * PAGE_TOKENS])
        args = (PAGE_BYTES, PAGE_TOKENS, e, {"disk"}, start * PAGE_TOKENS, end)
        got = pages_worth_loading(runs, *args, cut_runs=True)
        best_pages, best_saved = 0, 0.0
        for j in range(1, len(runs) + 1):  # every leading part, weighed as a whole
            d = pages_worth_loading(runs[:j], *args)
            part = sum(n for _, n in runs[:j])
            if d.pages == part and d.saved_seconds is not None and d.saved_seconds > best_saved + 1e-12:
                best_pages, best_saved = part, d.saved_seconds
        assert got.saved_seconds == pytest.approx(best_saved, abs=1e-12), (got, best_pages, best_saved)
        checked += got.pages > 0
    assert checked > 100


def test_some_run_pays_is_the_leading_runs_weighed_one_by_one() -> None:
    """Whether some leading run of units pays, decided by its first unit and the whole run
    (the saving is convex in the run's length), equals weighing every leading run in turn;
    unmeasured: True (no telling); no units: False."""
    import random

    from pdserve.engine.kv_cost import some_run_pays

    assert some_run_pays(CostEstimates(), "disk", PAGE_BYTES, PAGE_TOKENS, 0, 4)
    e = CostEstimates(bytes_per_s={"disk": 1.0}, prefill_s_per_token=1e-6)
    assert not some_run_pays(e, "disk", PAGE_BYTES, PAGE_TOKENS, 0, 0)
    rng = random.Random(7)
    checked = {True: 0, False: 0}
    for _ in range(600):
        rate, per_token = PAGE_BYTES / rng.uniform(10e-6, 200e-6), rng.uniform(0.2e-6, 4e-6)
        per_pair = rng.choice([0.0, rng.uniform(1e-10, 2e-8)])
        floor, fixed = rng.choice([0.0, rng.uniform(1e-3, 20e-3)]), rng.choice([0.0, rng.uniform(0.0, 10e-3)])
        e = CostEstimates(
            bytes_per_s={"disk": rate},
            prefill_s_per_token=per_token,
            prefill_s_per_pair=per_pair,
            prefill_floor_s=floor,
            prefill_fixed_s=fixed,
            prefill_floor_s_per_token=rng.choice([0.0, per_token * rng.uniform(0.0, 0.5)]),  # slower than the line
        )
        if rng.random() < 0.5:
            e.note_call("disk", rng.uniform(0.0, 2e-4))  # a round trip a load
        first, units = rng.randrange(0, 400), rng.randrange(1, 600)
        end = rng.choice([None, (first + units + rng.randrange(0, 50)) * PAGE_TOKENS])
        load = e.load_seconds("disk", PAGE_BYTES)
        assert load is not None
        computed, brute = 0.0, False
        for i in range(units):
            computed += e.recompute_seconds(PAGE_TOKENS, (first + i) * PAGE_TOKENS) or 0.0
            bound = e.headroom_seconds(first * PAGE_TOKENS, end, (i + 1) * PAGE_TOKENS)
            loads = (e.load_seconds("disk", (i + 1) * PAGE_BYTES) or 0.0) * kv_cost.GROUP_LOAD_MARGIN
            brute = brute or min(computed, bound) - loads > 1e-12
        got = some_run_pays(e, "disk", PAGE_BYTES, PAGE_TOKENS, first, units, end)
        assert got == brute, (first, units, end, e.prefill_s_per_token, e.prefill_s_per_pair, load)
        checked[got] += 1
    assert min(checked.values()) > 50  # both answers met often


def test_a_lookup_is_worth_asking_only_for_a_run_that_saves_more_than_it_costs() -> None:
    """Finding out whether a tier holds a prefix is itself a round trip (a store's master, on the
    engine's thread): a run whose load saves less than that, at the rule's margin, cannot repay
    the asking, even where the tier holds it whole. 8 groups of a 7B model's KV computed in 11.8
    ms and loaded in 8.6 as weighed (6.9 x the margin) save 3.2 ms: worth a 0.7 ms lookup, not a 4 ms one."""
    group = 4 * 28 * 2 * 4 * 128 * 16 * 2  # four 16-token pages of Qwen2.5-7B's KV in bf16
    e = CostEstimates(bytes_per_s={"store": group / 0.0008}, prefill_s_per_token=23e-6)
    e.note_call("store", 0.0005)
    saved = 512 * 23e-6 - kv_cost.GROUP_LOAD_MARGIN * (8 * 0.0008 + 0.0005)
    assert saved == pytest.approx(0.00315, abs=1e-5)
    assert kv_cost.some_run_pays(e, "store", group, 64, 0, 8, 544)
    assert kv_cost.some_run_pays(e, "store", group, 64, 0, 8, 544, ask_seconds=0.0007)
    assert kv_cost.some_run_pays(e, "store", group, 64, 0, 8, 544, ask_seconds=saved * 0.99)
    assert not kv_cost.some_run_pays(e, "store", group, 64, 0, 8, 544, ask_seconds=saved * 1.01)
    assert not kv_cost.some_run_pays(e, "store", group, 64, 0, 8, 544, ask_seconds=0.004)


def test_a_round_trip_weighs_on_short_loads() -> None:
    """A load from a store asks its master first, as its lookups do: each load is priced one
    lookup's time more than its bytes. A single group that its bytes alone would load (1.5 ms
    computed, 0.8 loaded: the store at 512 tokens of a 7B model on an H100, asked at every turn
    and then declined whole) does not pay with a 0.5 ms round trip; a long run still does."""
    group = 4 * 28 * 2 * 4 * 128 * 16 * 2  # four 16-token pages of Qwen2.5-7B's KV in bf16
    e = CostEstimates(bytes_per_s={"store": group / 0.0008}, prefill_s_per_token=23e-6)
    assert kv_cost.some_run_pays(e, "store", group, 64, 0, 1, 544)
    e.note_call("store", 0.0005)
    assert e.load_seconds("store", group) == pytest.approx(0.0013)
    assert e.load_seconds("store", group, calls=0) == pytest.approx(0.0008)
    assert not kv_cost.some_run_pays(e, "store", group, 64, 0, 1, 544)
    assert kv_cost.some_run_pays(e, "store", group, 64, 0, 8, 544)  # 8 groups: 11.8 ms against 6.9
    d = pages_worth_loading([("store", 4)] * 8, group // 4, 16, e, {"store"}, 0, 544)
    assert d.pages == 32 and d.saved_seconds == pytest.approx(512 * 23e-6 - 1.25 * (8 * 0.0008 + 0.0005))


def test_a_load_of_one_batch_call_is_priced_at_least_at_that_call_s_rate_alone() -> None:
    """A store's long loads keep two batch calls in flight (3.6 GB/s here); one call alone
    reads slower (1.8 GB/s). A load of no more than one call's bytes is priced at least at the
    lone call's rate, a longer one at the long loads' rate; a page's share of a load (``calls``
    0, as the overlap split weighs a tail) keeps the long rate."""
    group = 4 * 28 * 2 * 4 * 128 * 16 * 2  # four 16-token pages of Qwen2.5-7B's KV in bf16
    e = CostEstimates(bytes_per_s={"store": 3.6e9}, prefill_s_per_token=8e-6, prefill_floor_s=0.010)
    e.note_call("store", 0.0003)
    long_only = e.load_seconds("store", 4 * group)
    assert long_only == pytest.approx(4 * group / 3.6e9 + 0.0003)
    e.note_one_call("store", 4 * group, 4 * group / 1.8e9)
    assert e.load_seconds("store", 4 * group) == pytest.approx(4 * group / 1.8e9)
    assert e.load_seconds("store", group) == pytest.approx(group / 1.8e9)
    assert e.load_seconds("store", 8 * group) == pytest.approx(8 * group / 3.6e9 + 0.0003)
    assert e.load_seconds("store", group, calls=0) == pytest.approx(group / 3.6e9)
    e.note_one_call("store", 0, 1.0)  # (no bytes: no reading)
    assert e.one_call["store"] == (4 * group, 4 * group / 1.8e9)


def test_a_tier_s_round_trip_is_the_median_of_its_recent_calls() -> None:
    """A client's first call sets up its connection (a store's lookups on this CPU: 8 and 4 ms,
    then 0.1): the round trip a load is priced at is the median of the last CALLS, so those
    first calls do not price every later load (an average seeded by them declined a disk and a
    store on an H100 for good); a lasting change shows once it is most of them."""
    e = CostEstimates(bytes_per_s={"store": 1e9})
    for seconds in (0.050, 0.004):
        e.note_call("store", seconds)
    assert e.call_seconds["store"] == pytest.approx(0.027)  # two calls: their median
    for _ in range(3):
        e.note_call("store", 0.0001)
    assert e.call_seconds["store"] == pytest.approx(0.0001)
    assert e.load_seconds("store", 10**6) == pytest.approx(0.001 + 0.0001)
    for _ in range(kv_cost.CALLS // 2 + 1):  # the master moved further away
        e.note_call("store", 0.002)
    assert e.call_seconds["store"] == pytest.approx(0.002)
    e.note_call("store", 0.0)  # (no time: no reading)
    assert len(e._calls["store"]) == kv_cost.CALLS


def test_a_step_below_the_floor_brings_the_floor_down_to_it() -> None:
    """The floor is what no step goes below: a step seen faster than it (the start-up probes ran
    in a slow spell: 96 to 384 tokens in 17-22 ms on an H100, the worker's 512-token steps 15)
    brings it down to that step, so that what a load saves is not bounded at nothing. Steps at or
    above it leave it; the probes' own rounds (the readings cleared) set none."""
    e = CostEstimates(prefill_s_per_token=20e-6, prefill_floor_s=0.021)
    assert e.headroom_seconds(0, 544, 480) == 0.0  # 544 tokens' line: 10.9 ms, under the floor
    e.note_prefill(544, 0.030)
    assert e.prefill_floor_s == pytest.approx(0.021)
    e.note_prefill(520, 0.015)
    assert e.prefill_floor_s == pytest.approx(0.015) and e.floor_seconds(64) == pytest.approx(0.015)
    # a floor with a slope: the step less the slope's part
    e = CostEstimates(prefill_s_per_token=20e-6, prefill_floor_s=0.020, prefill_floor_s_per_token=1e-6)
    e.note_prefill(500, 0.016)
    assert e.prefill_floor_s == pytest.approx(0.0155) and e.floor_seconds(500) == pytest.approx(0.016)
    # a slope that alone says more than the step: flat at the step's time
    e = CostEstimates(prefill_floor_s=0.001, prefill_floor_s_per_token=1e-4)
    e.note_prefill(500, 0.010)
    assert (e.prefill_floor_s, e.prefill_floor_s_per_token) == (pytest.approx(0.010), 0.0)
    e.clear_prefill()
    e.note_prefill(64, 0.005)
    assert e.prefill_floor_s == 0.0  # no floor: nothing to bring down


def test_a_load_saves_the_fixed_part_of_each_step_it_leaves_out() -> None:
    """A prompt longer than a step's budget is computed in several steps, each with the line's
    fixed part (every weight read again): an 8,192-token prompt of a 7B model in four steps of
    2,048 on an H100 took 256 ms where its line through one step priced it at 205, and a store
    that loads it in ~150 ms looked break-even (the first worker stopped writing it, a second one
    found nothing to load). Loading the prompt leaves one step: three fixed parts saved."""
    page = 28 * 2 * 4 * 128 * 16 * 2  # a 16-token page of Qwen2.5-7B's KV in bf16
    e = CostEstimates(
        bytes_per_s={"store": 3.0e9}, prefill_s_per_token=12.6e-6, prefill_s_per_pair=2.68e-9, prefill_fixed_s=12.3e-3
    )
    e.note_call("store", 2e-3)
    end = 8192 + 16
    unchunked = pages_worth_loading([("store", 512)], page, 16, e, {"store"}, 0, end)
    group = 8 * page
    assert unchunked.pages == 0 and not kv_cost.some_run_pays(e, "store", group, 128, 0, 64, 8192)
    e.chunk_tokens = 2048
    assert [e.steps(n) for n in (0, 1, 2048, 2049, end)] == [1, 1, 1, 2, 5]
    assert e.steps_seconds(0, end, 8192) == pytest.approx(4 * 12.3e-3)  # five steps to one
    assert e.steps_seconds(0, end, 2048) == pytest.approx(12.3e-3)  # 8,208 tokens to 6,160: five steps to four
    assert e.steps_seconds(0, end, 15) == 0.0 and e.steps_seconds(0, None, 8192) == 0.0
    chunked = pages_worth_loading([("store", 512)], page, 16, e, {"store"}, 0, end)
    load = (512 * page / 3.0e9 + 2e-3) * kv_cost.GROUP_LOAD_MARGIN
    assert chunked.pages == 512
    assert chunked.saved_seconds == pytest.approx(e.recompute_seconds(8192) + 4 * 12.3e-3 - load)
    assert kv_cost.some_run_pays(e, "store", group, 128, 0, 64, 8192)
    # a run that pays only through the step it saves: a prompt of two steps whose first 2,048
    # tokens cost less to compute than to load, but loading 2,064 of its 2,100 leaves one step
    cheap = CostEstimates(bytes_per_s={"store": 3.0e9}, prefill_s_per_token=2e-6, prefill_fixed_s=20e-3)
    assert not kv_cost.some_run_pays(cheap, "store", group, 128, 0, 17, 2100)
    cheap.chunk_tokens = 2048
    assert kv_cost.some_run_pays(cheap, "store", group, 128, 0, 17, 2100)


def test_a_step_no_larger_than_the_floor_s_widest_is_no_reading_of_the_line() -> None:
    """On an H100 a 7B model's probes of 96 to 384 tokens took ~9.6-9.9 ms (the floor), a chat's
    whole turns of 544 to 616 tokens ~15. One short step a little above the floor (a warm-up of
    50 tokens at 10.9 ms) spread the sizes: the line through it and the turns, 10.5 ms + 8 us a
    token, priced loading 512 of a 576-token turn at 4.2 ms where host memory saved ~6, and a
    disk that had read 0.86x no tier was declined (2026-12-06). A step no wider than the floor's
    widest, in tokens and attention pairs, is the floor's: the turns alone give the line."""
    e = CostEstimates()
    for tokens, ms in ((96, 9.6), (192, 9.7), (384, 9.9)):
        e.note_prefill(tokens, ms / 1e3, tokens * tokens / 2)
    assert e.measure_floor()
    turns = ((544, 15.0), (580, 15.2), (616, 15.5))
    for tokens, ms in ((50, 10.9), *turns):
        e.note_prefill(tokens, ms / 1e3, tokens * tokens / 2)
    # the turns' sizes do not spread: their cheapest rate, bounded by the floor (the headroom)
    assert (e.prefill_fixed_s, e.prefill_s_per_pair) == (0.0, 0.0)
    assert e.prefill_s_per_token == pytest.approx(min(ms / 1e3 / t for t, ms in turns))
    page = 28 * 2 * 4 * 128 * 16 * 2  # a 16-token page of Qwen2.5-7B's KV in bf16
    e.note_load("disk", page * 32, page * 32 / 9.24e9)
    e.note_load("store", page * 32, page * 32 / 3.3e9)
    disk = pages_worth_loading([("disk", 32)], page, 16, e, {"disk", "store"}, 0, 576)
    assert disk.pages == 32
    expected = e.headroom_seconds(0, 576, 512) - page * 32 / 9.24e9 * kv_cost.GROUP_LOAD_MARGIN
    assert disk.saved_seconds == pytest.approx(expected)
    assert pages_worth_loading([("store", 32)], page, 16, e, {"disk", "store"}, 0, 576).pages == 0
    # a short step after a long context attends to more pairs than the floor's widest: a reading
    line = (e.prefill_fixed_s, e.prefill_s_per_token, e.prefill_s_per_pair)
    e.note_prefill(64, 0.0125, 64 * (8000 + 32))
    assert (e.prefill_fixed_s, e.prefill_s_per_token, e.prefill_s_per_pair) != line
