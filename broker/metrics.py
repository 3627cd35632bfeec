"""The registry's worker entries and the work queues as Prometheus metric families.

Each worker's counters travel in its registry heartbeat (``WorkerInfo``), so the same
families serve a worker's own ``/metrics`` (its one entry) and the API's (every live
worker's, labelled by ``worker`` and ``role``): one definition, no second count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.schemas import WorkerCounters, WorkerInfo, WorkerStats

WORKER_LABELS = ("worker", "role")

# Gauges read off the entry itself: name → (help, value).
_GAUGES = {
    "pdserve_kv_pages_total": "KV pages in the worker's pool",
    "pdserve_kv_pages_used": "KV pages in use (running, held for decode, or cached)",
    "pdserve_worker_requests_in_flight": "requests the worker holds a delivery of",
    "pdserve_worker_capacity": "largest running batch (--max-running-requests)",
    "pdserve_worker_waiting": "sequences waiting in the worker's scheduler",
    "pdserve_worker_running": "sequences in the worker's running batch",
    "pdserve_worker_prefill_tokens_waiting": "prompt tokens admitted by the worker but not computed yet",
}

# WorkerCounters and WorkerStats totals: field → (metric name without _total, help).
_COUNTERS = {
    "kv_pulls": ("pdserve_kv_pulls", "KV imports read from a prefill worker"),
    "kv_pull_bytes": ("pdserve_kv_transfer_bytes", "KV bytes pulled from prefill workers"),
    "kv_pull_failures": ("pdserve_kv_pull_failures", "KV transfers that failed or outlasted their lease"),
    "kv_leases_refused": ("pdserve_kv_leases_refused", "KV handles whose pages were gone when leased"),
    "recomputes": ("pdserve_recomputes", "prompts a decode worker computed itself instead of pulling"),
    "redeliveries": ("pdserve_worker_redeliveries", "work messages that arrived more than once"),
    "migrations": ("pdserve_worker_migrations", "requests taken over mid-stream"),
    "handed_back": ("pdserve_handed_back", "unfinished requests given back on a drain"),
    "dead_lettered": ("pdserve_dead_lettered", "messages this worker moved to the dead-letter stream"),
    "kv_pull_ops": (
        "pdserve_kv_pull_ops",
        "transport operations the KV pulls took (segments, or point-to-point messages)",
    ),
    "kv_links_opened": ("pdserve_kv_links_opened", "point-to-point communicators set up with a peer (nccl, gloo)"),
    "kv_links_refused": (
        "pdserve_kv_links_refused",
        "KV link handshakes refused for a layout, backend or device mismatch",
    ),
    "kv_sends": ("pdserve_kv_sends", "requests' pages a prefill worker pushed to a decode worker"),
    "kv_send_bytes": ("pdserve_kv_send_bytes", "KV bytes a prefill worker pushed"),
    "kv_send_failures": ("pdserve_kv_send_failures", "KV pushes that failed or timed out on the prefill side"),
    "kv_transport_fallbacks": (
        "pdserve_kv_transport_fallbacks",
        "RDMA asked for but unusable: KV moves over tcp (--allow-tcp-fallback)",
    ),
    "kv_tier_lookups": ("pdserve_kv_tier_lookups", "prefix lookups that went below the device's prefix cache"),
    "kv_tier_missed_pages": ("pdserve_kv_tier_missed_pages", "pages those lookups wanted that no KV tier held"),
    "kv_tier_write_drops": ("pdserve_kv_tier_write_drops", "KV page groups not written: the writer's queue was full"),
    "kv_tier_snapshot_allocations": (
        "pdserve_kv_tier_snapshot_allocations",
        "KV page groups copied off a GPU into a newly pinned buffer (those pinned at start all in use)",
    ),
    "kv_tier_write_errors": ("pdserve_kv_tier_write_errors", "KV page groups a tier failed to take (logged)"),
    "local_prefills": (
        "pdserve_local_prefills",
        "requests a decode worker prefilled itself (conditional disaggregation)",
    ),
    "placed_taken": ("pdserve_placed_taken", "requests placed on this worker that it claimed and ran"),
    "placed_withdrawn": (
        "pdserve_placed_withdrawn",
        "requests placed on this worker that the API had moved to the shared queue (dropped here)",
    ),
    "steps": ("pdserve_engine_steps", "forward passes"),
    "batch_rows": ("pdserve_engine_batch_rows", "sequences computed, summed over steps (/ steps = mean batch size)"),
    "prompt_tokens": ("pdserve_prompt_tokens", "prompt tokens admitted by the engine"),
    "cached_tokens": ("pdserve_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache"),
    "generated_tokens": ("pdserve_generated_tokens", "tokens sampled"),
    "busy_seconds": ("pdserve_engine_busy_seconds", "seconds spent in forward passes"),
    "turn_wait_seconds": (
        "pdserve_engine_turn_wait_seconds",
        "seconds steps waited for other workers' steps on the cores they take turns at",
    ),
    "kv_pull_seconds": ("pdserve_kv_transfer_seconds", "seconds spent pulling KV"),
    "grammar_refusals": (
        "pdserve_grammar_refusals",
        "sampled tokens a structured-output request's grammar refused (a bug: logged)",
    ),
    "scored_prompt_tokens": (
        "pdserve_prompt_tokens_scored",
        "prompt tokens whose log-probabilities requests asked for (computed in full: no prefix cache)",
    ),
    "overlapped_steps": (
        "pdserve_engine_overlapped_steps",
        "decode steps left queued on the device while the next one was scheduled (overlap)",
    ),
    "history_unoverlapped_steps": (
        "pdserve_engine_history_unoverlapped_steps",
        "decode steps not left queued because a row's sampling reads its own output (penalties, bad words)",
    ),
    "preemptions": (
        "pdserve_engine_preemptions",
        "running requests sent back to wait, their KV to be recomputed (pages ran out, or a higher priority came)",
    ),
    "priority_preemptions": (
        "pdserve_engine_priority_preemptions",
        "of those, requests whose seat a request of a higher priority took",
    ),
    "stop_regex_timeouts": (
        "pdserve_stop_regex_timeouts",
        "requests' stop_regex patterns given up by a worker, a search past its time limit (no stop by them after)",
    ),
}
_STATS_GAUGES = {"waiting", "running", "prefill_tokens_waiting"}
# TierCounts fields → (metric name, help); labels worker, role and tier.
_TIER_COUNTERS = {
    "hit_pages": (
        "pdserve_kv_tier_hit_pages",
        "KV pages loaded from the tier into the pool (prefix hits below the device)",
    ),
    "load_bytes": ("pdserve_kv_tier_load_bytes", "bytes loaded from the tier into the pool"),
    "stored_pages": ("pdserve_kv_tier_stored_pages", "KV pages written into the tier"),
    "store_bytes": ("pdserve_kv_tier_store_bytes", "bytes written into the tier"),
    "corrupt": (
        "pdserve_kv_tier_corrupt",
        "entries that failed their checksum, identity or key check (used as misses)",
    ),
    "declined_pages": (
        "pdserve_kv_tier_declined_pages",
        "KV pages found in the tier and computed instead (loading them measured slower)",
    ),
    "prefetched_groups": (
        "pdserve_kv_tier_prefetched_groups",
        "page groups read ahead from the tier into host memory while their request waited",
    ),
    "prefetch_hits": ("pdserve_kv_tier_prefetch_hits", "prefetched page groups a load then took from memory"),
    "prefetch_wasted": ("pdserve_kv_tier_prefetch_wasted", "prefetched page groups dropped unused"),
    "calibrations": (
        "pdserve_kv_tier_calibrations",
        "page groups read back off the request path to measure the tier's load rate",
    ),
    "overlapped_pages": (
        "pdserve_kv_tier_overlapped_pages",
        "KV pages loaded from the tier while the prefix before them was computed",
    ),
    "unbuffered_reads": (
        "pdserve_kv_tier_unbuffered_reads",
        "page-group reads into a fresh buffer because every reused read buffer was out (slower)",
    ),
    "skipped_lookups": (
        "pdserve_kv_tier_skipped_lookups",
        "prefix lookups not asked of the tier: no run of the prompt's pages measured worth loading from it",
    ),
    "unwritten_groups": (
        "pdserve_kv_tier_unwritten_groups",
        "page groups computed and not written to the tier: no leading run of them could be worth loading from it",
    ),
    "saved_seconds": (
        "pdserve_kv_tier_saved_seconds",
        "seconds the tier's loads were expected to save against computing their pages (the cost rule's estimates)",
    ),
}
# TierCounts fields shown as gauges: the load-or-recompute rule's inputs.
_TIER_GAUGES = {
    "load_s_per_page": ("pdserve_kv_tier_load_seconds_per_page", "measured time to load one KV page from the tier"),
    "recompute_s_per_page": (
        "pdserve_kv_tier_recompute_seconds_per_page",
        "measured time for the worker to compute one page of prompt tokens instead",
    ),
    "recompute_s_per_pair": (
        "pdserve_kv_tier_recompute_seconds_per_pair",
        "what each (query, key) pair of the prefill's attention adds to computing it (later pages cost more)",
    ),
    "load_s_per_call": (
        "pdserve_kv_tier_load_seconds_per_call",
        "a round trip to the tier (its lookups'): each load's fixed part",
    ),
    "recompute_floor_s": (
        "pdserve_kv_tier_recompute_floor_seconds",
        "the least a prefill step takes however few its tokens (0: none seen): bounds what a load saves",
    ),
    "load_s_per_page_one_call": (
        "pdserve_kv_tier_load_seconds_per_page_one_call",
        "a page's time in one batch call of the tier alone, as a load of no more than one call is priced (0: none)",
    ),
}
_TOTALS = [f.name for cls in (WorkerCounters, WorkerStats) for f in dataclasses.fields(cls)]
assert set(_TOTALS) == set(_COUNTERS) | _STATS_GAUGES, "every worker total has a metric"


def worker_families(workers: Iterable[WorkerInfo]) -> Iterator[Metric]:
    """Every worker metric, one sample per worker in ``workers``."""
    workers = list(workers)
    info = GaugeMetricFamily(
        "pdserve_worker_info", "1 per live worker", labels=[*WORKER_LABELS, "model", "host", "transfer_backend"]
    )
    gauges = {name: GaugeMetricFamily(name, help, labels=WORKER_LABELS) for name, help in _GAUGES.items()}
    counters = {
        field: CounterMetricFamily(name, help, labels=WORKER_LABELS) for field, (name, help) in _COUNTERS.items()
    }
    for w in workers:
        labels = [w.worker_id, w.role]
        info.add_metric([*labels, w.model, w.host, w.transfer_backend], 1)
        s = w.stats
        values = {
            "pdserve_kv_pages_total": w.pages_total,
            "pdserve_kv_pages_used": w.pages_used,
            "pdserve_worker_requests_in_flight": w.requests_in_flight,
            "pdserve_worker_capacity": w.capacity,
            "pdserve_worker_waiting": s.waiting,
            "pdserve_worker_running": s.running,
            "pdserve_worker_prefill_tokens_waiting": s.prefill_tokens_waiting,
        }
        for name, value in values.items():
            gauges[name].add_metric(labels, value)
        totals = {**dataclasses.asdict(w.counters), **dataclasses.asdict(s)}
        for field, family in counters.items():
            family.add_metric(labels, totals[field])
    yield info
    yield from gauges.values()
    yield from counters.values()
    if any(w.kv_tiers for w in workers):
        yield from _tier_families(workers)


def _tier_families(workers: list[WorkerInfo]) -> Iterator[Metric]:
    """The KV tiers' totals of the workers that have tiers, one sample per worker and tier."""
    labels = [*WORKER_LABELS, "tier"]
    counters = {f: CounterMetricFamily(name, help, labels=labels) for f, (name, help) in _TIER_COUNTERS.items()}
    held = GaugeMetricFamily("pdserve_kv_tier_bytes", "bytes the KV tier holds now (host, disk)", labels=labels)
    gauges = {f: GaugeMetricFamily(name, help, labels=labels) for f, (name, help) in _TIER_GAUGES.items()}
    for w in workers:
        for t in w.kv_tiers:
            values = [w.worker_id, w.role, t.tier]
            for field, family in counters.items():
                family.add_metric(values, getattr(t, field))
            for field, gauge in gauges.items():
                gauge.add_metric(values, getattr(t, field))
            held.add_metric(values, t.held_bytes)
    yield from counters.values()
    yield from gauges.values()
    yield held


@dataclass(frozen=True)
class QueueReading:
    """One work queue as the broker sees it: waiting, delivered but unacked, and the age of
    its oldest message (seconds)."""

    stage: str
    consumer: str
    pending: int
    ack_pending: int
    oldest_age: float


def queue_families(queues: Iterable[QueueReading]) -> Iterator[Metric]:
    labels = ["stage", "consumer"]
    pending = GaugeMetricFamily("pdserve_queue_pending", "messages waiting for a worker", labels=labels)
    ack = GaugeMetricFamily("pdserve_queue_ack_pending", "messages delivered, not yet acked", labels=labels)
    age = GaugeMetricFamily(
        "pdserve_queue_oldest_age_seconds", "age of the oldest message not yet done (waiting or in hand)", labels=labels
    )
    for q in queues:
        pending.add_metric([q.stage, q.consumer], q.pending)
        ack.add_metric([q.stage, q.consumer], q.ack_pending)
        age.add_metric([q.stage, q.consumer], q.oldest_age)
    yield from (pending, ack, age)
