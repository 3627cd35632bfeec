"""``WorkerInfo``: a worker's entry in the registry, refreshed as a heartbeat."""

from __future__ import annotations

import dataclasses

from pdserve.schemas.codec import Message
from pdserve.schemas.kv import KVLayout


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerCounters:
    """Totals since the worker started.

    ``kv_pulls``/``kv_pull_bytes``: KV imports read from a prefill worker;
    ``kv_pull_failures``: transfers that failed; ``kv_leases_refused``: handles whose pages
    were gone when asked for (released, expired, another generation); ``recomputes``:
    prompts a decode worker computed itself instead of pulling (each failure or refusal
    above, and handles too close to expiry); ``redeliveries``: work messages that arrived
    more than once; ``migrations``: requests taken over mid-stream (continued from the
    tokens already streamed); ``handed_back``: unfinished requests given back on a drain;
    ``dead_lettered``: messages this worker moved to the dead-letter stream;
    ``local_prefills``: requests a decode worker prefilled itself (conditional
    disaggregation); ``placed_taken``/``placed_withdrawn``: requests placed on this worker
    (prefix-aware placement) that it claimed and ran, or found claimed by the API (moved to
    the shared queue) and dropped.

    The transport itself: ``kv_pull_ops``: operations the pulls took (Mooncake: segments
    read; ``nccl``/``gloo``: point-to-point messages received); ``kv_links_opened``:
    communicators set up with a peer (``nccl``/``gloo``, each side counts its own; a
    healthy pair opens one and reuses it); ``kv_links_refused``: handshakes refused for a
    layout, backend or device mismatch (each side counts it); ``kv_sends``/``kv_send_bytes``:
    requests' pages a prefill worker pushed to a decode worker; ``kv_send_failures``: pushes
    that failed or timed out on the prefill side; ``kv_transport_fallbacks``: 1 when RDMA was
    asked for, could not work, and the worker moves KV over tcp with the user's leave
    (``--allow-tcp-fallback``).

    The KV tiers below the prefix cache (docs/kv_tiers.md): ``kv_tier_lookups``: prefix
    lookups that went below the device; ``kv_tier_missed_pages``: pages they wanted that no
    tier held; ``kv_tier_write_drops``: page groups not written (the writer's queue was
    full); ``kv_tier_write_errors``: page groups a tier failed to take;
    ``kv_tier_snapshot_allocations``: page groups whose copy off a GPU needed a newly pinned
    buffer on the engine's thread (the ones pinned at start were all in use: slower).
    """

    kv_pulls: int = 0
    kv_pull_bytes: int = 0
    kv_pull_failures: int = 0
    kv_leases_refused: int = 0
    recomputes: int = 0
    redeliveries: int = 0
    migrations: int = 0
    handed_back: int = 0
    dead_lettered: int = 0
    kv_pull_ops: int = 0
    kv_links_opened: int = 0
    kv_links_refused: int = 0
    kv_sends: int = 0
    kv_send_bytes: int = 0
    kv_send_failures: int = 0
    kv_transport_fallbacks: int = 0
    kv_tier_lookups: int = 0
    kv_tier_missed_pages: int = 0
    kv_tier_write_drops: int = 0
    kv_tier_write_errors: int = 0
    kv_tier_snapshot_allocations: int = 0
    local_prefills: int = 0
    placed_taken: int = 0
    placed_withdrawn: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class TierCounts:
    """One KV tier's totals: ``tier`` is ``host``, ``disk`` or ``store``; ``hit_pages`` and
    ``load_bytes``: loaded from it into the pool; ``stored_pages`` and ``store_bytes``:
    written into it; ``corrupt``: entries that failed their checks (used as misses);
    ``held_bytes``: what it holds now (host and disk; 0 where unknown); ``declined_pages``:
    pages found there and computed instead, loading them being the slower
    (:mod:`pdserve.engine.kv_cost`); the rule's inputs now: ``load_s_per_page`` (this tier's
    measured rate) against ``recompute_s_per_page`` (the worker's prefill, a page at the prompt's
    start) and ``recompute_s_per_pair`` (what each (query, key) pair of its attention adds: a
    page after ``c`` tokens costs ``page_size * c`` of them more), ``load_s_per_call`` (a round
    trip to the tier, as its lookups took: each load's fixed part) and ``recompute_floor_s``
    (the least a prefill step takes however few its tokens, where the worker's start-up probes
    showed one: what loading part of a prompt saves is bounded by the step's time above it) and
    ``load_s_per_page_one_call`` (a tier that reads in batches: a page's time in one batch call
    alone, which a load of no more than one call is priced at), 0 until measured;
    ``prefetched_groups``: groups read ahead into host memory while their request waited,
    ``prefetch_hits`` of them then loaded from memory, ``prefetch_wasted`` dropped unused;
    ``calibrations``: groups read back off the request path to measure the tier's rate (its
    first write, or one it held at start); ``overlapped_pages``: pages asked of it while the
    prefix before them was computed (a tier slower than computing still saving time);
    ``unbuffered_reads``: group reads that found every reused read buffer out and read into
    a fresh one (slower; :mod:`pdserve.engine.kv_buffers`); ``saved_seconds``: what the loads taken from it were expected to save against computing
    their pages, by the rule's estimates when it took them; ``skipped_lookups``: prefix lookups
    not asked of it, no run of the prompt's pages from the first a load would take measured
    worth loading from it; ``unwritten_groups``: page groups
    computed and not written to it, no leading run of them worth loading from it by the
    measured rates (a load takes a prefix's groups from its first)."""

    tier: str
    hit_pages: int = 0
    load_bytes: int = 0
    stored_pages: int = 0
    store_bytes: int = 0
    corrupt: int = 0
    held_bytes: int = 0
    declined_pages: int = 0
    load_s_per_page: float = 0.0
    recompute_s_per_page: float = 0.0
    recompute_s_per_pair: float = 0.0
    load_s_per_call: float = 0.0
    recompute_floor_s: float = 0.0
    load_s_per_page_one_call: float = 0.0
    prefetched_groups: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0
    calibrations: int = 0
    overlapped_pages: int = 0
    unbuffered_reads: int = 0
    saved_seconds: float = 0.0
    skipped_lookups: int = 0
    unwritten_groups: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerStats:
    """The engine's totals since the worker started, and its queue now.

    ``steps``/``batch_rows``: forward passes and the rows (sequences) they computed, so
    ``batch_rows / steps`` is the mean batch size; ``prompt_tokens``/``cached_tokens``:
    prompt tokens admitted and those found in the prefix cache; ``generated_tokens``:
    tokens sampled; ``busy_seconds``: time in forward passes; ``turn_wait_seconds``: time its
    steps waited for other workers' steps on cores they take turns at (PD on one CPU host,
    ``up --core-sharing turns``); ``kv_pull_seconds``: time in
    KV pulls (decode); ``waiting``/``running``: sequences the scheduler holds now;
    ``prefill_tokens_waiting``: prompt tokens admitted but not computed yet;
    ``grammar_refusals``: sampled tokens a constrained sequence's grammar refused (0 unless a bug);
    ``scored_prompt_tokens``: prompt tokens whose log-probabilities a request asked for;
    ``overlapped_steps``: decode steps left queued on the device while the next one was
    scheduled (overlap, on by default on a GPU); ``history_unoverlapped_steps``: decode steps that were
    not, because a row's sampling reads its own output (penalties, multi-token bad words);
    ``preemptions``: running requests sent back to wait (their KV dropped, recomputed later:
    pages ran out, or a request of a higher priority took the seat), ``priority_preemptions``
    of those for a higher priority; ``stop_regex_timeouts``: requests' stop_regex patterns given
    up, a search of theirs past its time limit (the pattern backtracks without end).
    """

    steps: int = 0
    batch_rows: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    busy_seconds: float = 0.0
    turn_wait_seconds: float = 0.0
    kv_pull_seconds: float = 0.0
    waiting: int = 0
    running: int = 0
    prefill_tokens_waiting: int = 0
    grammar_refusals: int = 0
    scored_prompt_tokens: int = 0
    overlapped_steps: int = 0
    history_unoverlapped_steps: int = 0
    preemptions: int = 0
    priority_preemptions: int = 0
    stop_regex_timeouts: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo(Message):
    """Minor additions (``counters``, ``kv_layout``, ``transfer_*``, ``stats``,
    ``kv_tiers``, ``tp_size``) are optional, so an older worker's entry still decodes.
    ``kv_layout`` is one rank's pool: with ``tp_size`` ranks it holds ``1 / tp_size`` of the
    KV heads."""

    worker_id: str
    role: str
    model: str
    host: str
    pid: int
    capacity: int
    pages_total: int
    pages_used: int
    page_size: int
    requests_in_flight: int
    transfer_endpoint: str = ""
    model_path: str = ""
    started_at: float = 0.0
    updated_at: float = 0.0
    counters: WorkerCounters = WorkerCounters()
    kv_layout: KVLayout | None = None
    transfer_backend: str = ""
    transfer_protocol: str = ""
    stats: WorkerStats = WorkerStats()
    kv_tiers: tuple[TierCounts, ...] = ()
    tp_size: int = 1
    v: int = 1
