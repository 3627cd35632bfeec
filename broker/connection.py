"""Connecting to NATS and publishing into JetStream with request-id dedup."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError

from pdserve.schemas.codec import Message

log = logging.getLogger(__name__)

# JetStream error codes for a stream that refuses new messages (discard-new limits).
_FULL_CODES = {10077, 10047, 10027, 10028}


class QueueFullError(RuntimeError):
    """The stream is at its limits; the caller should retry later (HTTP 503)."""


async def connect(url: str, name: str) -> Client:
    """Connect with endless reconnects; connection problems are logged, not raised later
    (quietly while the connection is being drained or closed on purpose)."""
    holder: list[Client] = []

    def closing() -> bool:
        return bool(holder) and (holder[0].is_draining or holder[0].is_closed)

    async def on_error(exc: Exception) -> None:
        (log.debug if closing() else log.warning)("nats error", extra={"error": str(exc), "client": name})

    async def on_disconnect() -> None:
        (log.debug if closing() else log.warning)("nats disconnected", extra={"client": name})

    async def on_reconnect() -> None:
        log.info("nats reconnected", extra={"client": name})

    nc = await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
    holder.append(nc)
    return nc


async def publish_work(
    js: JetStreamContext,
    subject: str,
    message: Message,
    msg_id: str,
    timeout: float = 5.0,
    headers: dict[str, str] | None = None,
) -> bool:
    """Publish ``message`` to a work stream, deduplicated on ``msg_id``, with ``headers``
    besides the ``Nats-Msg-Id`` one.

    Returns ``False`` when the server saw ``msg_id`` already (a duplicate), raises
    :class:`QueueFullError` when the stream is full.
    """
    try:
        ack = await js.publish(
            subject, message.encode(), timeout=timeout, headers={**(headers or {}), "Nats-Msg-Id": msg_id}
        )
    except APIError as exc:
        if exc.err_code in _FULL_CODES or (exc.description and "maximum" in exc.description):
            raise QueueFullError(exc.description or "stream full") from None
        raise
    return not ack.duplicate
