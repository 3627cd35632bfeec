"""Claims of placed requests: a request the API placed on one worker's own subject runs
where its claim says. The worker stores the claim when it takes the request; the API stores
it when the worker has not taken the request within the placement deadline, then moves the
request to the shared queue. Storing a claim that exists fails (JetStream key-value
``create``), so exactly one of them runs it: never lost, never run twice."""

from __future__ import annotations

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from pdserve.broker import subjects
from pdserve.schemas import MessageError, PlacementClaim


class Claims:
    def __init__(self, bucket: KeyValue) -> None:
        self._bucket = bucket

    async def claim(self, rid: str, attempt: int, owner: str) -> str:
        """Claim attempt ``attempt`` of ``rid`` for ``owner``; the owner that holds it now
        (``owner`` when this call won, or when ``owner`` claimed it before)."""
        key = subjects.claim_key(rid, attempt)
        try:
            await self._bucket.create(key, PlacementClaim(rid, attempt, owner).encode())
            return owner
        except KeyWrongLastSequenceError:
            pass
        try:
            entry = await self._bucket.get(key)
        except KeyNotFoundError:  # expired meanwhile: nobody can be running it any more
            return ""
        try:
            return PlacementClaim.decode(entry.value or b"").owner
        except MessageError:
            return ""
