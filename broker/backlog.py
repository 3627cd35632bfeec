"""A work queue's backlog as the autoscaler reads it: messages waiting and in hand (what
KEDA's JetStream scaler reads), and the work waiting weighed in tokens.

The tokens come from the waiting messages themselves: the oldest ``sample`` of them (those
after the consumer's last delivered sequence) are read and decoded, and their mean times
the number waiting is the estimate (exact when no more than ``sample`` wait). A reading
costs one consumer-info request plus one message read per sampled message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from pdserve.broker.contract import KV_READY, REQUESTS, URGENT_KV_READY, URGENT_REQUESTS, WorkChannel
from pdserve.schemas import GenerateRequest, KVReady, Message, MessageError

log = logging.getLogger(__name__)

DEFAULT_SAMPLE = 32


@dataclass(frozen=True)
class Backlog:
    """``pending``: waiting for a worker; ``ack_pending``: delivered, not acked;
    ``pending_tokens``: the waiting messages' work in tokens (estimated from ``sampled``
    of them)."""

    pending: int
    ack_pending: int
    pending_tokens: int
    sampled: int

    @property
    def lag(self) -> int:
        return self.pending + self.ack_pending

    def __add__(self, other: Backlog) -> Backlog:
        """Two queues one pool takes from (the requests' shared queue and its urgent lane)."""
        return Backlog(
            self.pending + other.pending,
            self.ack_pending + other.ack_pending,
            self.pending_tokens + other.pending_tokens,
            self.sampled + other.sampled,
        )


def work_tokens(message: Message) -> int:
    """The tokens a work message asks a worker to hold: a request's prompt (plus the output a
    resumed request already has, which is computed as prompt); a ``KVReady``'s KV."""
    if isinstance(message, GenerateRequest | KVReady):
        return len(message.prompt_ids) + len(message.output_ids)
    return 0


async def pool_backlog(js: JetStreamContext, role: str, model: str, sample: int = DEFAULT_SAMPLE) -> Backlog:
    """The backlog of ``role``'s pool: its shared queue and its urgent lane together (a lane
    not made yet, by workers of an older version, reads empty)."""
    shared, urgent = (KV_READY, URGENT_KV_READY) if role == "decode" else (REQUESTS, URGENT_REQUESTS)
    backlog = await read_backlog(js, shared, model, sample)
    try:
        return backlog + await read_backlog(js, urgent, model, sample)
    except NotFoundError:
        return backlog


async def read_backlog(
    js: JetStreamContext,
    channel: WorkChannel[GenerateRequest] | WorkChannel[KVReady],
    model: str,
    sample: int = DEFAULT_SAMPLE,
) -> Backlog:
    """``channel``'s backlog for ``model``. Raises what nats-py raises when the broker is
    away or the consumer does not exist yet (``NotFoundError``)."""
    assert channel in (REQUESTS, URGENT_REQUESTS, KV_READY, URGENT_KV_READY)
    info = await js.consumer_info(channel.stream, channel.consumer(model))
    pending, ack_pending = info.num_pending or 0, info.num_ack_pending or 0
    total = sampled = 0
    seq = (info.delivered.stream_seq or 0) + 1 if info.delivered else 1
    while sampled < min(sample, pending):
        try:
            msg = await js.get_msg(channel.stream, seq=seq, subject=channel.subject(model), next=True)
        except NotFoundError:
            break
        try:
            total += work_tokens(channel.message.decode(msg.data or b""))
        except MessageError as exc:
            log.debug("undecodable message in the backlog", extra={"seq": msg.seq, "error": str(exc)})
        sampled += 1
        seq = (msg.seq or seq) + 1
    estimate = round(total * pending / sampled) if sampled else 0
    return Backlog(pending, ack_pending, estimate, sampled)
