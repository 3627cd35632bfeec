"""broker.contract against a real nats-server: typed subscribe and publish on core
subjects, the work queue's decoded fetch, and the answer to a malformed message."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from pdserve.broker import contract, queues, subjects
from pdserve.broker.streams import BrokerConfig, ensure_model
from pdserve.schemas import Cancel, KVRelease, Message, TokenChunk


def test_every_channel_names_its_message_its_route_and_its_ends() -> None:
    names = [channel.name for channel in contract.CHANNELS]
    assert len(set(names)) == len(names)
    for channel in contract.CHANNELS:
        assert issubclass(channel.message, Message)
        assert channel.sender and channel.receiver
        assert channel.senders and channel.receivers, f"{channel.name}: roles for the broker's permissions"
        assert channel.name.upper() in (contract.__doc__ or ""), f"{channel.name} missing from the contract's table"
    assert contract.REQUESTS.subject("m") == subjects.requests("m")
    assert contract.REQUESTS.consumer("m") == subjects.prefill_consumer("m")
    assert contract.KV_READY.stream == subjects.KV_STREAM
    assert contract.TOKENS.subject("api", "r") == subjects.tokens("api", "r")
    assert contract.KV_RELEASE.listen("p") == subjects.kv_release("p")
    assert contract.CANCEL.subject() == subjects.CANCEL


async def test_subscribe_hands_decoded_messages_and_survives_bad_ones(nc: Client) -> None:
    got: asyncio.Queue[Cancel] = asyncio.Queue()

    async def handler(cancel: Cancel) -> None:
        if cancel.rid == "boom":
            raise RuntimeError("handler failure")
        await got.put(cancel)

    await contract.subscribe(nc, contract.CANCEL, handler)
    await nc.publish(subjects.CANCEL, b"not json")
    await nc.publish(subjects.CANCEL, Cancel(rid="boom").encode())
    await contract.publish(nc, contract.CANCEL, Cancel(rid="r1", reason="gone"))
    assert await asyncio.wait_for(got.get(), 5) == Cancel(rid="r1", reason="gone")


async def test_subscribe_takes_the_scope_of_the_subject(nc: Client) -> None:
    got: asyncio.Queue[KVRelease] = asyncio.Queue()
    await contract.subscribe(nc, contract.KV_RELEASE, got.put, "prefill-a")
    await contract.publish(nc, contract.KV_RELEASE, KVRelease(rid="other", prefill_id="b"), "prefill-b")
    await contract.publish(nc, contract.KV_RELEASE, KVRelease(rid="mine", prefill_id="a"), "prefill-a")
    assert (await asyncio.wait_for(got.get(), 5)).rid == "mine"
    assert got.empty()


async def test_publish_refuses_a_message_of_another_channel(nc: Client) -> None:
    with pytest.raises(AssertionError, match="cancel carries Cancel"):
        await contract.publish(nc, contract.CANCEL, KVRelease(rid="r", prefill_id="p"))  # type: ignore[arg-type]


async def test_work_queue_decodes_and_answers_what_does_not(
    nc: Client, js: JetStreamContext, model: str, make_request: Any
) -> None:
    await ensure_model(js, model, BrokerConfig(ack_wait=1.0))
    replies: asyncio.Queue[TokenChunk] = asyncio.Queue()
    await contract.subscribe(nc, contract.TOKENS, replies.put, "api")
    good = make_request("good", model=model)
    bad = dataclasses.replace(make_request("bad", model=model), reply_to=subjects.tokens("api", "bad"))
    assert await queues.submit(nc, contract.REQUESTS, good, model, good.rid)
    assert not await queues.submit(nc, contract.REQUESTS, good, model, good.rid)  # deduplicated
    payload = bad.encode().replace(b'"prompt_ids":[1,2,3]', b'"prompt_ids":"1 2 3"')
    await js.publish(subjects.requests(model), payload)

    queue = queues.WorkQueue(nc, contract.REQUESTS, model, "worker-1")
    await queue.start()
    try:
        deliveries = await queue.fetch(8, timeout=2.0)
        if len(deliveries) < 1:
            deliveries += await queue.fetch(8, timeout=2.0)
        assert [d.message for d in deliveries] == [good]
        await deliveries[0].ack()
        answer = await asyncio.wait_for(replies.get(), 5)
        assert (answer.rid, answer.seq, answer.finish_reason, answer.worker_id) == ("bad", 0, "error", "worker-1")
        assert answer.error is not None and "prompt_ids" in answer.error.message
        assert answer.error.type == "invalid_request_error"
        assert await queue.fetch(8, timeout=1.5) == []  # terminated: never redelivered
    finally:
        await queue.stop()


async def test_ask_gets_the_typed_answer_and_fails_fast_with_nobody_listening(nc: Client) -> None:
    import time

    from pdserve.schemas import KVLease, KVLeaseReply

    async def grant(lease: KVLease) -> KVLeaseReply:
        return KVLeaseReply(rid=lease.rid, granted=lease.generation == 7, reason="" if lease.generation == 7 else "no")

    await contract.answer(nc, contract.KV_LEASE, grant, "prefill-a")
    reply = await contract.ask(nc, contract.KV_LEASE, KVLease("r", "prefill-a", 7, 5.0), "prefill-a", timeout=5)
    assert reply == KVLeaseReply(rid="r", granted=True)
    refused = await contract.ask(nc, contract.KV_LEASE, KVLease("r", "prefill-a", 8, 5.0), "prefill-a", timeout=5)
    assert not refused.granted and refused.reason == "no"
    started = time.monotonic()
    with pytest.raises(contract.Unanswered, match="nobody answers"):
        await contract.ask(nc, contract.KV_LEASE, KVLease("r", "gone", 7, 5.0), "gone", timeout=5)
    assert time.monotonic() - started < 2.5  # no responders: at once, not at the 5 s timeout
