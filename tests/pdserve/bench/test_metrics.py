"""Metrics math: percentiles, TTFT/ITL/TPOT conventions on hand-made timelines, goodput."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from pdserve.bench.client import _fill_counts, _Stream
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.metrics import SLO, RequestRecord, describe, percentile, summarize


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 101):
        data = sorted(rng.uniform(0, 100) for _ in range(n))
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_percentile_small_cases() -> None:
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_describe_scales_to_ms_and_uses_population_std() -> None:
    d = describe([0.001, 0.002, 0.003, 0.004])
    assert d is not None
    assert d["mean"] == pytest.approx(2.5)
    assert d["median"] == pytest.approx(2.5)
    assert d["std"] == pytest.approx(float(np.std([1, 2, 3, 4])))
    assert d["min"] == pytest.approx(1.0) and d["max"] == pytest.approx(4.0)
    assert d["count"] == 4
    assert describe([]) is None


def _timeline(
    backend: str, start: float, events: list[tuple[float, dict]], end: float, expected: int = 4
) -> RequestRecord:
    """Feed parsed SSE events with their arrival times through the client's parser."""
    rec = RequestRecord(0)
    st = _Stream(rec, start, backend)
    for t, obj in events:
        st.event(obj, t)
    rec.latency = end - start
    rec.ok = rec.ttft is not None and st.error is None
    rec.error = st.error
    _fill_counts(st, BenchRequest("p", 7, expected), None)
    return rec


def _gen(n: int, prompt: int = 7, final: bool = False) -> dict:
    meta: dict = {"prompt_tokens": prompt, "completion_tokens": n, "finish_reason": None}
    if final:
        meta["timings"] = {"request_queue": 0.004, "kv_queue": 0.002}
    return {"text": "x" * n, "output_ids": list(range(n)), "meta_info": meta}


def test_single_token_events_ttft_itl_tpot() -> None:
    # one token per event at 1.10, 1.12, 1.15, 1.19; stream ends at 1.20
    events = [
        (1.10, {"choices": [{"text": "a"}]}),
        (1.12, {"choices": [{"text": "b"}]}),
        (1.15, {"choices": [{"text": "c"}]}),
        (1.19, {"choices": [{"text": "d"}]}),
        (1.195, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}),
    ]
    rec = _timeline("openai", 1.0, events, 1.20)
    assert rec.ok
    assert rec.ttft == pytest.approx(0.10)
    assert rec.itl == pytest.approx([0.02, 0.03, 0.04])
    assert rec.output_tokens == 4 and rec.token_source == "server"
    assert rec.prompt_tokens == 9 and rec.prompt_source == "server"
    assert rec.tpot == pytest.approx((0.20 - 0.10) / 3)
    assert rec.mean_itl == pytest.approx(0.03)


def test_multi_token_event_counts_gap_once_for_itl_and_spreads_it_for_tpot() -> None:
    # /generate: first event 1 token at t=0.1; then one event carrying 3 tokens at t=0.4
    events = [(0.1, _gen(1)), (0.4, _gen(4, final=True))]
    rec = _timeline("generate", 0.0, events, 0.4)
    assert rec.ttft == pytest.approx(0.1)
    assert rec.itl == pytest.approx([0.3])  # one observed gap, not three
    assert rec.token_events == 2
    assert rec.output_tokens == 4
    assert rec.tpot == pytest.approx(0.1)  # the 0.3 s gap spread over its 3 tokens
    assert rec.timings == {"request_queue": 0.004, "kv_queue": 0.002}


def test_events_without_tokens_do_not_count() -> None:
    # chat: a role-only first delta, then content; a repeated /generate event without new tokens
    events = [
        (0.05, {"choices": [{"delta": {"role": "assistant"}}]}),
        (0.2, {"choices": [{"delta": {"content": "hi"}}]}),
        (0.3, {"choices": [{"delta": {"content": ""}}]}),
        (0.5, {"choices": [{"delta": {"content": "!"}}]}),
    ]
    rec = _timeline("openai-chat", 0.0, events, 0.5, expected=2)
    assert rec.ttft == pytest.approx(0.2)
    assert rec.itl == pytest.approx([0.3])
    assert rec.output_tokens == 2 and rec.token_source == "events"
    rec = _timeline("generate", 0.0, [(0.1, _gen(1)), (0.2, _gen(1)), (0.3, _gen(2))], 0.3, expected=2)
    assert rec.itl == pytest.approx([0.2])


def test_error_event_fails_the_request() -> None:
    events = [(0.1, {"choices": [{"text": "a"}]}), (0.2, {"error": {"message": "boom", "type": "server_error"}})]
    rec = _timeline("openai", 0.0, events, 0.2)
    assert not rec.ok
    assert rec.error == "boom"


def test_tpot_undefined_for_one_token() -> None:
    rec = RequestRecord(0, ok=True, ttft=0.1, latency=0.1, output_tokens=1)
    assert rec.tpot is None


def _rec(
    i: int, ttft: float, latency: float, out: int, itl: list[float] | None = None, ok: bool = True
) -> RequestRecord:
    return RequestRecord(
        i,
        ok=ok,
        error=None if ok else "HTTP 503: full",
        ttft=ttft,
        latency=latency,
        itl=itl or [],
        prompt_tokens=10,
        output_tokens=out,
        expected_output_tokens=out,
        token_events=out,
    )


def test_summarize_throughput_and_goodput() -> None:
    records = [
        _rec(0, 0.05, 0.35, 4, [0.1, 0.1, 0.1]),  # TPOT 100 ms, mean ITL 100 ms
        _rec(1, 0.50, 0.62, 4, [0.04, 0.04, 0.04]),  # TTFT 500 ms
        _rec(2, 0.05, 0.11, 4, [0.02, 0.02, 0.02]),  # TPOT 20 ms
        _rec(3, 0.0, 0.0, 0, ok=False),
    ]
    m = summarize(records, duration=2.0, slo=SLO(ttft_ms=200, itl_ms=50))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 12
    assert m["output_throughput"] == pytest.approx(6.0)
    assert m["goodput"] == pytest.approx(0.5)  # only record 2 meets both
    assert m["goodput_fraction"] == pytest.approx(0.25)
    assert m["errors"] == {"HTTP 503: full": 1}
    assert m["ttft_ms"]["median"] == pytest.approx(50.0)
    assert m["itl_ms"]["count"] == 9
    assert m["tpot_ms"]["max"] == pytest.approx(100.0)
    only_ttft = summarize(records, 2.0, SLO(ttft_ms=200))
    assert only_ttft["goodput"] == pytest.approx(1.0)
    assert "goodput" not in summarize(records, 2.0, SLO())


def test_goodput_itl_metric_choice() -> None:
    # TPOT is (0.5-0.1)/4 = 100 ms, but the observed ITLs average 200 ms (two events of 2 tokens)
    r = _rec(0, 0.1, 0.5, 5, [0.2, 0.2])
    assert r.tpot == pytest.approx(0.1)
    assert SLO(itl_ms=150, itl_metric="tpot").met(r)
    assert not SLO(itl_ms=150, itl_metric="mean-itl").met(r)
    # One slow gap among fast ones: the mean hides it, the request's own p99 does not.
    spiky = _rec(1, 0.1, 0.5, 11, [0.01] * 9 + [0.2])
    assert spiky.p99_itl == pytest.approx(0.1829)
    assert SLO(itl_ms=30, itl_metric="mean-itl").met(spiky)
    assert not SLO(itl_ms=30, itl_metric="p99-itl").met(spiky)
    assert SLO(itl_ms=30, itl_metric="p99-itl").describe() == "p99 ITL <= 30 ms"


def test_a_request_own_p99_forgives_one_stall_and_max_itl_does_not() -> None:
    # 127 gaps of 5 ms after a 2 s wait for the second token (a PD hand-off that queued):
    # the request's own p99 interpolates below its longest gap and passes, TPOT spreads the
    # stall over 127 tokens (20.7 ms) and passes; max ITL fails it.
    stalled = _rec(0, 0.1, 0.1 + 2.0 + 126 * 0.005, 128, [2.0] + [0.005] * 126)
    assert stalled.p99_itl == pytest.approx(0.005)
    assert stalled.max_itl == pytest.approx(2.0)
    assert SLO(itl_ms=30, itl_metric="p99-itl").met(stalled)
    assert not SLO(itl_ms=30, itl_metric="max-itl").met(stalled)
    assert stalled.tpot == pytest.approx((2.0 + 126 * 0.005) / 127)
    assert SLO(itl_ms=30, itl_metric="tpot").met(stalled)
    assert SLO(itl_ms=30, itl_metric="max-itl").describe() == "max ITL <= 30 ms"
    steady = _rec(1, 0.1, 0.1 + 127 * 0.005, 128, [0.005] * 127)
    assert SLO(itl_ms=30, itl_metric="max-itl").met(steady)
    assert stalled.row()["max_itl"] == pytest.approx(2.0)


def test_summarize_server_timings_and_cache() -> None:
    records = [_rec(i, 0.1, 0.2, 2, [0.1]) for i in range(3)]
    for i, r in enumerate(records):
        r.timings = {"request_queue": 0.001 * (i + 1), "kv_queue": 0.002, "recomputed": 1.0 if i == 0 else 0.0}
        r.cached_tokens = 5
    m = summarize(records, 1.0)
    t = m["server_timings_ms"]
    assert t["request_queue"]["p50"] == pytest.approx(2.0)
    assert t["kv_queue"]["p99"] == pytest.approx(2.0)
    assert t["recomputed"] == {"count": 1}
    assert m["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert not math.isnan(m["duration_s"])
