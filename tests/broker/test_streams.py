"""broker.streams, broker.connection.publish_work and broker.registry on a real JetStream."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js import api as js_api

from pdserve.broker import subjects
from pdserve.broker.connection import QueueFullError, publish_work
from pdserve.broker.consumer import PullConsumer
from pdserve.broker.registry import WorkerRegistry
from pdserve.broker.streams import (
    BrokerConfig,
    QueueDepth,
    ensure_model,
    queue_depth,
    request_stream,
    worker_bucket,
)
from pdserve.schemas import KVHandle, KVLayout, KVReady, SamplingParams, WorkerInfo

CONFIG = BrokerConfig(
    request_max_age=90.0,
    request_max_bytes=3 << 20,
    request_max_msgs=777,
    kv_max_age=45.0,
    kv_max_bytes=2 << 20,
    dedup_window=30.0,
    ack_wait=7.0,
    max_deliver=3,
    prefill_max_ack_pending=11,
    decode_max_ack_pending=13,
    worker_ttl=1.5,
)


def _kv_ready(rid: str, model: str) -> KVReady:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
    handle = KVHandle(
        backend="tcp", endpoint="127.0.0.1:1", layout=layout, segments=((4096, 512),), num_tokens=3, expires_at=0.0
    )
    return KVReady(
        rid=rid,
        model=model,
        prompt_ids=(1, 2, 3),
        output_ids=(4,),
        reply_to=f"pd.tokens.api.{rid}",
        sampling=SamplingParams(),
        prefill_id="prefill-0",
        handle=handle,
    )


def _worker(worker_id: str, role: str = "prefill", **kwargs: Any) -> WorkerInfo:
    fields: dict[str, Any] = {
        "worker_id": worker_id,
        "role": role,
        "model": "m",
        "host": "127.0.0.1",
        "pid": 1234,
        "capacity": 8,
        "pages_total": 100,
        "pages_used": 0,
        "page_size": 16,
        "requests_in_flight": 0,
    }
    fields.update(kwargs)
    return WorkerInfo(**fields)


async def _messages(js: JetStreamContext, stream: str) -> int:
    return (await js.stream_info(stream)).state.messages


# --------------------------------------------------------------------------- ensure_model


async def test_a_request_stream_of_an_older_release_gains_the_local_and_placed_subjects(
    js: JetStreamContext, model: str
) -> None:
    older = dataclasses.replace(request_stream(CONFIG), subjects=[subjects.REQUEST_SUBJECTS])
    await js.add_stream(older)
    await ensure_model(js, model, CONFIG)
    info = await js.stream_info(subjects.REQUEST_STREAM)
    assert info.config.subjects == [
        subjects.REQUEST_SUBJECTS,
        subjects.URGENT_SUBJECTS,
        subjects.LOCAL_SUBJECTS,
        subjects.PLACED_SUBJECTS,
    ]


async def test_ensure_model_creates_streams_and_consumers(js: JetStreamContext, model: str) -> None:
    await ensure_model(js, model, CONFIG)

    req = (await js.stream_info(subjects.REQUEST_STREAM)).config
    assert req.subjects == [
        subjects.REQUEST_SUBJECTS,
        subjects.URGENT_SUBJECTS,
        subjects.LOCAL_SUBJECTS,
        subjects.PLACED_SUBJECTS,
    ]
    assert req.retention == js_api.RetentionPolicy.WORK_QUEUE
    assert req.storage == js_api.StorageType.FILE
    assert req.discard == js_api.DiscardPolicy.NEW
    assert req.max_age == pytest.approx(CONFIG.request_max_age)
    assert req.max_bytes == CONFIG.request_max_bytes
    assert req.max_msgs == CONFIG.request_max_msgs
    assert req.duplicate_window == pytest.approx(CONFIG.dedup_window)

    kv = (await js.stream_info(subjects.KV_STREAM)).config
    assert kv.subjects == [subjects.KV_SUBJECTS, subjects.URGENT_KV_SUBJECTS]
    assert kv.retention == js_api.RetentionPolicy.WORK_QUEUE
    assert kv.storage == js_api.StorageType.FILE
    assert kv.discard == js_api.DiscardPolicy.NEW
    assert kv.max_age == pytest.approx(CONFIG.kv_max_age)
    assert kv.max_bytes == CONFIG.kv_max_bytes
    assert kv.duplicate_window == pytest.approx(CONFIG.dedup_window)

    for stream, name, subject, max_ack_pending in (
        (subjects.REQUEST_STREAM, subjects.prefill_consumer(model), subjects.requests(model), 11),
        (subjects.REQUEST_STREAM, subjects.urgent_consumer(model), subjects.urgent_requests(model), 11),
        (subjects.REQUEST_STREAM, subjects.local_consumer(model), subjects.local_requests(model), 13),
        (subjects.KV_STREAM, subjects.decode_consumer(model), subjects.kv_ready(model), 13),
        (subjects.KV_STREAM, subjects.urgent_decode_consumer(model), subjects.urgent_kv_ready(model), 13),
    ):
        info = await js.consumer_info(stream, name)
        cfg = info.config
        assert cfg.durable_name == name
        assert cfg.filter_subject == subject
        assert cfg.ack_policy == js_api.AckPolicy.EXPLICIT
        assert cfg.deliver_policy == js_api.DeliverPolicy.ALL
        assert cfg.ack_wait == pytest.approx(CONFIG.ack_wait)
        assert cfg.max_deliver == CONFIG.max_deliver
        assert cfg.max_ack_pending == max_ack_pending
        assert cfg.deliver_subject is None  # pull consumer


async def test_ensure_model_memory_storage(js: JetStreamContext, model: str) -> None:
    await ensure_model(js, model, BrokerConfig(file_storage=False))
    for stream in (subjects.REQUEST_STREAM, subjects.KV_STREAM):
        assert (await js.stream_info(stream)).config.storage == js_api.StorageType.MEMORY


async def test_ensure_model_is_idempotent(nc: Client, js: JetStreamContext, model: str, make_request: Any) -> None:
    await ensure_model(js, model, CONFIG)
    req = make_request("keep-me", model=model)
    assert await publish_work(nc, subjects.requests(model), req, req.rid)

    for _ in range(3):
        await ensure_model(js, model, CONFIG)

    streams = sorted(s.config.name for s in await js.streams_info())
    assert streams == sorted([subjects.REQUEST_STREAM, subjects.KV_STREAM, subjects.DEAD_STREAM])
    assert sorted(c.name for c in await js.consumers_info(subjects.REQUEST_STREAM)) == [
        subjects.local_consumer(model),
        subjects.prefill_consumer(model),
        subjects.urgent_consumer(model),
    ]
    assert sorted(c.name for c in await js.consumers_info(subjects.KV_STREAM)) == [
        subjects.decode_consumer(model),
        subjects.urgent_decode_consumer(model),
    ]
    # Nothing lost, nothing delivered by re-running it.
    assert await _messages(js, subjects.REQUEST_STREAM) == 1
    depth = await queue_depth(js, subjects.REQUEST_STREAM, subjects.prefill_consumer(model))
    assert depth == QueueDepth(pending=1, ack_pending=0)


async def test_ensure_model_concurrent_callers(js: JetStreamContext, model: str) -> None:
    """Several processes start at once: whoever is first creates, the others must not fail."""
    await asyncio.gather(*(ensure_model(js, model, CONFIG) for _ in range(4)))
    assert len(await js.streams_info()) == 3
    assert len(await js.consumers_info(subjects.REQUEST_STREAM)) == 3  # prefill, urgent, local


async def test_two_models_share_the_streams(nc: Client, js: JetStreamContext, make_request: Any) -> None:
    await ensure_model(js, "model-a", CONFIG)
    await ensure_model(js, "model.b", CONFIG)
    names = sorted(c.name for c in await js.consumers_info(subjects.REQUEST_STREAM))
    assert names == sorted(
        f(m)
        for m in ("model-a", "model.b")
        for f in (subjects.prefill_consumer, subjects.urgent_consumer, subjects.local_consumer)
    )
    for m in ("model-a", "model.b"):
        req = make_request(f"for-{m}", model=m)
        assert await publish_work(nc, subjects.requests(m), req, req.rid)
    for m in ("model-a", "model.b"):
        depth = await queue_depth(js, subjects.REQUEST_STREAM, subjects.prefill_consumer(m))
        assert depth == QueueDepth(pending=1, ack_pending=0)


async def test_ensure_model_updates_consumer_settings(js: JetStreamContext, model: str) -> None:
    await ensure_model(js, model, CONFIG)
    changed = BrokerConfig(
        request_max_age=CONFIG.request_max_age,
        request_max_bytes=CONFIG.request_max_bytes,
        request_max_msgs=CONFIG.request_max_msgs,
        kv_max_age=CONFIG.kv_max_age,
        kv_max_bytes=CONFIG.kv_max_bytes,
        dedup_window=CONFIG.dedup_window,
        ack_wait=3.0,
        max_deliver=CONFIG.max_deliver,
        prefill_max_ack_pending=2,
        decode_max_ack_pending=5,
    )
    await ensure_model(js, model, changed)
    prefill = (await js.consumer_info(subjects.REQUEST_STREAM, subjects.prefill_consumer(model))).config
    decode = (await js.consumer_info(subjects.KV_STREAM, subjects.decode_consumer(model))).config
    assert prefill.max_ack_pending == 2
    assert decode.max_ack_pending == 5
    assert prefill.ack_wait == pytest.approx(3.0)
    assert decode.ack_wait == pytest.approx(3.0)


async def test_ensure_model_updates_stream_limits(js: JetStreamContext, model: str) -> None:
    await ensure_model(js, model, CONFIG)
    bigger = BrokerConfig(request_max_msgs=1234, request_max_bytes=5 << 20, kv_max_bytes=4 << 20, request_max_age=120.0)
    await ensure_model(js, model, bigger)
    req = (await js.stream_info(subjects.REQUEST_STREAM)).config
    assert req.max_msgs == 1234
    assert req.max_bytes == 5 << 20
    assert req.max_age == pytest.approx(120.0)
    assert (await js.stream_info(subjects.KV_STREAM)).config.max_bytes == 4 << 20


def test_broker_config_validation() -> None:
    with pytest.raises(ValueError):
        BrokerConfig(ack_wait=0)
    with pytest.raises(ValueError):
        BrokerConfig(max_deliver=0)
    with pytest.raises(ValueError):
        BrokerConfig(prefill_max_ack_pending=0)
    with pytest.raises(ValueError):
        BrokerConfig(decode_max_ack_pending=0)


# --------------------------------------------------------------------------- publish_work


async def test_full_request_stream_raises_queue_full(
    nc: Client, js: JetStreamContext, model: str, make_request: Any
) -> None:
    await ensure_model(js, model, BrokerConfig(request_max_msgs=3, ack_wait=5.0))
    subject = subjects.requests(model)
    for i in range(3):
        req = make_request(f"r{i}", model=model)
        assert await publish_work(nc, subject, req, req.rid) is True
    overflow = make_request("r3", model=model)
    with pytest.raises(QueueFullError):
        await publish_work(nc, subject, overflow, overflow.rid)
    assert await _messages(js, subjects.REQUEST_STREAM) == 3  # discard new: the old ones stay

    # Consuming one makes room again (work queue: acked messages leave the stream).
    consumer = PullConsumer(nc, subjects.REQUEST_STREAM, subjects.prefill_consumer(model))
    await consumer.start()
    try:
        (msg,) = await consumer.fetch(1, timeout=2.0)
        await msg.ack_sync()
    finally:
        await consumer.stop()
    assert await publish_work(nc, subject, overflow, overflow.rid) is True
    assert await _messages(js, subjects.REQUEST_STREAM) == 3


async def test_full_by_bytes_raises_queue_full(nc: Client, js: JetStreamContext, model: str) -> None:
    await ensure_model(js, model, BrokerConfig(kv_max_bytes=4096))
    subject = subjects.kv_ready(model)
    with pytest.raises(QueueFullError):
        for i in range(100):
            ready = _kv_ready(f"k{i}", model)
            assert await publish_work(nc, subject, ready, ready.rid) is True
    assert 0 < await _messages(js, subjects.KV_STREAM) < 100


async def test_duplicate_msg_id_is_not_stored(nc: Client, js: JetStreamContext, model: str, make_request: Any) -> None:
    await ensure_model(js, model, CONFIG)
    subject = subjects.requests(model)
    req = make_request("dup", model=model)
    assert await publish_work(nc, subject, req, "dup") is True
    assert await publish_work(nc, subject, req, "dup") is False
    # Same id, other content: still a duplicate, the first one wins.
    other = make_request("dup", model=model, deadline=123.0)
    assert await publish_work(nc, subject, other, "dup") is False
    assert await _messages(js, subjects.REQUEST_STREAM) == 1
    stored = await js.get_msg(subjects.REQUEST_STREAM, 1)
    assert stored.data == req.encode()
    # A new id is new.
    assert await publish_work(nc, subject, req, "dup-2") is True
    assert await _messages(js, subjects.REQUEST_STREAM) == 2


async def test_duplicate_msg_id_after_consumption(
    nc: Client, js: JetStreamContext, model: str, make_request: Any
) -> None:
    """A retried publish of work already done (acked, removed) is still a duplicate inside the window."""
    await ensure_model(js, model, CONFIG)
    req = make_request("done-once", model=model)
    assert await publish_work(nc, subjects.requests(model), req, req.rid) is True
    consumer = PullConsumer(nc, subjects.REQUEST_STREAM, subjects.prefill_consumer(model))
    await consumer.start()
    try:
        (msg,) = await consumer.fetch(1, timeout=2.0)
        await msg.ack_sync()
    finally:
        await consumer.stop()
    assert await _messages(js, subjects.REQUEST_STREAM) == 0
    assert await publish_work(nc, subjects.requests(model), req, req.rid) is False
    assert await _messages(js, subjects.REQUEST_STREAM) == 0


async def test_publish_to_unknown_subject_is_an_error(
    nc: Client, js: JetStreamContext, model: str, make_request: Any
) -> None:
    await ensure_model(js, model, CONFIG)
    req = make_request("nowhere", model=model)
    with pytest.raises(Exception) as exc_info:
        await publish_work(nc, "pd.nothing.here", req, req.rid, timeout=1.0)
    assert not isinstance(exc_info.value, QueueFullError)


# --------------------------------------------------------------------------- queue_depth


async def test_queue_depth_counts_pending_and_ack_pending(
    nc: Client, js: JetStreamContext, model: str, make_request: Any, eventually: Any
) -> None:
    await ensure_model(js, model, CONFIG)
    stream, name = subjects.REQUEST_STREAM, subjects.prefill_consumer(model)
    assert await queue_depth(js, stream, name) == QueueDepth(0, 0)
    for i in range(5):
        req = make_request(f"q{i}", model=model)
        await publish_work(nc, subjects.requests(model), req, req.rid)

    async def all_pending() -> bool:  # the consumer's count follows the stream's a moment later
        return await queue_depth(js, stream, name) == QueueDepth(pending=5, ack_pending=0)

    await eventually(all_pending, what="five pending")
    assert (await queue_depth(js, stream, name)).total == 5

    consumer = PullConsumer(nc, stream, name)
    await consumer.start()
    try:
        got = await consumer.fetch(2, timeout=2.0)
        assert len(got) == 2
        depth = await queue_depth(js, stream, name)
        assert depth == QueueDepth(pending=3, ack_pending=2)
        assert depth.total == 5
        await got[0].ack()

        async def one_acked() -> bool:
            return await queue_depth(js, stream, name) == QueueDepth(pending=3, ack_pending=1)

        await eventually(one_acked, what="ack counted")
        # A nak'd message goes back into the backlog and is handed out again.
        await got[1].nak()
        assert (await queue_depth(js, stream, name)).total == 4
        rest: dict[int, Any] = {}
        deadline = time.monotonic() + 10
        while len(rest) < 4 and time.monotonic() < deadline:
            for m in await consumer.fetch(4, timeout=1.0):
                rest[m.metadata.sequence.stream] = m
        assert len(rest) == 4
        redelivered = rest[got[1].metadata.sequence.stream]
        assert redelivered.metadata.num_delivered == 2
        assert await queue_depth(js, stream, name) == QueueDepth(pending=0, ack_pending=4)
        for m in rest.values():
            await m.ack()

        async def drained() -> bool:
            return await queue_depth(js, stream, name) == QueueDepth(0, 0)

        await eventually(drained, what="all acks counted")
    finally:
        await consumer.stop()


async def test_queue_depth_of_decode_consumer(nc: Client, js: JetStreamContext, model: str) -> None:
    await ensure_model(js, model, CONFIG)
    for i in range(3):
        ready = _kv_ready(f"kv{i}", model)
        assert await publish_work(nc, subjects.kv_ready(model), ready, ready.rid)
    depth = await queue_depth(js, subjects.KV_STREAM, subjects.decode_consumer(model))
    assert depth == QueueDepth(pending=3, ack_pending=0)
    # The prefill consumer does not see KV messages.
    depth = await queue_depth(js, subjects.REQUEST_STREAM, subjects.prefill_consumer(model))
    assert depth == QueueDepth(0, 0)


# --------------------------------------------------------------------------- worker registry


async def test_worker_bucket_has_ttl(js: JetStreamContext) -> None:
    bucket = await worker_bucket(js, CONFIG)
    status = await bucket.status()
    cfg = status.stream_info.config
    assert status.bucket == subjects.WORKER_BUCKET
    assert cfg.max_age == pytest.approx(CONFIG.worker_ttl)
    assert cfg.max_msgs_per_subject == 1  # history 1
    assert cfg.storage == js_api.StorageType.MEMORY
    # Idempotent: a second call opens the same bucket.
    again = await worker_bucket(js, CONFIG)
    assert (await again.status()).stream_info.config.name == cfg.name
    assert len(await js.streams_info()) == 1


async def test_worker_bucket_follows_a_changed_ttl(js: JetStreamContext) -> None:
    """Entries must vanish ``worker_ttl`` after the last heartbeat also when the bucket was
    made earlier with another ttl (as ensure_model brings stream limits up to date)."""
    await worker_bucket(js, BrokerConfig(worker_ttl=30.0))
    bucket = await worker_bucket(js, BrokerConfig(worker_ttl=1.5))
    assert (await bucket.status()).stream_info.config.max_age == pytest.approx(1.5)


async def test_worker_bucket_concurrent_creation(js: JetStreamContext) -> None:
    buckets = await asyncio.gather(*(worker_bucket(js, CONFIG) for _ in range(4)))
    assert len(buckets) == 4
    assert len(await js.streams_info()) == 1


async def test_registry_put_list_remove(js: JetStreamContext) -> None:
    registry = WorkerRegistry(await worker_bucket(js, BrokerConfig(worker_ttl=30.0)), js)
    assert await registry.list() == []
    d1 = _worker("decode-1", role="decode")
    p2 = _worker("prefill-2")
    p1 = _worker("prefill.1:host")  # not a valid key as is: made one
    for w in (d1, p2, p1):
        await registry.put(w)
    assert await registry.list() == [d1, p2, p1]  # sorted by role, then id ("-" < ".")

    # A heartbeat replaces the entry (history 1).
    busy = _worker("prefill-2", pages_used=50, requests_in_flight=3)
    await registry.put(busy)
    assert await registry.list() == [d1, busy, p1]

    await registry.remove("prefill-2")
    assert await registry.list() == [d1, p1]
    await registry.remove("prefill-2")  # twice: no error
    await registry.remove("never-registered")
    await registry.remove("prefill.1:host")
    await registry.remove("decode-1")
    assert await registry.list() == []

    # Re-registering after a remove works.
    await registry.put(d1)
    assert await registry.list() == [d1]


async def test_registry_skips_bad_entries(js: JetStreamContext) -> None:
    bucket = await worker_bucket(js, BrokerConfig(worker_ttl=30.0))
    registry = WorkerRegistry(bucket, js)
    good = _worker("good")
    await registry.put(good)
    await bucket.put("garbage", b"not json")
    await bucket.put("old-version", b'{"v": 99, "worker_id": "old"}')
    assert await registry.list() == [good]


async def test_registry_entries_expire_after_ttl(js: JetStreamContext, eventually: Any) -> None:
    ttl = 1.5
    registry = WorkerRegistry(await worker_bucket(js, BrokerConfig(worker_ttl=ttl)), js)
    alive, dead = _worker("alive"), _worker("dead")
    await registry.put(alive)
    await registry.put(dead)
    start = time.monotonic()
    assert await registry.list() == [alive, dead]

    async def heartbeat() -> None:
        while True:
            await registry.put(alive)
            await asyncio.sleep(0.2)

    beating = asyncio.create_task(heartbeat())
    try:

        async def only_alive() -> bool:
            return await registry.list() == [alive]

        await eventually(only_alive, timeout=ttl + 8.0, interval=0.05, what="unrefreshed worker expiry")
        expired_after = time.monotonic() - start
        assert expired_after >= ttl * 0.8, f"expired after {expired_after:.2f}s, ttl is {ttl}s"
        # The refreshed worker outlives its ttl.
        await asyncio.sleep(ttl * 0.7)
        assert await registry.list() == [alive]
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)

    async def empty() -> bool:
        return await registry.list() == []

    await eventually(empty, timeout=ttl + 8.0, interval=0.05, what="expiry after heartbeats stop")


async def test_registry_lists_every_worker_while_heartbeats_land(js: JetStreamContext) -> None:
    """A listing taken while workers keep re-putting their entries misses none of them."""
    registry = WorkerRegistry(await worker_bucket(js, BrokerConfig(worker_ttl=30.0)), js)
    workers = [_worker(f"w{i}", role="prefill" if i % 2 else "decode") for i in range(6)]
    for w in workers:
        await registry.put(w)
    stop = asyncio.Event()

    async def heartbeats() -> None:
        while not stop.is_set():
            for w in workers:
                await registry.put(w)

    beating = asyncio.create_task(heartbeats())
    try:
        for _ in range(40):
            listed = await registry.list()
            assert sorted(w.worker_id for w in listed) == sorted(w.worker_id for w in workers)
    finally:
        stop.set()
        await beating
