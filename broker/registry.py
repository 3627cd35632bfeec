"""The worker registry: one key per worker in a TTL'd key-value bucket."""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from pdserve.broker import subjects
from pdserve.schemas import MessageError, WorkerInfo

log = logging.getLogger(__name__)


class WorkerRegistry:
    def __init__(self, bucket: KeyValue, js: JetStreamContext) -> None:
        self._bucket = bucket
        self._js = js

    async def put(self, info: WorkerInfo) -> None:
        await self._bucket.put(subjects.worker_key(info.worker_id), info.encode())

    async def remove(self, worker_id: str) -> None:
        try:
            await self._bucket.purge(subjects.worker_key(worker_id))
        except KeyNotFoundError:
            pass

    async def list(self) -> list[WorkerInfo]:
        """Live workers (entries expire ``worker_ttl`` after their last heartbeat).

        Keys come from the server's per-subject state of the bucket's stream: nats-py's
        ``keys()`` watches the bucket and can end its scan early while heartbeats land,
        leaving a live worker out."""
        prefix = subjects.bucket_key_prefix(subjects.WORKER_BUCKET)
        info = await self._js.stream_info(subjects.bucket_stream(subjects.WORKER_BUCKET), subjects_filter=prefix + ">")
        keys = [subject[len(prefix) :] for subject in (info.state.subjects or {})]
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
