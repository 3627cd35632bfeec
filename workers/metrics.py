"""A worker's own ``/metrics``: its registry entry as Prometheus families (the same ones
the API serves for every worker) and the distributions only the worker sees."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.broker.metrics import worker_families
from pdserve.engine.kv_tiers import KVTiers
from pdserve.engine.speculative import SpecStats
from pdserve.schemas import WorkerInfo

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TIER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
TURN_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class _Entry(Collector):
    def __init__(self, info: Callable[[], WorkerInfo]) -> None:
        self._info = info

    def collect(self) -> Iterator[Metric]:
        return worker_families([self._info()])


class _Speculative(Collector):
    """Speculative decoding's counters, read from the engine's totals at each scrape."""

    def __init__(self, stats: SpecStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        for name, doc, value in (
            ("draft_tokens", "tokens drafted (n-gram) and verified", s.drafted),
            ("accepted_tokens", "draft tokens accepted; each saved its request one step", s.accepted),
            ("verifies", "requests' verify rows (one forward pass over a request's draft)", s.verifies),
            ("emitted_tokens", "tokens the verifies appended (accepted, corrected and bonus)", s.emitted),
            ("backoffs", "times a request stopped drafting: its acceptance did not pay for the verify", s.backoffs),
            ("probes", "drafts made after a backoff's cooldown", s.probes),
            ("probes_deferred", "steps a request due to probe waited for the probe budget", s.probes_deferred),
            (
                "unoverlapped_steps",
                "steps not left queued on the device (overlap) because a request was due to draft after them",
                s.unoverlapped_steps,
            ),
            ("steps_saved", "decode steps saved (one per accepted draft token)", s.steps_saved),
            (
                "grammar_cut_tokens",
                "draft tokens cut off before verifying: a structured-output request's grammar would refuse them",
                s.grammar_cut,
            ),
        ):
            yield CounterMetricFamily(f"pdserve_spec_{name}", doc, value=value)
        buckets = []
        total = 0
        for accepted, count in enumerate(s.lengths):
            total += count
            buckets.append((str(accepted), total))
        buckets[-1] = ("+Inf", total)
        yield HistogramMetricFamily(
            "pdserve_spec_acceptance_length",
            "draft tokens accepted per verify",
            buckets=buckets,
            sum_value=s.accepted,
        )


class WorkerMetrics:
    """One registry per worker (never the process-global one: tests run several workers in
    one process). ``info()`` is the worker's registry entry as of now; ``tiers``, the
    engine's KV tiers, for a histogram each of their lookup and load times; ``spec``, speculative
    decoding's totals (drafted, accepted, acceptance lengths, steps saved, backoffs)."""

    def __init__(
        self, info: Callable[[], WorkerInfo], tiers: KVTiers | None = None, spec: SpecStats | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Entry(info))
        if spec is not None:  # speculative decoding is on
            self.registry.register(_Speculative(spec))
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

    def core_turn_wait(self) -> Callable[[float], None]:
        """A histogram of the seconds each step waited for its turn at the cores (CPU workers
        of one host taking turns, ``up --core-sharing turns``); returns what observes one."""
        wait = Histogram(
            "pdserve_core_turn_wait_seconds",
            "seconds a step of a CPU worker waited for the other workers' steps on the shared cores",
            buckets=TURN_BUCKETS,
            registry=self.registry,
        )
        return wait.observe

    def exposition(self) -> bytes:
        """The Prometheus text format of everything above."""
        return generate_latest(self.registry)
