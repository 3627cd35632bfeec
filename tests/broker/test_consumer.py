"""broker.consumer against a real JetStream: PullConsumer.fetch timing and limits, redelivery,
and decode_deliveries terminating malformed messages.

Latency figures are printed (run with ``-s`` to see them); the bounds are loose sanity
checks for a loaded shared machine, the benchmark measures latency precisely.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from pdserve.broker import subjects
from pdserve.broker.connection import connect, publish_work
from pdserve.broker.consumer import Delivery, PullConsumer, Rejected, decode_deliveries
from pdserve.broker.streams import BrokerConfig, QueueDepth, ensure_model, queue_depth
from pdserve.schemas import GenerateRequest, KVReady

STREAM = subjects.REQUEST_STREAM


def _config(**overrides: Any) -> BrokerConfig:
    values: dict[str, Any] = {"ack_wait": 10.0, "max_deliver": 5, "dedup_window": 30.0, "request_max_age": 60.0}
    values.update(overrides)
    return BrokerConfig(**values)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@pytest.fixture
async def consumer(nc: Client, js: JetStreamContext, model: str) -> AsyncIterator[PullConsumer]:
    """The model's prefill consumer with default (small) settings; tests that need other
    settings call ensure_model again, which updates the consumer in place."""
    await ensure_model(js, model, _config())
    pull = PullConsumer(nc, STREAM, subjects.prefill_consumer(model))
    await pull.start()
    try:
        yield pull
    finally:
        await pull.stop()


@pytest.fixture
async def publisher(nats_server: Any) -> AsyncIterator[Client]:
    """A second connection, as a separate API process would have."""
    client = await connect(nats_server.url, "publisher")
    try:
        yield client
    finally:
        await client.close()


async def _publish(nc: Client, model: str, make_request: Any, rids: list[str]) -> list[GenerateRequest]:
    sent = []
    for rid in rids:
        req = make_request(rid, model=model)
        assert await publish_work(nc, subjects.requests(model), req, rid) is True
        sent.append(req)
    return sent


async def _consumer_info(js: JetStreamContext, model: str) -> Any:
    return await js.consumer_info(STREAM, subjects.prefill_consumer(model))


async def _until(check: Any, timeout: float = 5.0) -> None:
    """Poll the async predicate ``check`` until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached")
        await asyncio.sleep(0.005)


async def _fetch_until(consumer: PullConsumer, count: int, max_msgs: int, timeout: float = 10.0) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        batch = await consumer.fetch(max_msgs, timeout=0.5)
        assert len(batch) <= max_msgs
        got.extend(batch)
    return got


# --------------------------------------------------------------------------- timeouts and limits


@pytest.mark.parametrize("timeout", [0.2, 0.8])
async def test_fetch_times_out_empty(consumer: PullConsumer, timeout: float) -> None:
    start = time.monotonic()
    assert await consumer.fetch(8, timeout=timeout) == []
    elapsed = time.monotonic() - start
    assert elapsed >= timeout * 0.9, f"returned after {elapsed:.3f}s, before the {timeout}s timeout"
    assert elapsed < timeout + 0.5, f"returned after {elapsed:.3f}s for a {timeout}s timeout"


async def test_fetch_timeouts_do_not_leak_into_later_fetches(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    """The server's 408 for an expired pull must not be taken for (or hide) a message later."""
    for _ in range(3):
        assert await consumer.fetch(4, timeout=0.1) == []
    await asyncio.sleep(0.2)  # let any late status arrive in the inbox
    await _publish(nc, model, make_request, ["after-timeouts"])
    got = await consumer.fetch(4, timeout=2.0)
    assert [GenerateRequest.decode(m.data).rid for m in got] == ["after-timeouts"]


async def test_fetch_zero_returns_at_once(consumer: PullConsumer) -> None:
    start = time.monotonic()
    assert await consumer.fetch(0, timeout=5.0) == []
    assert time.monotonic() - start < 2.5  # at once: well inside the timeout, on a loaded runner too


async def test_fetch_requires_start(nc: Client, js: JetStreamContext, model: str) -> None:
    await ensure_model(js, model, _config())
    pull = PullConsumer(nc, STREAM, subjects.prefill_consumer(model))
    with pytest.raises(AssertionError):
        await pull.fetch(1, timeout=0.1)


async def test_fetch_never_returns_more_than_max_msgs(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    sent = await _publish(nc, model, make_request, [f"m{i}" for i in range(10)])
    sizes = []
    rids: list[str] = []
    for _ in range(4):
        batch = await consumer.fetch(3, timeout=2.0)
        sizes.append(len(batch))
        rids.extend(GenerateRequest.decode(m.data).rid for m in batch)
        for m in batch:
            await m.ack()
    assert sizes == [3, 3, 3, 1]
    assert rids == [r.rid for r in sent]  # in order, each once
    assert await consumer.fetch(3, timeout=0.2) == []


async def test_fetch_returns_what_is_there_without_waiting_for_a_full_batch(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    await _publish(nc, model, make_request, ["a", "b", "c"])
    start = time.monotonic()
    got = await consumer.fetch(100, timeout=5.0)
    elapsed = time.monotonic() - start
    assert len(got) == 3
    assert elapsed < 0.5, f"fetch of 3 with max 100 took {elapsed:.3f}s"


async def test_burst_of_64_prepublished_is_fetched_in_few_calls(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    sent = await _publish(nc, model, make_request, [f"b{i}" for i in range(64)])
    calls = 0
    got: list[Any] = []
    start = time.monotonic()
    while len(got) < 64 and calls < 64:
        got.extend(await consumer.fetch(64, timeout=2.0))
        calls += 1
    elapsed = time.monotonic() - start
    print(f"\nprepublished burst of 64: {calls} fetch call(s), {elapsed * 1e3:.1f} ms")
    assert [GenerateRequest.decode(m.data).rid for m in got] == [r.rid for r in sent]
    assert calls <= 2
    assert elapsed < 1.0


async def test_burst_of_64_while_fetching(
    js: JetStreamContext, publisher: Client, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    """A fetch loop runs (like a worker) while another connection publishes 64 at once."""
    published_at: dict[str, float] = {}
    latencies: dict[str, float] = {}
    calls = 0
    total = 64

    async def worker() -> None:
        nonlocal calls
        deadline = time.monotonic() + 15
        while len(latencies) < total and time.monotonic() < deadline:
            batch = await consumer.fetch(64, timeout=1.0)
            now = time.perf_counter()
            if batch:
                calls += 1
            for m in batch:
                rid = GenerateRequest.decode(m.data).rid
                assert rid not in latencies, f"{rid} delivered twice"
                latencies[rid] = now - published_at[rid]
                await m.ack()

    task = asyncio.create_task(worker())

    async def waiting() -> bool:
        return (await _consumer_info(js, model)).num_waiting >= 1

    await _until(waiting)
    reqs = [make_request(f"burst-{i}", model=model) for i in range(total)]

    async def send(req: GenerateRequest) -> None:
        published_at[req.rid] = time.perf_counter()
        assert await publish_work(publisher, subjects.requests(model), req, req.rid)

    await asyncio.gather(*(send(r) for r in reqs))
    await asyncio.wait_for(task, 20)
    assert len(latencies) == total
    values = list(latencies.values())
    p50, p99 = _quantile(values, 0.5), _quantile(values, 0.99)
    print(
        f"\nburst of 64 while fetching: {calls} non-empty fetch calls, p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"
    )
    assert calls <= 32
    assert p50 < 0.5


@pytest.mark.parametrize("max_msgs", [1, 8])
async def test_message_published_while_waiting_is_delivered_promptly(
    js: JetStreamContext, publisher: Client, consumer: PullConsumer, model: str, make_request: Any, max_msgs: int
) -> None:
    latencies = []
    for i in range(100):

        async def fetch_one() -> tuple[list[Any], float]:
            msgs = await consumer.fetch(max_msgs, timeout=5.0)
            return msgs, time.perf_counter()

        task = asyncio.create_task(fetch_one())

        async def waiting() -> bool:
            return (await _consumer_info(js, model)).num_waiting >= 1

        await _until(waiting)  # the fetch is parked on the server before we publish
        req = make_request(f"single-{i}", model=model)
        start = time.perf_counter()
        assert await publish_work(publisher, subjects.requests(model), req, req.rid)
        msgs, done_at = await task
        assert [GenerateRequest.decode(m.data).rid for m in msgs] == [req.rid]
        latencies.append(done_at - start)
        await msgs[0].ack()
    p50, p99 = statistics.median(latencies), _quantile(latencies, 0.99)
    print(f"\nsingle message, fetch({max_msgs}) waiting: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
    assert p50 < 0.020
    assert max(latencies) < 1.0


# --------------------------------------------------------------------------- max_ack_pending


async def test_max_ack_pending_is_respected(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    await ensure_model(js, model, _config(prefill_max_ack_pending=4))
    assert (await _consumer_info(js, model)).config.max_ack_pending == 4
    sent = await _publish(nc, model, make_request, [f"p{i}" for i in range(16)])

    first = await consumer.fetch(16, timeout=2.0)
    assert len(first) == 4
    # Nothing more while four are unacknowledged.
    assert await consumer.fetch(16, timeout=0.3) == []
    info = await _consumer_info(js, model)
    assert info.num_ack_pending == 4

    seen = [GenerateRequest.decode(m.data).rid for m in first]
    outstanding = list(first)
    deadline = time.monotonic() + 30
    while len(seen) < 16 and time.monotonic() < deadline:
        for m in outstanding[:2]:
            await m.ack()
        outstanding = outstanding[2:]
        batch = await consumer.fetch(16, timeout=2.0)
        outstanding.extend(batch)
        seen.extend(GenerateRequest.decode(m.data).rid for m in batch)
        assert len(outstanding) <= 4, f"{len(outstanding)} unacked messages handed out with max_ack_pending=4"
    assert sorted(seen) == sorted(r.rid for r in sent)
    for m in outstanding:
        await m.ack()


async def test_fetch_is_prompt_when_max_ack_pending_limits_the_batch(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    """With 16 waiting and room for 4, fetch(16) has its 4 at once: it must not then sit idle
    waiting for messages the server will not send (a worker would stall on every fetch)."""
    await ensure_model(js, model, _config(prefill_max_ack_pending=4))
    await _publish(nc, model, make_request, [f"p{i}" for i in range(16)])
    start = time.monotonic()
    got = await consumer.fetch(16, timeout=5.0)
    elapsed = time.monotonic() - start
    assert len(got) == 4
    assert elapsed < 1.0, f"fetch(16) took {elapsed:.2f}s to return the 4 messages max_ack_pending allows"


async def test_no_pull_request_outlives_fetch(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    """After fetch returns, the server must hold no pull request for this consumer: otherwise
    messages are handed to this process (and their ack_wait starts) while it is not asking,
    and other workers cannot have them."""
    await ensure_model(js, model, _config(prefill_max_ack_pending=4))
    await _publish(nc, model, make_request, [f"p{i}" for i in range(16)])
    got = await consumer.fetch(16, timeout=5.0)
    assert len(got) == 4
    for m in got:
        await m.ack_sync()
    await asyncio.sleep(0.3)
    info = await _consumer_info(js, model)
    assert info.num_waiting == 0, f"{info.num_waiting} pull request(s) still parked on the server"
    assert info.num_ack_pending == 0, f"{info.num_ack_pending} messages delivered while no fetch was running"


# --------------------------------------------------------------------------- sharing a consumer


async def test_concurrent_fetches_on_one_consumer_split_the_work(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    sent = await _publish(nc, model, make_request, [f"c{i}" for i in range(10)])
    results = await asyncio.gather(*(consumer.fetch(5, timeout=2.0) for _ in range(2)))
    assert all(len(r) <= 5 for r in results)
    rids = [GenerateRequest.decode(m.data).rid for r in results for m in r]
    assert sorted(rids) == sorted(r.rid for r in sent)


async def test_two_workers_share_a_durable_without_duplicates(
    nc: Client, js: JetStreamContext, publisher: Client, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    other = PullConsumer(publisher, STREAM, subjects.prefill_consumer(model))
    await other.start()
    try:
        sent = await _publish(nc, model, make_request, [f"w{i}" for i in range(64)])
        a, b = await asyncio.gather(_fetch_until(consumer, 32, 8, 5.0), _fetch_until(other, 32, 8, 5.0))
        rest = await _fetch_until(consumer, 64 - len(a) - len(b), 64, 5.0)
        rids = [GenerateRequest.decode(m.data).rid for m in a + b + rest]
        assert sorted(rids) == sorted(r.rid for r in sent)
        assert len(rids) == len(set(rids))
    finally:
        await other.stop()


# --------------------------------------------------------------------------- redelivery


async def test_unacked_message_is_redelivered_after_ack_wait(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    ack_wait = 1.0
    await ensure_model(js, model, _config(ack_wait=ack_wait, max_deliver=2))
    await _publish(nc, model, make_request, ["slow"])
    (first,) = await consumer.fetch(4, timeout=2.0)
    delivered_at = time.monotonic()
    good, bad = await decode_deliveries([first], GenerateRequest)
    assert bad == []
    assert good[0].num_delivered == 1

    got = await consumer.fetch(4, timeout=ack_wait + 4.0)
    waited = time.monotonic() - delivered_at
    assert len(got) == 1
    assert waited >= ack_wait * 0.8, f"redelivered after {waited:.2f}s, ack_wait is {ack_wait}s"
    good, _ = await decode_deliveries(got, GenerateRequest)
    assert good[0].message.rid == "slow"
    assert good[0].num_delivered == 2
    assert good[0].raw.metadata.sequence.stream == first.metadata.sequence.stream

    # max_deliver=2: not handed out a third time.
    assert await consumer.fetch(4, timeout=ack_wait * 1.8) == []
    # Dead after max_deliver: neither pending nor ack-pending any more (it stays in the
    # work-queue stream until max_age, invisible to queue_depth).

    async def dead() -> bool:
        info = await _consumer_info(js, model)
        return info.num_ack_pending == 0 and info.num_pending == 0

    await _until(dead)
    assert await queue_depth(js, STREAM, subjects.prefill_consumer(model)) == QueueDepth(0, 0)


async def test_in_progress_postpones_redelivery(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    ack_wait = 1.0
    await ensure_model(js, model, _config(ack_wait=ack_wait))
    await _publish(nc, model, make_request, ["long-job"])
    good, _ = await decode_deliveries(await consumer.fetch(1, timeout=2.0), GenerateRequest)
    (delivery,) = good
    end = time.monotonic() + ack_wait * 1.5
    while time.monotonic() < end:
        await delivery.in_progress()
        assert await consumer.fetch(1, timeout=0.25) == []
    await delivery.ack()
    assert await consumer.fetch(1, timeout=ack_wait * 1.1) == []
    info = await _consumer_info(js, model)
    assert (info.num_redelivered, info.num_ack_pending, info.num_pending) == (0, 0, 0)


async def test_num_delivered_counts_redeliveries(
    nc: Client, js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    await _publish(nc, model, make_request, ["again"])
    counts = []
    for _ in range(3):
        good, bad = await decode_deliveries(await consumer.fetch(1, timeout=2.0), GenerateRequest)
        assert bad == []
        (delivery,) = good
        assert isinstance(delivery, Delivery)
        assert delivery.message.rid == "again"
        assert abs(delivery.received_at - time.time()) < 5
        counts.append(delivery.num_delivered)
        await delivery.nak()
    assert counts == [1, 2, 3]

    # nak with a delay: not back before the delay.
    good, _ = await decode_deliveries(await consumer.fetch(1, timeout=2.0), GenerateRequest)
    assert good[0].num_delivered == 4
    await good[0].nak(delay=0.5)
    start = time.monotonic()
    good, _ = await decode_deliveries(await consumer.fetch(1, timeout=3.0), GenerateRequest)
    assert time.monotonic() - start >= 0.4
    assert good[0].num_delivered == 5
    await good[0].term()

    async def gone() -> bool:
        info = await _consumer_info(js, model)
        return info.num_ack_pending == 0 and info.num_pending == 0

    await _until(gone)
    assert await consumer.fetch(1, timeout=0.3) == []


# --------------------------------------------------------------------------- malformed messages


MALFORMED: list[tuple[bytes, str | None, str | None, str]] = [
    (b"this is not json", None, None, "not JSON"),
    (b"", None, None, "not JSON"),
    (b"\xff\xfe\x00garbage", None, None, "not JSON"),
    (b"[1, 2, 3]", None, None, "object"),
    (
        b'{"v": 2, "rid": "r-v2", "model": "m", "prompt_ids": [1], "reply_to": "pd.tokens.api.r-v2"}',
        "r-v2",
        "pd.tokens.api.r-v2",
        "version",
    ),
    (
        b'{"v": 1, "rid": "r-types", "model": "m", "prompt_ids": "1 2 3", "reply_to": "pd.tokens.api.r-types"}',
        "r-types",
        "pd.tokens.api.r-types",
        "prompt_ids",
    ),
    (b'{"v": 1, "rid": 42, "model": "m", "prompt_ids": [1], "reply_to": ["x"]}', None, None, "rid"),
    (b'{"v": 1, "rid": "r-missing", "model": "m", "prompt_ids": [1]}', "r-missing", None, "reply_to"),
    (
        b'{"v": 1, "rid": "r-neg", "model": "m", "prompt_ids": [-1], "reply_to": "pd.tokens.api.r-neg"}',
        "r-neg",
        "pd.tokens.api.r-neg",
        "non-negative",
    ),
    (
        b'{"v": 1, "rid": "r-samp", "model": "m", "prompt_ids": [1], "reply_to": "t", "sampling": {"top_p": 0}}',
        "r-samp",
        "t",
        "top_p",
    ),
]


async def test_malformed_messages_are_terminated_not_redelivered(
    js: JetStreamContext, consumer: PullConsumer, model: str, make_request: Any
) -> None:
    ack_wait = 1.0
    await ensure_model(js, model, _config(ack_wait=ack_wait))
    subject = subjects.requests(model)
    good_req = make_request("fine", model=model)
    await js.publish(subject, good_req.encode())
    for data, *_ in MALFORMED:
        await js.publish(subject, data)
    # Headers but no body: a stored message, not a pull status, must not be skipped.
    await js.publish(subject, b"", headers={"Nats-Msg-Id": "empty-with-headers"})
    total = len(MALFORMED) + 2

    msgs = await _fetch_until(consumer, total, total)
    assert len(msgs) == total
    good, bad = await decode_deliveries(msgs, GenerateRequest)
    assert [d.message for d in good] == [good_req]
    assert len(bad) == len(MALFORMED) + 1
    assert (bad[-1].rid, bad[-1].reply_to) == (None, None)
    for rejected, (data, rid, reply_to, reason) in zip(bad[:-1], MALFORMED, strict=True):
        assert isinstance(rejected, Rejected)
        assert (rejected.rid, rejected.reply_to) == (rid, reply_to), data
        assert reason.lower() in rejected.error.lower(), (data, rejected.error)
    await good[0].ack()

    async def settled() -> bool:
        info = await _consumer_info(js, model)
        return info.num_ack_pending == 0 and info.num_pending == 0

    await _until(settled)
    # Past ack_wait nothing comes back: terminated, not merely unacknowledged.
    assert await consumer.fetch(total, timeout=ack_wait * 1.5) == []
    info = await _consumer_info(js, model)
    assert info.num_ack_pending == 0
    assert info.num_redelivered == 0
    assert info.num_pending == 0
    assert await queue_depth(js, STREAM, subjects.prefill_consumer(model)) == QueueDepth(0, 0)
    assert (await js.stream_info(STREAM)).state.messages == 0  # work queue: gone from the stream


async def test_malformed_kv_ready_is_terminated(js: JetStreamContext, nc: Client, model: str) -> None:
    ack_wait = 0.5
    await ensure_model(js, model, _config(ack_wait=ack_wait))
    pull = PullConsumer(nc, subjects.KV_STREAM, subjects.decode_consumer(model))
    await pull.start()
    try:
        payload = (
            b'{"v": 1, "rid": "kv-1", "model": "m", "prompt_ids": [1], "output_ids": [2], "reply_to": "back",'
            b' "sampling": {}, "prefill_id": "p", "handle": {"backend": "tcp", "endpoint": "e",'
            b' "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "page_size": 1, "dtype": "f16"},'
            b' "segments": [[4096]], "num_tokens": 1, "expires_at": 0}}'
        )
        await js.publish(subjects.kv_ready(model), payload)
        good, bad = await decode_deliveries(await pull.fetch(4, timeout=2.0), KVReady)
        assert good == []
        assert [(r.rid, r.reply_to) for r in bad] == [("kv-1", "back")]
        assert "segments" in bad[0].error

        async def settled() -> bool:
            info = await js.consumer_info(subjects.KV_STREAM, subjects.decode_consumer(model))
            return info.num_ack_pending == 0

        await _until(settled)
        assert await pull.fetch(4, timeout=ack_wait * 2) == []
        info = await js.consumer_info(subjects.KV_STREAM, subjects.decode_consumer(model))
        assert info.num_redelivered == 0
    finally:
        await pull.stop()
