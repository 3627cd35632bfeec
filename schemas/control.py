"""``Cancel``: fan-out to every worker holding a request."""

from __future__ import annotations

import dataclasses

from pdserve.schemas.codec import Message


@dataclasses.dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Stop working on ``rid``.

    ``attempt == 0``: the whole request (the client left, or its deadline passed); it
    applies to requests of ``rid`` published up to ``issued_at`` (0: any), so a later
    request that reuses the id is served. ``attempt == n > 0``: attempts before ``n`` are
    superseded by a migration; attempt ``n`` and later go on.
    """

    rid: str
    reason: str = "client disconnected"
    attempt: int = 0
    issued_at: float = 0.0
    v: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class FlushCache(Message):
    """Forget every cached prefix (a benchmark's cold start); asked of one worker, answered
    with :class:`FlushCacheReply`."""

    reason: str = "flush_cache"
    v: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class FlushCacheReply(Message):
    """``pages_freed``: cached pages that were dropped; ``running``: requests the worker held
    then (their own pages stay until they finish, but are no longer found as a prefix)."""

    worker_id: str
    pages_freed: int = 0
    running: int = 0
    v: int = 1
