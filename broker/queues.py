"""JetStream's typed ends of the work channels (:data:`~pdserve.broker.contract.REQUESTS`,
``LOCAL_REQUESTS``, ``PLACED``, ``KV_READY``): :func:`submit` and :func:`place` store a
message, :class:`WorkQueue` pulls and decodes them. A message that does not decode is
terminated, never redelivered, and its sender answered where it can be read
(:func:`~pdserve.broker.contract.answer_malformed`)."""

from __future__ import annotations

from typing import Generic

from nats.aio.client import Client
from opentelemetry.context import Context

from pdserve.broker import subjects, tracing
from pdserve.broker.connection import publish_work, publish_work_at
from pdserve.broker.consumer import Delivery, PullConsumer, decode_deliveries
from pdserve.broker.contract import PLACED, M, WorkChannel, answer_malformed
from pdserve.schemas import GenerateRequest


async def submit(
    nc: Client,
    channel: WorkChannel[M],
    message: M,
    model: str,
    rid: str,
    attempt: int = 0,
    trace: Context | None = None,
    scope: tuple[str, ...] = (),
    msg_id: str | None = None,
) -> bool:
    """Store ``message`` in ``channel``'s stream for ``model``, deduplicated on ``rid`` and
    ``attempt`` (:func:`subjects.msg_id`, or ``msg_id``); ``scope`` follows the model in its
    subject (a placed request's worker). With tracing on, the ``traceparent`` of ``trace``
    (default: the current span) travels in its headers; the receiver reads it as
    :attr:`Delivery.trace`.

    Returns ``False`` for a duplicate; raises ``QueueFullError`` when the stream is full."""
    assert isinstance(message, channel.message), f"{channel.name} carries {channel.message.__name__}"
    return await publish_work(
        nc,
        channel.subject(model, *scope),
        message,
        msg_id=msg_id or subjects.msg_id(rid, attempt),
        headers=tracing.headers(trace),
    )


async def place(
    nc: Client, request: GenerateRequest, model: str, worker_id: str, trace: Context | None = None
) -> int | None:
    """Store ``request`` on ``worker_id``'s own subject (:data:`PLACED`), deduplicated on
    :func:`subjects.placed_msg_id`; its sequence in the stream, ``None`` for a duplicate.
    Raises as :func:`submit`."""
    return await publish_work_at(
        nc,
        PLACED.subject(model, worker_id),
        request,
        msg_id=subjects.placed_msg_id(request.rid),
        headers=tracing.headers(trace),
    )


class WorkQueue(Generic[M]):
    """A work channel's durable pull consumer for one model, decoding what it fetches.

    Malformed messages are terminated (never redelivered) and, where a reply subject can
    be read, answered with an error chunk from ``receiver_id``. Not thread-safe.
    """

    def __init__(
        self, nc: Client, channel: WorkChannel[M], model: str, receiver_id: str, scope: tuple[str, ...] = ()
    ) -> None:
        self.channel = channel
        self._nc = nc
        self._receiver_id = receiver_id
        self._pull = PullConsumer(nc, channel.stream, channel.consumer(model, *scope))

    async def start(self) -> None:
        await self._pull.start()

    async def stop(self) -> None:
        """Stop fetching; whatever an open pull still delivers is handed back (nak)."""
        await self._pull.stop()

    async def fetch(self, max_msgs: int, timeout: float) -> list[Delivery[M]]:
        """Up to ``max_msgs`` decoded deliveries; waits at most ``timeout`` for the first."""
        msgs = await self._pull.fetch(max_msgs, timeout)
        if not msgs:
            return []
        good, bad = await decode_deliveries(msgs, self.channel.message)
        for rejected in bad:
            await answer_malformed(
                self._nc, rejected.rid, rejected.reply_to, rejected.error, self._receiver_id, rejected.code
            )
        return good
