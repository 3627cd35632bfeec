"""broker.deadletter against a real nats-server: a message delivered max_deliver times
without being done leaves its work stream for PD_DEAD, and its sender hears why."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from pdserve.broker import contract, queues, subjects
from pdserve.broker.deadletter import watch_dead_letters
from pdserve.broker.streams import BrokerConfig, ensure_model
from pdserve.schemas import GenerateRequest, SamplingParams, TokenChunk


@pytest.mark.parametrize("urgent", [False, True])
async def test_a_poison_request_goes_to_the_dead_letters_and_its_client_hears(
    nc: Client, js: JetStreamContext, model: str, eventually: Any, urgent: bool
) -> None:
    """From the shared queue, and from its urgent lane (a request of priority below 0)."""
    await ensure_model(js, model, BrokerConfig(max_deliver=2, ack_wait=0.5))
    moved: list[str] = []

    async def on_moved(rid: str) -> None:
        moved.append(rid)

    await watch_dead_letters(nc, js, model, on_moved)
    replies: asyncio.Queue[TokenChunk] = asyncio.Queue()

    async def on_reply(msg: Any) -> None:
        await replies.put(TokenChunk.decode(msg.data))

    await nc.subscribe("pd.tokens.api.poison", cb=on_reply)
    sampling = SamplingParams(priority=-1 if urgent else 0)
    req = GenerateRequest(
        rid="poison", model=model, prompt_ids=(1, 2), reply_to="pd.tokens.api.poison", attempt=2, sampling=sampling
    )
    channel = contract.request_channel(req)
    assert channel is (contract.URGENT_REQUESTS if urgent else contract.REQUESTS)
    await queues.submit(nc, channel, req, model, req.rid)
    queue = queues.WorkQueue(nc, channel, model, "w")
    await queue.start()
    try:
        for _ in range(2):  # each worker that takes it dies (here: gives it back)
            (d,) = await queue.fetch(1, 5)
            await d.nak()
        assert await queue.fetch(1, 1.5) == []  # not delivered a third time
        chunk = await asyncio.wait_for(replies.get(), 5)
        assert chunk.finish_reason == "error" and chunk.error is not None and chunk.attempt == 2
        assert "delivered 2 times" in chunk.error.message and "dead letters" in chunk.error.message
        assert moved == ["poison"]
        info = await js.stream_info(subjects.REQUEST_STREAM)
        assert info.state.messages == 0  # a WorkQueue stream would have kept it forever
        dead = await js.get_last_msg(subjects.DEAD_STREAM, subjects.dead_letter(subjects.REQUEST_STREAM, model))
        assert GenerateRequest.decode(dead.data) == req
        assert dead.headers is not None and dead.headers["Pd-Deliveries"] == "2"
    finally:
        await queue.stop()
