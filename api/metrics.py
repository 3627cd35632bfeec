"""The API's metrics: what its clients saw (outcomes, TTFT, ITL, end to end), its own
totals (``GatewayStats``), and the workers' and queues' view read from the broker.

Everything lands in one ``CollectorRegistry`` per app (never the process-global one), so
``/metrics`` serves it whole; the same observations feed a :class:`Window` for the live
``/dashboard``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.api import detokenizer
from pdserve.api.window import Window
from pdserve.broker.metrics import QueueReading, queue_families, worker_families
from pdserve.schemas import WorkerInfo

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
OUTCOMES = ("stop", "length", "error", "timeout", "cancelled", "rejected")
PLACEMENT_PATHS = ("disaggregated", "local", "placed")

# GatewayStats field → help; each is served as pdserve_<field>_total.
GATEWAY_TOTALS = {
    "requests": "requests published by this API",
    "migrations": "requests moved to another worker mid-stream",
    "migration_failures": "requests that failed after --max-migrations moves",
    "duplicate_chunks": "token chunks received twice (dropped)",
    "stale_chunks": "token chunks of a superseded attempt (dropped)",
    "dead_letters": "work messages moved to the dead-letter stream",
    "placement_fallbacks": "placed requests their worker did not take in time, moved to the shared queue",
}


@dataclasses.dataclass
class BrokerView:
    """The workers and queues as last read from the broker (refreshed per scrape)."""

    workers: list[WorkerInfo] = dataclasses.field(default_factory=list)
    queues: list[QueueReading] = dataclasses.field(default_factory=list)


class _Live(Collector):
    def __init__(self, metrics: ApiMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        stats = m.stats()
        for name, help in GATEWAY_TOTALS.items():
            yield CounterMetricFamily(f"pdserve_{name}", help, value=stats[name])
        in_flight, tokens_waiting = m.in_flight()
        yield GaugeMetricFamily("pdserve_requests_in_flight", "requests this API streams now", value=in_flight)
        yield GaugeMetricFamily(
            "pdserve_prefill_tokens_waiting",
            "prompt tokens of this API's requests that have no token back yet",
            value=tokens_waiting,
        )
        yield CounterMetricFamily(
            "pdserve_api_stop_regex_timeouts",
            "stop_regex patterns this API gave up, a search past its time limit (no stop by them after)",
            value=detokenizer.TIMEOUTS[0],
        )
        yield from worker_families(m.view.workers)
        yield from queue_families(m.view.queues)


class ApiMetrics:
    """``stats()`` reads the gateway's totals (``GatewayStats`` as a dict); ``in_flight()`` its live requests and their
    prompt tokens still waiting for a first token."""

    def __init__(
        self,
        stats: Callable[[], dict[str, int]],
        in_flight: Callable[[], tuple[int, int]],
        window_seconds: float = 300.0,
    ) -> None:
        self.stats = stats
        self.in_flight = in_flight
        self.view = BrokerView()
        self.window = Window(window_seconds)
        self.registry = CollectorRegistry()
        self.outcomes = Counter(
            "pdserve_requests_finished", "requests by how they ended", ["outcome"], registry=self.registry
        )
        self.finished_by_outcome = dict.fromkeys(OUTCOMES, 0)  # the same counts, readable
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome)
        self.placements = Counter(
            "pdserve_placement_decisions",
            "requests by the path placement chose for them (disaggregated: the request stream; "
            "local: prefilled on a decode worker; placed: on the worker caching its prefix)",
            ["path"],
            registry=self.registry,
        )
        self.placed_by_path = dict.fromkeys(PLACEMENT_PATHS, 0)  # the same counts, readable
        for path in PLACEMENT_PATHS:
            self.placements.labels(path)
        self.output_tokens = Counter("pdserve_output_tokens", "tokens streamed to clients", registry=self.registry)
        self.tool_calls = Counter(
            "pdserve_tool_calls", "tool calls read out of the model's text and returned", registry=self.registry
        )
        self.tool_call_failures = Counter(
            "pdserve_tool_call_parse_failures",
            "text that began a tool call but did not read as one (unknown function, broken JSON, cut short): "
            "returned as content",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pdserve_ttft_seconds", "publish to first token", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.itl = Histogram(
            "pdserve_itl_seconds",
            "gap between token chunks, per token of the chunk",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pdserve_e2e_seconds", "publish to last token", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.registry.register(_Live(self))

    # ---- observations (the gateway calls these) --------------------------------------
    def tokens(self, since_last: float, n: int, first: bool) -> None:
        """``n`` tokens arrived ``since_last`` seconds after the previous chunk (the publish,
        when ``first``)."""
        now = time.monotonic()
        self.output_tokens.inc(n)
        self.window.add("tokens", now, n)
        if first:
            self.ttft.observe(since_last)
            self.window.add("ttft", now, since_last)
            n -= 1
            since_last = 0.0
        if n > 0:
            gap = since_last / n
            for _ in range(n):
                self.itl.observe(gap)
            self.window.add("itl", now, gap, n)

    def tool_reply(self, calls: int, failures: int) -> None:
        """A chat reply's tool calls returned and the would-be calls returned as content."""
        if calls:
            self.tool_calls.inc(calls)
        if failures:
            self.tool_call_failures.inc(failures)

    def placed(self, path: str) -> None:
        self.placements.labels(path).inc()
        self.placed_by_path[path] = self.placed_by_path.get(path, 0) + 1

    def finished(self, outcome: str, seconds: float | None) -> None:
        self.outcomes.labels(outcome).inc()
        self.finished_by_outcome[outcome] += 1
        if seconds is not None:
            self.e2e.observe(seconds)
            self.window.add("e2e", time.monotonic(), seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
