"""Dead letters: a work message JetStream has delivered ``max_deliver`` times without
anyone finishing it (a request that kills every worker that takes it) would stay stored,
never delivered again, and its client would wait for nothing. JetStream announces it
with an advisory; whoever hears it first (the API and every worker listen, in one queue
group) moves the message to the ``PD_DEAD`` stream (``pd.dead.<stream>.<model>``, with
the original stream, sequence and delivery count in headers), deletes it from its work
stream, and sends its client an error chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from pdserve.broker import contract, subjects
from pdserve.schemas import ErrorInfo, MessageError, TokenChunk

log = logging.getLogger(__name__)

DEAD_LETTER_HEADERS = ("Pd-Stream", "Pd-Seq", "Pd-Deliveries")


async def watch_dead_letters(
    nc: Client, js: JetStreamContext, model: str, on_moved: Callable[[str], Awaitable[None]] | None = None
) -> list[Subscription]:
    """Listen for the max-deliveries advisories of ``model``'s work consumers and handle
    each (see the module). ``on_moved(rid)`` is told of every message moved here."""
    subs = []
    channels = (contract.REQUESTS, contract.URGENT_REQUESTS, contract.LOCAL_REQUESTS, contract.KV_READY)
    for channel in (*channels, contract.URGENT_KV_READY):

        async def on_advisory(msg: Msg, channel: contract.WorkChannel = channel) -> None:  # type: ignore[type-arg]
            try:
                advisory = orjson.loads(msg.data)
                seq, deliveries = int(advisory["stream_seq"]), int(advisory["deliveries"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                log.warning("unreadable max-deliveries advisory", extra={"error": str(exc)})
                return
            try:
                rid = await move_to_dead_letters(nc, js, channel, model, seq, deliveries)
            except Exception as exc:  # the broker is in trouble: the message stays where it is
                log.warning("dead letter not moved", extra={"seq": seq, "error": str(exc)})
                return
            if rid is not None and on_moved is not None:
                await on_moved(rid)

        subject = subjects.max_deliveries_advisory(channel.stream, channel.consumer(model))
        subs.append(await nc.subscribe(subject, queue=subjects.DEAD_LETTER_GROUP, cb=on_advisory))
    return subs


async def move_to_dead_letters(
    nc: Client,
    js: JetStreamContext,
    channel: contract.WorkChannel,
    model: str,
    seq: int,
    deliveries: int,  # type: ignore[type-arg]
) -> str | None:
    """Move message ``seq`` of ``channel``'s stream to the dead letters and answer its
    sender. Returns its request id (``None`` if it was gone already or unreadable)."""
    try:
        stored = await js.get_msg(channel.stream, seq)
    except NotFoundError:
        return None  # handled by someone else, or acked at the last moment
    data = stored.data or b""
    headers = {"Pd-Stream": channel.stream, "Pd-Seq": str(seq), "Pd-Deliveries": str(deliveries)}
    await js.publish(subjects.dead_letter(channel.stream, model), data, headers=headers)
    await js.delete_msg(channel.stream, seq)
    try:
        message = channel.message.decode(data)
    except MessageError:
        log.error("unreadable message moved to dead letters", extra={"stream": channel.stream, "seq": seq})
        return None
    rid, reply_to = message.rid, message.reply_to  # type: ignore[attr-defined]
    attempt = message.attempt  # type: ignore[attr-defined]
    log.error(
        "message moved to dead letters",
        extra={"stream": channel.stream, "seq": seq, "rid": rid, "deliveries": deliveries},
    )
    text = f"request {rid!r} was delivered {deliveries} times without finishing; it was moved to the dead letters"
    chunk = TokenChunk(rid=rid, seq=0, finish_reason="error", error=ErrorInfo(text), attempt=attempt)
    try:
        await contract.publish(nc, contract.TOKENS, chunk, to=reply_to)
    except Exception as exc:
        log.warning("could not answer a dead letter", extra={"rid": rid, "error": str(exc)})
    return rid
