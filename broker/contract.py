"""The wire contract: every channel between pdserve's processes, the one message type it
carries, how it travels, who sends it and who receives it, and the typed ends that
send and receive on it.

| channel | message | travels on | sender → receiver |
| --- | --- | --- | --- |
| ``REQUESTS`` | ``GenerateRequest`` | stream ``PD_REQUESTS``, ``pd.req.<model>``, pull consumer ``prefill-<model>`` | API → prefill and unified workers |
| ``URGENT_REQUESTS`` | ``GenerateRequest`` | stream ``PD_REQUESTS``, ``pd.urgent.<model>``, pull consumer ``urgent-<model>`` | API → prefill and unified workers, for a request whose ``priority`` is below 0: taken even while a worker is full (it gives such a request the seat of one of a lower priority) |
| ``LOCAL_REQUESTS`` | ``GenerateRequest`` | stream ``PD_REQUESTS``, ``pd.local.<model>``, pull consumer ``local-<model>`` | API → decode workers, which prefill it themselves |
| ``PLACED`` | ``GenerateRequest`` | stream ``PD_REQUESTS``, ``pd.place.<model>.<worker-id>``, pull consumer ``place-<model>-<worker-id>`` | API → the one worker it placed the request on |
| ``KV_READY`` | ``KVReady`` | stream ``PD_KV``, ``pd.kv.<model>``, pull consumer ``decode-<model>`` | prefill → decode |
| ``URGENT_KV_READY`` | ``KVReady`` | stream ``PD_KV``, ``pd.kvurgent.<model>``, pull consumer ``decode-urgent-<model>`` | prefill → decode, for a request whose ``priority`` is below 0: taken even while a decode worker is full |
| ``TOKENS`` | ``TokenChunk`` | core ``pd.tokens.<api-id>.<rid>`` (the request's ``reply_to``) | workers → the API that asked |
| ``TOKEN_BATCHES`` | ``TokenBatch`` | core ``pd.tokens.<api-id>`` (the request's ``batch_to``) | decode and unified workers, one per step and API → that API |
| ``CANCEL`` | ``Cancel`` | core ``pd.cancel``, fan-out | API → every worker |
| ``KV_RELEASE`` | ``KVRelease`` | core ``pd.release.<prefill-id>`` | decode → the prefill worker holding the KV |
| ``KV_LEASE`` | ``KVLease`` → ``KVLeaseReply`` | core request/reply ``pd.lease.<prefill-id>`` | decode asks the prefill worker holding the KV, before reading it |
| ``KV_LINK`` | ``KVLink`` → ``KVLinkReply`` | core request/reply ``pd.link.<prefill-id>`` | a decode worker of the ``nccl``/``gloo`` backends opens its communicator with the prefill worker |
| ``KV_PUSH`` | ``KVPush`` → ``KVPushReply`` | core request/reply ``pd.push.<prefill-id>`` | decode asks the prefill worker to send a request's pages over their communicator |
| ``FLUSH_CACHE`` | ``FlushCache`` → ``FlushCacheReply`` | core request/reply ``pd.flush.<worker-id>`` | the API (``/flush_cache``, when enabled) asks each worker to forget its cached prefixes |
| ``KV_EVENTS`` | ``KVEvents`` | core ``pd.kvevents.<model>`` | workers → API (index of cached prefixes) |
| ``CLAIMS`` | ``PlacementClaim`` | key-value bucket ``PD_CLAIMS``, one key per placed attempt | the placed worker or the API, whoever stores it first |
| ``WORKERS`` | ``WorkerInfo`` | key-value bucket ``PD_WORKERS``, one key per worker | every worker (heartbeat) → API |

A work message delivered ``max_deliver`` times without being done is moved to the
``PD_DEAD`` stream (``pd.dead.<stream>.<model>``) by whoever hears JetStream's advisory
first, and its sender is answered (:mod:`pdserve.broker.deadletter`).

Names come from :mod:`pdserve.broker.subjects`. Handlers never see bytes: :func:`subscribe`
(core NATS), :func:`answer` and :func:`ask` (core request/reply) and
:class:`~pdserve.broker.queues.WorkQueue` (JetStream) decode each message as its channel's type.
A message that does not decode is logged and dropped (core) or terminated, never
redelivered (JetStream); when a request id and a reply subject can be read from it, its
sender gets an error ``TokenChunk``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from nats import errors as nats_errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from pdserve.broker import subjects
from pdserve.broker.consumer import best_guess
from pdserve.schemas import (
    Cancel,
    ErrorInfo,
    FlushCache,
    FlushCacheReply,
    GenerateRequest,
    KVEvents,
    KVLease,
    KVLeaseReply,
    KVLink,
    KVLinkReply,
    KVPush,
    KVPushReply,
    KVReady,
    KVRelease,
    Message,
    MessageError,
    PlacementClaim,
    TokenBatch,
    TokenChunk,
    WorkerInfo,
)

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)


@dataclass(frozen=True)
class Channel(Generic[M]):
    """Core NATS: no storage, delivered to whoever listens now. ``subject(*scope)`` is
    where a sender publishes, ``listen(*scope)`` what a receiver subscribes to; with
    ``per_receiver`` the scope is the receiver's own id (an API's replies), which its
    broker user is limited to."""

    name: str
    message: type[M]
    subject: Callable[..., str]
    listen: Callable[..., str]
    sender: str
    receiver: str
    senders: tuple[str, ...] = ()  # roles, for the broker's permissions
    receivers: tuple[str, ...] = ()
    per_receiver: bool = True


@dataclass(frozen=True)
class Service(Generic[M, R]):
    """Core NATS request/reply: the receiver listening at ``listen(*scope)`` answers each
    ``message`` with one ``reply``; nobody listening is an error at once, not a timeout."""

    name: str
    message: type[M]
    reply: type[R]
    subject: Callable[..., str]
    listen: Callable[..., str]
    sender: str
    receiver: str
    senders: tuple[str, ...] = ()  # roles, for the broker's permissions
    receivers: tuple[str, ...] = ()


class Unanswered(RuntimeError):
    """A :func:`ask` got no usable answer: nobody listens, no reply in time, or a bad reply."""


@dataclass(frozen=True)
class WorkChannel(Generic[M]):
    """JetStream work queue: stored, deduplicated on the request id, taken once by one
    worker of the model's durable pull consumer and acknowledged when done."""

    name: str
    message: type[M]
    stream: str
    subject: Callable[..., str]  # (model, *scope)
    consumer: Callable[..., str]
    sender: str
    receiver: str
    senders: tuple[str, ...] = ()  # roles, for the broker's permissions
    receivers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Bucket(Generic[M]):
    """JetStream key-value: one entry per key, gone ``worker_ttl`` after its last put."""

    name: str
    message: type[M]
    bucket: str
    key: Callable[[str], str]
    sender: str
    receiver: str
    senders: tuple[str, ...] = ()  # roles, for the broker's permissions
    receivers: tuple[str, ...] = ()


REQUESTS = WorkChannel(
    "requests",
    GenerateRequest,
    subjects.REQUEST_STREAM,
    subjects.requests,
    subjects.prefill_consumer,
    sender="API (or any direct publisher)",
    receiver="prefill and unified workers",
    senders=("api", "client"),
    receivers=("prefill", "unified"),
)
URGENT_REQUESTS = WorkChannel(
    "urgent_requests",
    GenerateRequest,
    subjects.REQUEST_STREAM,
    subjects.urgent_requests,
    subjects.urgent_consumer,
    sender="API (or any direct publisher), for a request whose priority is below 0",
    receiver="prefill and unified workers, even while full of requests of a lower priority",
    senders=("api", "client"),
    receivers=("prefill", "unified"),
)
LOCAL_REQUESTS = WorkChannel(
    "local_requests",
    GenerateRequest,
    subjects.REQUEST_STREAM,
    subjects.local_requests,
    subjects.local_consumer,
    sender="API, for a request it places on a decode worker (conditional disaggregation)",
    receiver="decode workers, which prefill and decode it themselves while they have room",
    senders=("api",),
    receivers=("decode",),
)
PLACED = WorkChannel(
    "placed",
    GenerateRequest,
    subjects.REQUEST_STREAM,
    subjects.placed,
    subjects.placed_consumer,
    sender="API, for a request whose prefix one worker's cache holds (prefix-aware placement)",
    receiver="that worker alone (prefill or unified), after it claims the request",
    senders=("api",),
    receivers=("prefill", "unified"),
)
KV_READY = WorkChannel(
    "kv_ready",
    KVReady,
    subjects.KV_STREAM,
    subjects.kv_ready,
    subjects.decode_consumer,
    sender="prefill worker",
    receiver="decode workers",
    senders=("prefill",),
    receivers=("decode",),
)
URGENT_KV_READY = WorkChannel(
    "urgent_kv_ready",
    KVReady,
    subjects.KV_STREAM,
    subjects.urgent_kv_ready,
    subjects.urgent_decode_consumer,
    sender="prefill worker, for a request whose priority is below 0",
    receiver="decode workers, even while full of requests of a lower priority",
    senders=("prefill",),
    receivers=("decode",),
)
TOKENS = Channel(
    "tokens",
    TokenChunk,
    subjects.tokens,
    subjects.tokens_prefix,
    sender="prefill, decode and unified workers, at the request's reply_to",
    receiver="the API instance (or direct publisher) that published the request",
    senders=("prefill", "decode", "unified"),
    receivers=("api", "client"),
)
TOKEN_BATCHES = Channel(
    "token_batches",
    TokenBatch,
    subjects.token_batches,
    subjects.token_batches,
    sender="decode and unified workers: one engine step's chunks for the requests whose batch_to it is",
    receiver="the API instance (or direct publisher) that published those requests",
    senders=("decode", "unified"),
    receivers=("api", "client"),
)
CANCEL = Channel(
    "cancel",
    Cancel,
    subjects.cancel,
    subjects.cancel,
    sender="API on client disconnect (or a direct publisher)",
    receiver="every worker",
    senders=("api", "client"),
    receivers=("prefill", "decode", "unified"),
)
KV_RELEASE = Channel(
    "kv_release",
    KVRelease,
    subjects.kv_release,
    subjects.kv_release,
    sender="decode worker, after its pull (or instead of one)",
    receiver="the prefill worker holding the KV",
    senders=("decode",),
    receivers=("prefill",),
)
KV_LEASE = Service(
    "kv_lease",
    KVLease,
    KVLeaseReply,
    subjects.kv_lease,
    subjects.kv_lease,
    sender="decode worker, before it reads a handle",
    receiver="the prefill worker holding the KV",
    senders=("decode",),
    receivers=("prefill",),
)
KV_LINK = Service(
    "kv_link",
    KVLink,
    KVLinkReply,
    subjects.kv_link,
    subjects.kv_link,
    sender="decode worker (nccl/gloo backends), before its first pull from a prefill worker",
    receiver="the prefill worker, which checks the KV layout and builds its side",
    senders=("decode",),
    receivers=("prefill",),
)
KV_PUSH = Service(
    "kv_push",
    KVPush,
    KVPushReply,
    subjects.kv_push,
    subjects.kv_push,
    sender="decode worker (nccl/gloo backends), once it holds a lease on the pages",
    receiver="the prefill worker, which queues one send of the pages on the link",
    senders=("decode",),
    receivers=("prefill",),
)
KV_EVENTS = Channel(
    "kv_events",
    KVEvents,
    subjects.kv_events,
    subjects.kv_events,
    sender="every worker of the model, after an engine step that changed its prefix cache",
    receiver="the API instances (their index of which worker holds which prefix)",
    senders=("prefill", "decode", "unified"),
    receivers=("api",),
    per_receiver=False,
)
FLUSH_CACHE = Service(
    "flush_cache",
    FlushCache,
    FlushCacheReply,
    subjects.flush_cache,
    subjects.flush_cache,
    sender="API (/flush_cache, when enabled), one request per worker of the registry",
    receiver="each worker, which forgets every cached prefix",
    senders=("api",),
    receivers=("prefill", "decode", "unified"),
)
WORKERS = Bucket(
    "workers",
    WorkerInfo,
    subjects.WORKER_BUCKET,
    subjects.worker_key,
    sender="every worker, each heartbeat",
    receiver="API (/health, /workers)",
    senders=("prefill", "decode", "unified"),
    receivers=("api", "decode"),
)

CLAIMS = Bucket(
    "claims",
    PlacementClaim,
    subjects.CLAIM_BUCKET,
    subjects.claim_key,
    sender="a worker taking a placed request, or the API moving it to the shared queue",
    receiver="the same roles, reading who holds a claim their own store found taken",
    senders=("api", "prefill", "unified"),
    receivers=("api", "prefill", "unified"),
)

CHANNELS = (
    REQUESTS,
    URGENT_REQUESTS,
    LOCAL_REQUESTS,
    PLACED,
    KV_READY,
    URGENT_KV_READY,
    TOKENS,
    TOKEN_BATCHES,
    CANCEL,
    KV_RELEASE,
    KV_LEASE,
    KV_LINK,
    KV_PUSH,
    KV_EVENTS,
    FLUSH_CACHE,
    WORKERS,
    CLAIMS,
)


def request_channel(request: GenerateRequest) -> WorkChannel[GenerateRequest]:
    """The shared queue a request goes to: :data:`URGENT_REQUESTS` for a priority above the
    default (``priority`` below 0), else :data:`REQUESTS`."""
    return URGENT_REQUESTS if request.sampling.priority < 0 else REQUESTS


def kv_ready_channel(ready: KVReady) -> WorkChannel[KVReady]:
    """The queue a prefilled request goes to: :data:`URGENT_KV_READY` for a priority above
    the default, else :data:`KV_READY`."""
    return URGENT_KV_READY if ready.sampling.priority < 0 else KV_READY


# ---- core NATS ---------------------------------------------------------------------
async def subscribe(
    nc: Client, channel: Channel[M], handler: Callable[[M], Awaitable[None]], *scope: str
) -> Subscription:
    """Subscribe to ``channel.listen(*scope)``; ``handler`` gets each decoded message.

    A message that does not decode is logged and dropped (answered when it names a
    reply subject); an exception from ``handler`` is logged, and the subscription goes on.
    """

    async def receive(msg: Msg) -> None:
        try:
            message = channel.message.decode(msg.data)
        except MessageError as exc:
            log.warning(
                "malformed message dropped", extra={"channel": channel.name, "subject": msg.subject, "error": str(exc)}
            )
            rid, reply_to = best_guess(msg.data)
            await answer_malformed(nc, rid, reply_to, str(exc), code=exc.code)
            return
        try:
            await handler(message)
        except Exception:
            log.exception("handler failed", extra={"channel": channel.name, "subject": msg.subject})

    return await nc.subscribe(channel.listen(*scope), cb=receive)


async def answer(nc: Client, service: Service[M, R], handler: Callable[[M], Awaitable[R]], *scope: str) -> Subscription:
    """Answer requests at ``service.listen(*scope)`` with what ``handler`` returns.

    A request that does not decode gets no answer (its asker gives up); an exception from
    ``handler`` is logged, unanswered, and the subscription goes on."""

    async def receive(msg: Msg) -> None:
        try:
            message = service.message.decode(msg.data)
        except MessageError as exc:
            log.warning("malformed request dropped", extra={"service": service.name, "error": str(exc)})
            return
        try:
            reply = await handler(message)
        except Exception:
            log.exception("handler failed", extra={"service": service.name, "subject": msg.subject})
            return
        assert isinstance(reply, service.reply), f"{service.name} answers with {service.reply.__name__}"
        if msg.reply:
            await nc.publish(msg.reply, reply.encode())

    return await nc.subscribe(service.listen(*scope), cb=receive)


async def ask(nc: Client, service: Service[M, R], message: M, *scope: str, timeout: float) -> R:
    """Send ``message`` to ``service.subject(*scope)`` and return the decoded reply.

    Raises :class:`Unanswered` when nobody listens, no reply comes within ``timeout``, the
    connection is away, or the reply does not decode."""
    assert isinstance(message, service.message), f"{service.name} carries {service.message.__name__}"
    try:
        msg = await nc.request(service.subject(*scope), message.encode(), timeout=timeout)
    except nats_errors.NoRespondersError:
        raise Unanswered(f"nobody answers {service.name} at {service.subject(*scope)}") from None
    except (nats_errors.Error, TimeoutError) as exc:
        raise Unanswered(f"{service.name}: {exc or type(exc).__name__}") from None
    try:
        return service.reply.decode(msg.data)
    except MessageError as exc:
        raise Unanswered(f"{service.name}: bad reply: {exc}") from None


async def publish(nc: Client, channel: Channel[M], message: M, *scope: str, to: str | None = None) -> None:
    """Send ``message`` on ``channel``: at ``to`` (a reply subject named by the receiver)
    or at ``channel.subject(*scope)``. Raises what the connection raises."""
    assert isinstance(message, channel.message), f"{channel.name} carries {channel.message.__name__}"
    await nc.publish(to if to is not None else channel.subject(*scope), message.encode())


async def answer_malformed(
    nc: Client,
    rid: str | None,
    reply_to: str | None,
    error: str,
    receiver_id: str = "",
    code: str = MessageError.code,
) -> None:
    """Tell the sender of a message that did not decode, if its rid and reply subject are
    known: an error chunk with ``code`` (``malformed_message``, or ``unsupported_version``
    for a major version this receiver does not speak)."""
    if not (rid and reply_to):
        return
    chunk = TokenChunk(
        rid=rid,
        seq=0,
        finish_reason="error",
        error=ErrorInfo(f"malformed message: {error}", "invalid_request_error", code),
        worker_id=receiver_id,
    )
    try:
        await publish(nc, TOKENS, chunk, to=reply_to)
    except Exception as exc:  # a bad reply subject must not take the receiver down
        log.warning("could not answer a malformed message", extra={"rid": rid, "error": str(exc)})
