"""``WorkerInfo``: a worker's entry in the registry, refreshed as a heartbeat."""

from __future__ import annotations

import dataclasses

from pdserve.schemas.codec import Message


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo(Message):
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
    v: int = 1
