"""Where a request goes: the disaggregated path (the request stream, a prefill worker, then
a decode worker) or local prefill on a decode worker (conditional disaggregation).

Plain Python, no I/O: the gateway reads the load (:class:`Load`) from the broker now and
then and asks :func:`choose` for each request. A short prompt, or one mostly cached, is
cheaper to prefill where it will be decoded than to ship across: it skips a queue, a
prefill worker's step and a KV transfer. A long one would stall the decode worker's batch
for its whole prefill, so it goes to the prefill pool, unless that pool is backed up and the
decode side has room, when the limit is raised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from pdserve.schemas import WorkerInfo

DISAGGREGATED = "disaggregated"
LOCAL = "local"
PLACED = "placed"
PATHS = (DISAGGREGATED, LOCAL, PLACED)


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """``conditional_disagg``: decide per request (off: every request is disaggregated).
    A prompt of at most ``local_prefill_max_tokens`` uncached tokens is prefilled on a
    decode worker; while the prefill pool is busy (at least ``busy_prefill_tokens`` prompt
    tokens waiting per prefill worker, or a request per prefill worker waiting in the
    stream unclaimed), up to ``local_prefill_max_tokens_busy``. Never while
    the best decode worker would keep less than ``decode_reserve`` of its pages free after
    the prompt's pages, nor while ``local_max_waiting`` local requests per decode worker
    wait unclaimed. ``refresh_seconds``: how often the gateway reads the load.

    ``prefix_aware``: a request whose prompt's first ``prefix_min_tokens`` tokens (or more)
    one prefill or unified worker is believed to cache goes to that worker's own subject;
    if the worker has not taken it within ``placed_deadline`` seconds it goes to the shared
    queue; only while at least ``prefix_min_workers`` such workers serve the model (with one,
    the shared queue reaches the same worker without the detour). ``index_max_hashes`` bounds
    the index of cached pages."""

    conditional_disagg: bool = False
    local_prefill_max_tokens: int = 128
    local_prefill_max_tokens_busy: int = 512
    busy_prefill_tokens: int = 1024
    decode_reserve: float = 0.1
    local_max_waiting: int = 4
    refresh_seconds: float = 0.25
    prefix_aware: bool = True
    prefix_min_workers: int = 2
    prefix_min_tokens: int = 256
    placed_deadline: float = 0.5
    index_max_hashes: int = 200_000

    def __post_init__(self) -> None:
        if (
            self.prefix_min_tokens < 1
            or self.prefix_min_workers < 1
            or self.placed_deadline <= 0
            or self.index_max_hashes < 1
        ):
            raise ValueError(
                "prefix_min_tokens, prefix_min_workers, placed_deadline and index_max_hashes must be positive"
            )
        if self.local_prefill_max_tokens < 0 or self.local_prefill_max_tokens_busy < self.local_prefill_max_tokens:
            raise ValueError("local_prefill_max_tokens must be >= 0 and <= local_prefill_max_tokens_busy")
        if self.busy_prefill_tokens < 1 or self.local_max_waiting < 1:
            raise ValueError("busy_prefill_tokens and local_max_waiting must be at least 1")
        if not 0.0 <= self.decode_reserve < 1.0:
            raise ValueError("decode_reserve must be in [0, 1)")
        if self.refresh_seconds <= 0:
            raise ValueError("refresh_seconds must be positive")


@dataclasses.dataclass(frozen=True)
class DecodeRoom:
    """One decode worker's pages, from its last heartbeat."""

    pages_free: int
    pages_total: int
    page_size: int


@dataclasses.dataclass(frozen=True)
class Load:
    """What the gateway last read: the prefill pool (workers, prompt tokens waiting in
    them and requests waiting in the stream), the decode workers' pages, and local
    requests waiting unclaimed. ``known`` is False until the first reading."""

    prefill_workers: int = 0
    prefill_tokens_waiting: int = 0
    prefill_queued: int = 0
    decode: tuple[DecodeRoom, ...] = ()
    local_waiting: int = 0
    known: bool = False

    @classmethod
    def read(cls, workers: Iterable[WorkerInfo], model: str, prefill_queued: int, local_waiting: int) -> Load:
        """The load from the registry's entries of ``model`` and the two queues' waiting counts."""
        prefill = [w for w in workers if w.model == model and w.role == "prefill"]
        decode = [
            DecodeRoom(w.pages_total - w.pages_used, w.pages_total, w.page_size)
            for w in workers
            if w.model == model and w.role == "decode"
        ]
        return cls(
            prefill_workers=len(prefill),
            prefill_tokens_waiting=sum(w.stats.prefill_tokens_waiting for w in prefill),
            prefill_queued=prefill_queued,
            decode=tuple(decode),
            local_waiting=local_waiting,
            known=True,
        )


@dataclasses.dataclass(frozen=True)
class Decision:
    path: str
    reason: str


def choose(prompt_tokens: int, cached_tokens: int, load: Load, config: PlacementConfig) -> Decision:
    """The path of a request of ``prompt_tokens`` (``cached_tokens`` of them believed
    cached where it would be prefilled; 0 when unknown) under ``load``."""
    if not config.conditional_disagg:
        return Decision(DISAGGREGATED, "off")
    if not load.known or not load.decode:
        return Decision(DISAGGREGATED, "no decode worker known")
    if load.local_waiting >= config.local_max_waiting * len(load.decode):
        return Decision(DISAGGREGATED, "local queue full")
    if not any(_fits(room, prompt_tokens, config.decode_reserve) for room in load.decode):
        return Decision(DISAGGREGATED, "decode pages short")
    if load.prefill_workers == 0:
        return Decision(LOCAL, "no prefill worker")
    uncached = max(prompt_tokens - cached_tokens, 0)
    busy = (
        load.prefill_queued >= load.prefill_workers
        or load.prefill_tokens_waiting >= config.busy_prefill_tokens * load.prefill_workers
    )
    limit = config.local_prefill_max_tokens_busy if busy else config.local_prefill_max_tokens
    if uncached <= limit:
        return Decision(LOCAL, "prefill busy" if busy else "short")
    return Decision(DISAGGREGATED, "long")


def _fits(room: DecodeRoom, prompt_tokens: int, reserve: float) -> bool:
    pages = -(-(prompt_tokens + 1) // max(room.page_size, 1))
    return room.pages_free - pages >= reserve * room.pages_total
