"""A worker's own ``/metrics``: its registry entry as Prometheus families (the same ones
the API serves for every worker) and the distributions only the worker sees."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pdserve.broker.metrics import worker_families
from pdserve.engine.kv_tiers import KVTiers
from pdserve.schemas import WorkerInfo

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TIER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _Entry(Collector):
    def __init__(self, info: Callable[[], WorkerInfo]) -> None:
        self._info = info

    def collect(self) -> Iterator[Metric]:
        return worker_families([self._info()])


class WorkerMetrics:
    """One registry per worker (never the process-global one: tests run several workers in
    one process). ``info()`` is the worker's registry entry as of now; ``tiers``, the
    engine's KV tiers, for a histogram each of their lookup and load times."""

    def __init__(self, info: Callable[[], WorkerInfo], tiers: KVTiers | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Entry(info))
        if tiers is not None:  # their counts come with the registry entry (``WorkerInfo.kv_tiers``)
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

    def sm_share_steps(self) -> Callable[[int], None]:
        """A counter of co-located prefill's steps by the SMs each ran on (``--prefill-sms auto``);
        returns what counts one step."""
        steps = Counter(
            "pdserve_prefill_sm_steps",
            "co-located prefill's steps by the SMs of the green context each ran in",
            ["sms"],
            registry=self.registry,
        )
        return lambda sms: steps.labels(sms=str(sms)).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format of everything above."""
        return generate_latest(self.registry)
