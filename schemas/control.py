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
