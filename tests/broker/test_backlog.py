"""broker.backlog against a real JetStream: messages waiting and in hand, and the work
waiting weighed in tokens, read off the waiting messages themselves."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from pdserve.broker import contract, queues
from pdserve.broker.backlog import Backlog, pool_backlog, read_backlog, work_tokens
from pdserve.broker.streams import BrokerConfig, ensure_model
from pdserve.schemas import GenerateRequest, SamplingParams


def _request(rid: str, model: str, prompt_len: int, output_len: int = 0) -> GenerateRequest:
    ids = tuple(range(prompt_len))
    return GenerateRequest(
        rid=rid, model=model, prompt_ids=ids, reply_to=f"pd.tokens.api.{rid}", output_ids=ids[:output_len]
    )


async def _submit(nc: Client, model: str, lengths: list[int]) -> None:
    for i, n in enumerate(lengths):
        request = _request(f"r{i}", model, n)
        assert await queues.submit(nc, contract.REQUESTS, request, model, request.rid)


async def test_an_empty_queue_has_no_backlog(js: JetStreamContext, model: str) -> None:
    await ensure_model(js, model, BrokerConfig())
    assert await read_backlog(js, contract.REQUESTS, model) == Backlog(0, 0, 0, 0)
    assert await read_backlog(js, contract.KV_READY, model) == Backlog(0, 0, 0, 0)


async def test_waiting_prompt_tokens_are_counted_and_what_is_in_hand_is_not(
    nc: Client, js: JetStreamContext, model: str, eventually: Callable[..., Awaitable[Any]]
) -> None:
    await ensure_model(js, model, BrokerConfig())
    lengths = [10, 2000, 30, 4000, 50, 60]
    await _submit(nc, model, lengths)

    async def counted(pending: int, in_hand: int) -> bool:  # the consumer's counts may trail a moment
        backlog = await read_backlog(js, contract.REQUESTS, model)
        return (backlog.pending, backlog.ack_pending) == (pending, in_hand)

    await eventually(lambda: counted(6, 0), what="all six counted")
    backlog = await read_backlog(js, contract.REQUESTS, model)
    assert backlog == Backlog(pending=6, ack_pending=0, pending_tokens=sum(lengths), sampled=6)
    assert backlog.lag == 6

    queue = queues.WorkQueue(nc, contract.REQUESTS, model, "test-worker")
    await queue.start()
    try:
        taken = await queue.fetch(2, 5.0)  # the two oldest, in hand now
        assert [len(d.message.prompt_ids) for d in taken] == [10, 2000]
        await eventually(lambda: counted(4, 2), what="two in hand")
        backlog = await read_backlog(js, contract.REQUESTS, model)
        assert backlog == Backlog(pending=4, ack_pending=2, pending_tokens=30 + 4000 + 50 + 60, sampled=4)
        for d in taken:
            await d.ack()
    finally:
        await queue.stop()

    async def acked() -> bool:
        backlog = await read_backlog(js, contract.REQUESTS, model)
        return (backlog.pending, backlog.ack_pending) == (4, 0)

    await eventually(acked, what="acks seen by the consumer")


async def test_a_deep_queue_is_estimated_from_its_oldest_messages(
    nc: Client, js: JetStreamContext, model: str, eventually: Callable[..., Awaitable[Any]]
) -> None:
    await ensure_model(js, model, BrokerConfig())
    await _submit(nc, model, [100, 300] * 20)

    async def all_counted() -> bool:  # the consumer's count may trail the stream's acks a moment under load
        return (await read_backlog(js, contract.REQUESTS, model, sample=8)).pending == 40

    await eventually(all_counted, what="the consumer counting all 40")
    backlog = await read_backlog(js, contract.REQUESTS, model, sample=8)
    assert backlog == Backlog(pending=40, ack_pending=0, pending_tokens=40 * 200, sampled=8)


async def test_the_prefill_pool_s_backlog_counts_its_urgent_lane(
    nc: Client, js: JetStreamContext, model: str, eventually: Callable[..., Awaitable[Any]]
) -> None:
    """Requests of priority below 0 wait in their own queue, which the prefill pool also
    takes from: its backlog is both queues'."""
    await ensure_model(js, model, BrokerConfig())
    await _submit(nc, model, [10, 20])
    for i, n in enumerate((300, 400, 500)):
        request = _request(f"u{i}", model, n)
        request = dataclasses.replace(request, sampling=SamplingParams(priority=-1))
        assert contract.request_channel(request) is contract.URGENT_REQUESTS
        assert await queues.submit(nc, contract.URGENT_REQUESTS, request, model, request.rid)

    async def counted() -> bool:
        return (await pool_backlog(js, "prefill", model)).pending == 5

    await eventually(counted, what="both queues counted")
    assert await pool_backlog(js, "prefill", model) == Backlog(5, 0, 10 + 20 + 300 + 400 + 500, 5)
    assert await read_backlog(js, contract.REQUESTS, model) == Backlog(2, 0, 30, 2)
    assert await pool_backlog(js, "decode", model) == Backlog(0, 0, 0, 0)


async def test_no_consumer_yet_is_the_brokers_error(js: JetStreamContext, model: str) -> None:
    with pytest.raises(NotFoundError):
        await read_backlog(js, contract.REQUESTS, model)


def test_work_tokens_of_a_resumed_request_include_its_output(model: str) -> None:
    assert work_tokens(_request("r", model, 3, output_len=2)) == 5
