"""Stream, consumer and bucket definitions, created idempotently by whoever starts first.

Streams are bounded (``max_age``, ``max_bytes``, ``max_msgs`` with discard-new) so a
stalled worker pool shows up as ``503 Retry-After`` at the API, not as a full disk.
On a clustered server every stream and the registry bucket keep ``replicas`` copies
(``--js-replicas``; consumers follow their stream), so a node may die without losing an
accepted request or a delivery in hand.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from pdserve.broker import subjects

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    """Limits of the JetStream objects. Defaults work on one CPU machine."""

    request_max_age: float = 600.0
    request_max_bytes: int = 1 << 30
    request_max_msgs: int = 100_000
    kv_max_age: float = 600.0
    kv_max_bytes: int = 256 << 20
    dedup_window: float = 120.0
    ack_wait: float = 10.0
    max_deliver: int = 5
    prefill_max_ack_pending: int = 256
    decode_max_ack_pending: int = 256
    worker_ttl: float = 10.0
    file_storage: bool = True
    dead_max_age: float = 7 * 24 * 3600.0
    dead_max_bytes: int = 256 << 20
    replicas: int = 1
    placed_inactive: float = 60.0
    claim_ttl: float = 900.0

    def __post_init__(self) -> None:
        if self.ack_wait <= 0 or self.max_deliver < 1:
            raise ValueError("ack_wait must be positive and max_deliver at least 1")
        if not 1 <= self.replicas <= 5:
            raise ValueError("replicas must be 1 to 5 (JetStream's limit)")
        if self.prefill_max_ack_pending < 1 or self.decode_max_ack_pending < 1:
            raise ValueError("max_ack_pending must be at least 1")


def _storage(config: BrokerConfig) -> js_api.StorageType:
    return js_api.StorageType.FILE if config.file_storage else js_api.StorageType.MEMORY


def request_stream(config: BrokerConfig) -> js_api.StreamConfig:
    return js_api.StreamConfig(
        name=subjects.REQUEST_STREAM,
        subjects=[
            subjects.REQUEST_SUBJECTS,
            subjects.URGENT_SUBJECTS,
            subjects.LOCAL_SUBJECTS,
            subjects.PLACED_SUBJECTS,
        ],
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        storage=_storage(config),
        num_replicas=config.replicas,
        discard=js_api.DiscardPolicy.NEW,
        max_age=config.request_max_age,
        max_bytes=config.request_max_bytes,
        max_msgs=config.request_max_msgs,
        duplicate_window=config.dedup_window,
    )


def kv_stream(config: BrokerConfig) -> js_api.StreamConfig:
    return js_api.StreamConfig(
        name=subjects.KV_STREAM,
        subjects=[subjects.KV_SUBJECTS, subjects.URGENT_KV_SUBJECTS],
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        storage=_storage(config),
        num_replicas=config.replicas,
        discard=js_api.DiscardPolicy.NEW,
        max_age=config.kv_max_age,
        max_bytes=config.kv_max_bytes,
        duplicate_window=config.dedup_window,
    )


def dead_stream(config: BrokerConfig) -> js_api.StreamConfig:
    """Messages delivered ``max_deliver`` times without being done, kept for inspection
    (oldest dropped first)."""
    return js_api.StreamConfig(
        name=subjects.DEAD_STREAM,
        subjects=[subjects.DEAD_SUBJECTS],
        retention=js_api.RetentionPolicy.LIMITS,
        storage=_storage(config),
        num_replicas=config.replicas,
        discard=js_api.DiscardPolicy.OLD,
        max_age=config.dead_max_age,
        max_bytes=config.dead_max_bytes,
    )


def _consumer(
    name: str, subject: str, max_ack_pending: int, config: BrokerConfig, inactive_threshold: float | None = None
) -> js_api.ConsumerConfig:
    return js_api.ConsumerConfig(
        inactive_threshold=inactive_threshold,
        name=name,
        durable_name=name,
        filter_subject=subject,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        deliver_policy=js_api.DeliverPolicy.ALL,
        ack_wait=config.ack_wait,
        max_deliver=config.max_deliver,
        max_ack_pending=max_ack_pending,
        max_waiting=512,
    )


async def _ensure_stream(js: JetStreamContext, stream: js_api.StreamConfig) -> None:
    try:
        await js.add_stream(stream)
    except BadRequestError:
        # Exists with other settings: bring limits up to date (subjects/retention are fixed).
        await js.update_stream(stream)


async def _ensure_consumer(js: JetStreamContext, stream: str, consumer: js_api.ConsumerConfig) -> None:
    try:
        # With ``name`` set the server creates or updates (max_ack_pending, ack_wait...).
        await js.add_consumer(stream, consumer)
    except BadRequestError as exc:
        log.warning(
            "consumer exists with settings that cannot change", extra={"consumer": consumer.name, "error": str(exc)}
        )


async def ensure_model(js: JetStreamContext, model: str, config: BrokerConfig) -> None:
    """Create (or update) the streams and the model's consumers (prefill and decode, each with
    its urgent lane, and the decode workers' local prefill). Idempotent."""
    await _ensure_stream(js, request_stream(config))
    await _ensure_stream(js, kv_stream(config))
    await _ensure_stream(js, dead_stream(config))
    await _ensure_consumer(
        js,
        subjects.REQUEST_STREAM,
        _consumer(subjects.prefill_consumer(model), subjects.requests(model), config.prefill_max_ack_pending, config),
    )
    await _ensure_consumer(
        js,
        subjects.REQUEST_STREAM,
        _consumer(
            subjects.urgent_consumer(model), subjects.urgent_requests(model), config.prefill_max_ack_pending, config
        ),
    )
    await _ensure_consumer(
        js,
        subjects.REQUEST_STREAM,
        _consumer(
            subjects.local_consumer(model), subjects.local_requests(model), config.decode_max_ack_pending, config
        ),
    )
    await _ensure_consumer(
        js,
        subjects.KV_STREAM,
        _consumer(subjects.decode_consumer(model), subjects.kv_ready(model), config.decode_max_ack_pending, config),
    )
    await _ensure_consumer(
        js,
        subjects.KV_STREAM,
        _consumer(
            subjects.urgent_decode_consumer(model),
            subjects.urgent_kv_ready(model),
            config.decode_max_ack_pending,
            config,
        ),
    )


async def ensure_placed_consumer(js: JetStreamContext, model: str, worker_id: str, config: BrokerConfig) -> None:
    """The durable consumer of the requests placed on ``worker_id`` (its own subject, which
    no other consumer's filter overlaps); the server deletes it ``placed_inactive`` seconds
    after its worker stops pulling."""
    await _ensure_consumer(
        js,
        subjects.REQUEST_STREAM,
        _consumer(
            subjects.placed_consumer(model, worker_id),
            subjects.placed(model, worker_id),
            config.prefill_max_ack_pending,
            config,
            inactive_threshold=config.placed_inactive,
        ),
    )


async def _memory_bucket(js: JetStreamContext, name: str, ttl: float, replicas: int) -> tuple[KeyValue, bool]:
    """The key-value bucket ``name`` in memory, made with ``ttl`` and ``replicas`` if missing
    (another process may make it at the same moment); whether this call made it."""
    try:
        return await js.key_value(name), False
    except (BucketNotFoundError, NotFoundError):
        pass
    try:
        config = js_api.KeyValueConfig(
            bucket=name, history=1, ttl=ttl, storage=js_api.StorageType.MEMORY, replicas=replicas
        )
        return await js.create_key_value(config), True
    except BadRequestError:  # created by someone else meanwhile
        return await js.key_value(name), False


async def claim_bucket(js: JetStreamContext, config: BrokerConfig) -> KeyValue:
    """Claims of placed requests (:mod:`pdserve.broker.claims`), kept ``claim_ttl`` seconds."""
    bucket, _ = await _memory_bucket(js, subjects.CLAIM_BUCKET, config.claim_ttl, config.replicas)
    return bucket


async def worker_bucket(js: JetStreamContext, config: BrokerConfig) -> KeyValue:
    """The registry bucket; entries vanish ``worker_ttl`` seconds after their last heartbeat.

    An existing bucket with another TTL or replica count is brought to this one."""
    bucket, made = await _memory_bucket(js, subjects.WORKER_BUCKET, config.worker_ttl, config.replicas)
    if made:
        return bucket
    info = await js.stream_info(subjects.bucket_stream(subjects.WORKER_BUCKET))
    if info.config.max_age != config.worker_ttl or (info.config.num_replicas or 1) != config.replicas:
        window = min(info.config.duplicate_window or config.worker_ttl, config.worker_ttl)
        await js.update_stream(
            dataclasses.replace(
                info.config, max_age=config.worker_ttl, duplicate_window=window, num_replicas=config.replicas
            )
        )
    return bucket


@dataclasses.dataclass(frozen=True)
class QueueDepth:
    """A consumer's backlog: waiting in the stream plus delivered but not yet acked."""

    pending: int
    ack_pending: int

    @property
    def total(self) -> int:
        return self.pending + self.ack_pending


async def queue_depth(js: JetStreamContext, stream: str, consumer: str) -> QueueDepth:
    info = await js.consumer_info(stream, consumer)
    return QueueDepth(pending=info.num_pending or 0, ack_pending=info.num_ack_pending or 0)


async def queue_age(js: JetStreamContext, stream: str, subject: str) -> float:
    """Seconds the oldest message on ``subject`` has been in ``stream`` (0 when none):
    in a work-queue stream, the oldest request not yet done, waiting or in hand."""
    try:
        oldest = await js.get_msg(stream, seq=0, subject=subject, next=True)
    except NotFoundError:
        return 0.0
    if oldest.time is None:
        return 0.0
    return max(time.time() - oldest.time.timestamp(), 0.0)
