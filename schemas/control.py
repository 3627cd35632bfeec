"""``Cancel``: fan-out to every worker holding a request."""

from __future__ import annotations

import dataclasses

from pdserve.schemas.codec import Message


@dataclasses.dataclass(frozen=True, slots=True)
class Cancel(Message):
    rid: str
    reason: str = "client disconnected"
    v: int = 1
