"""The worker registry: one key per worker in a TTL'd key-value bucket."""

from __future__ import annotations

import logging

from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from broker import subjects
from schemas import MessageError, WorkerInfo

log = logging.getLogger(__name__)


class WorkerRegistry:
    def __init__(self, bucket: KeyValue) -> None:
        self._bucket = bucket

    async def put(self, info: WorkerInfo) -> None:
        await self._bucket.put(subjects.worker_key(info.worker_id), info.encode())

    async def remove(self, worker_id: str) -> None:
        try:
            await self._bucket.purge(subjects.worker_key(worker_id))
        except KeyNotFoundError:
            pass

    async def list(self) -> list[WorkerInfo]:
        """Live workers (entries expire ``worker_ttl`` after their last heartbeat)."""
        try:
            keys = await self._bucket.keys()
        except NoKeysError:
            return []
        workers = []
        for key in keys:
            try:
                entry = await self._bucket.get(key)
            except KeyNotFoundError:
                continue
            if not entry.value:
                continue
            try:
                workers.append(WorkerInfo.decode(entry.value))
            except MessageError as exc:
                log.warning("bad registry entry", extra={"key": key, "error": str(exc)})
        return sorted(workers, key=lambda w: (w.role, w.worker_id))
