"""The autoscaling rule, on plain readings (no broker, no processes, no clock)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pdserve.scaling import (
    Autoscaler,
    PoolReading,
    RolePolicy,
    ScalingConfig,
    ServiceRates,
    WorkerSample,
    role_needs,
    target_replicas,
)

POLICY = RolePolicy(min_replicas=1, max_replicas=4, lag_per_replica=8, backlog_seconds=5.0)
CONFIG = ScalingConfig(
    prefill=POLICY,
    decode=RolePolicy(min_replicas=1, max_replicas=4, lag_per_replica=32),
    scale_up_window=2.0,
    scale_up_cooldown=5.0,
    scale_down_window=30.0,
)
INSTANT = dataclasses.replace(CONFIG, scale_up_window=0.0)  # one reading decides
IDLE = PoolReading(replicas=1)
# Four requests waiting, 8,000 prompt tokens each, against a measured 2,000 tokens/s.
LONG_PROMPTS = PoolReading(replicas=1, pending=4, tokens_waiting=32_000, ready=1, tokens_per_second=2000.0)


def run(scaler: Autoscaler, readings: list[tuple[float, PoolReading]], role: str = "prefill") -> list[int]:
    """Feed ``readings`` in turn, each with the replicas the previous decision left; return
    the desired replicas after each."""
    out, replicas = [], None
    for now, reading in readings:
        if replicas is not None:
            reading = PoolReading(**{**reading.__dict__, "replicas": replicas})
        replicas = scaler.decide(now, {role: reading})[role].desired
        out.append(replicas)
    return out


def test_an_idle_pool_sits_at_its_minimum() -> None:
    d = Autoscaler(CONFIG).decide(0.0, {"prefill": IDLE, "decode": IDLE})
    assert {r: (x.desired, x.direction) for r, x in d.items()} == {"prefill": (1, "hold"), "decode": (1, "hold")}
    assert d["prefill"].needs == {"lag": 0.0, "tokens": 0.0, "busy": 0.0}


def test_work_is_weighed_in_tokens_not_messages() -> None:
    short = PoolReading(replicas=1, pending=4, tokens_waiting=4 * 32, ready=1, tokens_per_second=2000.0)
    assert role_needs(short, POLICY)["lag"] == role_needs(LONG_PROMPTS, POLICY)["lag"] == 0.5
    assert Autoscaler(INSTANT).decide(0.0, {"prefill": short})["prefill"].desired == 1
    d = Autoscaler(INSTANT).decide(0.0, {"prefill": LONG_PROMPTS})["prefill"]
    # 32,000 tokens / (2,000 tokens/s x 5 s) = 3.2 replicas, rounded up, at most +2 at once.
    assert (d.reason, d.need, d.desired) == ("tokens", 3.2, 3)


def test_an_unmeasured_rate_falls_back_to_the_policy_default() -> None:
    reading = PoolReading(replicas=1, tokens_waiting=40_000)
    assert role_needs(reading, POLICY)["tokens"] == 40_000 / (POLICY.default_tokens_per_second * 5.0)


def test_message_lag_alone_scales_like_kedas_lag_threshold() -> None:
    d = Autoscaler(INSTANT).decide(0.0, {"prefill": PoolReading(replicas=1, pending=14, ack_pending=6)})["prefill"]
    assert (d.reason, d.need, d.desired) == ("lag", 2.5, 3)


def test_a_busy_pool_keeps_its_size_after_the_backlog_is_gone() -> None:
    assert Autoscaler(INSTANT).decide(0.0, {"prefill": PoolReading(replicas=2, busy=1.5)})["prefill"].desired == 2
    busy_one = Autoscaler(INSTANT).decide(0.0, {"prefill": PoolReading(replicas=1, busy=0.95)})["prefill"]
    assert (busy_one.reason, busy_one.desired) == ("busy", 2)


def test_decode_counts_pages_in_use_and_pages_the_waiting_events_need() -> None:
    reading = PoolReading(replicas=2, ready=2, pages_total=2000, pages_used=1500, pages_waiting=500)
    d = Autoscaler(INSTANT).decide(0.0, {"decode": reading})["decode"]
    assert (d.reason, d.needs["pages"], d.desired) == ("pages", 2000 / 800, 3)
    assert "pages" not in role_needs(PoolReading(replicas=0, pages_used=5), POLICY)  # nobody ready: no page size


def test_limits_bound_the_need_and_apply_at_once() -> None:
    flood = PoolReading(replicas=4, pending=10_000)
    assert Autoscaler(CONFIG).decide(0.0, {"prefill": flood})["prefill"].desired == 4
    below = Autoscaler(CONFIG).decide(0.0, {"prefill": PoolReading(replicas=0)})["prefill"]
    above = Autoscaler(CONFIG).decide(0.0, {"prefill": PoolReading(replicas=6)})["prefill"]
    assert (below.desired, below.reason, above.desired, above.reason) == (1, "limits", 4, "limits")


def test_a_need_within_tolerance_holds() -> None:
    assert target_replicas(2.15, 2, POLICY, 0.1) == 2
    assert target_replicas(2.25, 2, POLICY, 0.1) == 3
    assert target_replicas(1.85, 2, POLICY, 0.1) == 2
    assert target_replicas(0.0, 0, RolePolicy(min_replicas=0), 0.1) == 0


def test_one_spike_does_not_scale_up_but_a_sustained_backlog_does() -> None:
    high = PoolReading(replicas=1, pending=24)  # 3 replicas' worth
    spike = run(Autoscaler(CONFIG), [(0.0, IDLE), (1.0, high), (2.0, IDLE), (3.0, IDLE)])
    assert spike == [1, 1, 1, 1]
    sustained = run(Autoscaler(CONFIG), [(0.0, IDLE), (1.0, high), (2.0, high), (3.0, high)])
    assert sustained == [1, 1, 1, 3]


def test_scale_up_is_stepped_and_cooled_down() -> None:
    scaler = Autoscaler(ScalingConfig(prefill=RolePolicy(max_replicas=8), scale_up_window=0.0, max_scale_up_step=2))
    flood = PoolReading(replicas=1, pending=1000)
    assert run(scaler, [(0.0, flood), (1.0, flood), (4.9, flood), (5.0, flood), (10.0, flood)]) == [3, 3, 3, 5, 7]


def test_scale_down_waits_for_a_whole_quiet_window_then_goes_to_its_most() -> None:
    scaler = Autoscaler(CONFIG)
    busy = PoolReading(replicas=3, pending=24)
    some = PoolReading(replicas=3, pending=12)  # 1.5: two replicas
    readings = [(float(t), busy) for t in range(0, 10)] + [(float(t), some) for t in range(10, 20)]
    readings += [(float(t), IDLE) for t in range(20, 61)]
    desired = run(scaler, readings)
    assert desired[:40] == [3] * 40, "nothing shrinks while the window still holds a busy reading"
    assert desired[40:50] == [2] * 10, "then to the most the window's readings asked for"
    assert desired[50:] == [1] * 11


def test_readings_at_any_interval_reach_the_minimum_after_the_window() -> None:
    scaler = Autoscaler(dataclasses.replace(CONFIG, scale_down_window=10.0))
    busy = PoolReading(replicas=2, busy=1.5)
    times = [round(0.7 * i, 1) for i in range(40)]  # a reading every 0.7 s, for 27.3 s
    desired = run(scaler, [(t, busy if t < 5 else PoolReading(replicas=2)) for t in times])
    first_down = times[desired.index(1)]
    assert 15.0 <= first_down <= 15.7, "down once a whole window of quiet readings has passed"


def test_an_oscillating_backlog_does_not_flap() -> None:
    scaler = Autoscaler(CONFIG)
    high, low = PoolReading(replicas=1, pending=20), IDLE
    desired = run(scaler, [(float(t), high if t % 4 < 2 else low) for t in range(120)])
    changes = sum(1 for a, b in itertools.pairwise(desired) if a != b)
    assert changes == 0 and set(desired) == {1}, "two high readings in a row never fill the up window of 2 s"
    desired = run(Autoscaler(CONFIG), [(float(t), high if t % 6 < 4 else low) for t in range(120)])
    changes = sum(1 for a, b in itertools.pairwise(desired) if a != b)
    assert changes == 1 and desired[-1] == 3, "up once, then held: every 30 s window has a high reading"


def test_a_pool_grows_back_at_once_when_load_returns() -> None:
    scaler = Autoscaler(ScalingConfig(scale_down_window=5.0, scale_up_window=0.0, scale_up_cooldown=2.0))
    high = PoolReading(replicas=1, pending=16)
    desired = run(scaler, [(0.0, high)] + [(float(t), IDLE) for t in range(1, 8)] + [(8.0, high)])
    assert desired == [2, 2, 2, 2, 2, 2, 1, 1, 2]


def test_policies_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="min <= max"):
        RolePolicy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="max >= 1"):
        RolePolicy(min_replicas=0, max_replicas=0)
    with pytest.raises(ValueError, match="utilization"):
        RolePolicy(target_utilization=0.0)
    with pytest.raises(ValueError, match="tolerance"):
        ScalingConfig(tolerance=1.0)


def sample(worker: str, role: str, at: float, busy: float, tokens: int) -> WorkerSample:
    return WorkerSample(worker, role, at, busy, tokens)


def test_service_rates_from_heartbeat_totals() -> None:
    rates = ServiceRates(window=10.0)
    rates.add([sample("p1", "prefill", 100.0, 0.0, 0), sample("p2", "prefill", 100.0, 5.0, 1000)])
    rates.add([sample("p1", "prefill", 104.0, 4.0, 8000), sample("p2", "prefill", 104.0, 6.0, 3000)])
    r = rates.rates(104.5)["prefill"]
    # p1 busy all 4 s, p2 one of 4 s: 1.25 replicas' worth; 10,000 tokens in 5 busy seconds.
    assert (r.busy, r.tokens_per_second) == (1.25, 2000.0)


def test_service_rates_forget_the_old_and_the_gone() -> None:
    rates = ServiceRates(window=10.0)
    rates.add([sample("p1", "prefill", 0.0, 0.0, 0), sample("d1", "decode", 0.0, 0.0, 0)])
    rates.add([sample("p1", "prefill", 5.0, 5.0, 5000), sample("d1", "decode", 5.0, 1.0, 10)])
    rates.add([sample("p1", "prefill", 20.0, 5.0, 5000), sample("p1", "prefill", 24.0, 5.0, 5000)])
    r = rates.rates(24.0)
    assert "decode" not in r, "d1 has not been heard of for a window"
    assert (r["prefill"].busy, r["prefill"].tokens_per_second) == (0.0, None), "idle since: no rate to tell"
    rates.add([sample("p1", "prefill", 23.0, 1.0, 1)])  # older than the last sample: ignored
    assert rates.rates(24.0)["prefill"].busy == 0.0
