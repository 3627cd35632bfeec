"""Prometheus families of the worker registry and the queues, and trace headers with
tracing off."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from pdserve.broker import tracing
from pdserve.broker.metrics import QueueReading, queue_families, worker_families
from pdserve.schemas import TierCounts, WorkerCounters, WorkerInfo, WorkerStats


def _worker(worker_id: str, role: str, n: int) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        model="m",
        host="h",
        pid=1,
        capacity=64,
        pages_total=100,
        pages_used=n,
        page_size=16,
        requests_in_flight=n,
        counters=WorkerCounters(**{f.name: n for f in dataclasses.fields(WorkerCounters)}),
        stats=WorkerStats(**{f.name: n for f in dataclasses.fields(WorkerStats)}),
    )


class _Fixed(Collector):
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):  # type: ignore[no-untyped-def]
        return iter(self.families)


def _exposed(families: list) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(_Fixed(families))
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_every_worker_total_is_a_metric_with_one_sample_per_worker() -> None:
    workers = [_worker("p1", "prefill", 3), _worker("d1", "decode", 5)]
    exposed = _exposed(list(worker_families(workers)))
    assert all(name.startswith("pdserve_") for name in exposed)
    assert exposed["pdserve_kv_transfer_bytes"][0].name == "pdserve_kv_transfer_bytes_total"
    for name, samples in exposed.items():
        assert {s.labels["worker"] for s in samples} == {"p1", "d1"}, name
    by_worker = {s.labels["worker"]: s.value for s in exposed["pdserve_prefix_cache_hit_tokens"]}
    assert by_worker == {"p1": 3, "d1": 5}
    # 7 gauges + the info family + every WorkerCounters and WorkerStats total but the 3 gauges among them
    totals = len(dataclasses.fields(WorkerCounters)) + len(dataclasses.fields(WorkerStats)) - 3
    assert len(exposed) == 1 + 7 + totals


def test_kv_tiers_are_labelled_by_tier_for_the_workers_that_have_them() -> None:
    tiers = (TierCounts("host", hit_pages=7, held_bytes=1024), TierCounts("disk", hit_pages=2, corrupt=1))
    workers = [dataclasses.replace(_worker("p1", "prefill", 3), kv_tiers=tiers), _worker("d1", "decode", 5)]
    exposed = _exposed(list(worker_families(workers)))
    hits = {(s.labels["worker"], s.labels["tier"]): s.value for s in exposed["pdserve_kv_tier_hit_pages"]}
    assert hits == {("p1", "host"): 7, ("p1", "disk"): 2}
    assert {s.labels["tier"]: s.value for s in exposed["pdserve_kv_tier_corrupt"]} == {"host": 0, "disk": 1}
    assert {s.labels["tier"]: s.value for s in exposed["pdserve_kv_tier_bytes"]} == {"host": 1024, "disk": 0}


def test_queues_are_labelled_by_stage_and_consumer() -> None:
    readings = [QueueReading("prefill", "prefill-m", 4, 2, 1.5), QueueReading("decode", "decode-m", 0, 1, 0.25)]
    exposed = _exposed(list(queue_families(readings)))
    ages = {s.labels["stage"]: s.value for s in exposed["pdserve_queue_oldest_age_seconds"]}
    assert ages == {"prefill": 1.5, "decode": 0.25}
    assert {s.labels["consumer"]: s.value for s in exposed["pdserve_queue_pending"]} == {"prefill-m": 4, "decode-m": 0}


def test_with_tracing_off_nothing_travels_and_nothing_is_recorded() -> None:
    assert not tracing.is_on()  # no SDK in the test process
    assert tracing.headers() == {}
    assert tracing.context_of({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}) is None
    tracing.record(tracing.PREFILL, None, 1.0, 2.0, {"pdserve.rid": "r"})  # no parent: a no-op
