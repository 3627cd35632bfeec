"""A worker's own ``/metrics``: its registry entry as Prometheus families (the same ones
the API serves for every worker) and the distributions only the worker sees."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.broker.metrics import WORKER_LABELS, worker_families
from pdserve.engine.kv_tiers import TIER_NAMES, KVTiers
from pdserve.schemas import WorkerInfo

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TIER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# TierCounters field -> (metric, help); each has the labels worker, role, tier.
_TIER_COUNTERS = {
    "hit_pages": ("pdserve_kv_tier_hit_pages", "KV pages loaded from the tier into the pool (prefix hits)"),
    "load_bytes": ("pdserve_kv_tier_load_bytes", "bytes loaded from the tier into the pool"),
    "stored_pages": ("pdserve_kv_tier_stored_pages", "KV pages written into the tier"),
    "store_bytes": ("pdserve_kv_tier_store_bytes", "bytes written into the tier"),
    "corrupt": ("pdserve_kv_tier_corrupt", "entries that failed their checksum or layout check (used as misses)"),
}
# TierStats field -> (metric, help); labels worker, role.
_TIERS_COUNTERS = {
    "lookups": ("pdserve_kv_tier_lookups", "prefix lookups that went below the device's prefix cache"),
    "missed_pages": ("pdserve_kv_tier_missed_pages", "pages those lookups wanted that no tier held"),
    "write_drops": ("pdserve_kv_tier_write_drops", "page groups not written: the writer's queue was full"),
    "write_errors": ("pdserve_kv_tier_write_errors", "page groups a tier failed to take (logged)"),
}


class _Entry(Collector):
    def __init__(self, info: Callable[[], WorkerInfo]) -> None:
        self._info = info

    def collect(self) -> Iterator[Metric]:
        return worker_families([self._info()])


class _Tiers(Collector):
    """The KV tiers' counts (hits and bytes per tier) and sizes, read when scraped."""

    def __init__(self, tiers: KVTiers, info: Callable[[], WorkerInfo]) -> None:
        self._tiers = tiers
        self._info = info

    def collect(self) -> Iterator[Metric]:
        info = self._info()
        labels = [info.worker_id, info.role]
        stats = self._tiers.stats
        for field, (name, help) in _TIER_COUNTERS.items():
            family = CounterMetricFamily(name, help, labels=[*WORKER_LABELS, "tier"])
            for tier in TIER_NAMES:
                family.add_metric([*labels, tier], getattr(stats.tiers[tier], field))
            yield family
        totals = dataclasses.asdict(stats)
        for field, (name, help) in _TIERS_COUNTERS.items():
            family = CounterMetricFamily(name, help, labels=WORKER_LABELS)
            family.add_metric(labels, totals[field])
            yield family
        size = GaugeMetricFamily("pdserve_kv_tier_bytes", "bytes the tier holds now", labels=[*WORKER_LABELS, "tier"])
        if self._tiers.host is not None:
            size.add_metric([*labels, "host"], self._tiers.host.num_bytes)
        disk = self._tiers.tier("disk")
        if disk is not None:
            size.add_metric([*labels, "disk"], getattr(disk, "num_bytes", 0))
        yield size


class WorkerMetrics:
    """One registry per worker (never the process-global one: tests run several workers in
    one process). ``info()`` is the worker's registry entry as of now; ``tiers``, the
    engine's KV tiers (their counts, and a histogram each of lookup and load times)."""

    def __init__(self, info: Callable[[], WorkerInfo], tiers: KVTiers | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Entry(info))
        if tiers is not None:
            self.registry.register(_Tiers(tiers, info))
            durations = {
                name: Histogram(
                    f"pdserve_kv_tier_{name}_duration_seconds",
                    f"one prefix {name} in the KV tiers below the device",
                    buckets=TIER_BUCKETS,
                    registry=self.registry,
                )
                for name in ("lookup", "load")
            }
            tiers.observe = lambda name, seconds: durations[name].observe(seconds)
        self.batch_size = Histogram(
            "pdserve_batch_size", "sequences per forward pass", buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.kv_transfer = Histogram(
            "pdserve_kv_transfer_duration_seconds",
            "one request's KV pull, lease included",
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        """The Prometheus text format of everything above."""
        return generate_latest(self.registry)
