"""The client library and raw publishers against a real nats-server with pdserve's streams and
no worker: a full request stream refuses a publish with a reason, and a request nobody serves
times out and is cancelled. (With workers: tests/integration/test_direct_publishers.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import nats
import pytest
from nats.js.errors import APIError

from pdserve.broker.streams import BrokerConfig, ensure_model
from pdserve.client import Client, QueueFullError, RequestTimeout
from pdserve.schemas import Cancel, GenerateRequest

MODEL = "m"


@pytest.fixture
async def full_after_two(nats_server: Any) -> Any:
    """pdserve's streams for ``MODEL`` with room for two requests, and nobody consuming them."""
    nc = await nats.connect(nats_server.url)
    await ensure_model(nc.jetstream(), MODEL, BrokerConfig(request_max_msgs=2, file_storage=False))
    yield nats_server
    await nc.close()


async def test_a_full_request_stream_refuses_a_raw_publish_with_a_reason(full_after_two: Any) -> None:
    nc = await nats.connect(full_after_two.url)
    js = nc.jetstream()
    try:
        for rid in ("a", "b"):
            request = GenerateRequest(rid=rid, model=MODEL, prompt_ids=(1,), reply_to=f"pd.tokens.c.{rid}")
            await js.publish(f"pd.req.{MODEL}", request.encode(), headers={"Nats-Msg-Id": rid})
        third = GenerateRequest(rid="c", model=MODEL, prompt_ids=(1,), reply_to="pd.tokens.c.c")
        with pytest.raises(APIError) as refused:
            await js.publish(f"pd.req.{MODEL}", third.encode(), headers={"Nats-Msg-Id": "c"})
        assert refused.value.err_code == 10077
        assert refused.value.description == "maximum messages exceeded"
        assert (await js.stream_info("PD_REQUESTS")).state.messages == 2  # nothing of the third stored
    finally:
        await nc.close()


async def test_the_client_raises_queue_full_and_stores_nothing(full_after_two: Any) -> None:
    client = await Client.connect(full_after_two.url, MODEL, client_id="c")
    async with client:
        for rid in ("a", "b"):
            request = GenerateRequest(rid=rid, model=MODEL, prompt_ids=(1,), reply_to=f"pd.tokens.c.{rid}")
            await client.nc.jetstream().publish(f"pd.req.{MODEL}", request.encode(), headers={"Nats-Msg-Id": rid})
        with pytest.raises(QueueFullError, match="maximum messages exceeded"):
            await client.generate([1, 2, 3], rid="third")
        assert not client._live  # nothing left in flight


async def test_a_request_nobody_serves_times_out_and_is_cancelled(nats_server: Any) -> None:
    watcher = await nats.connect(nats_server.url)
    await ensure_model(watcher.jetstream(), MODEL, BrokerConfig(file_storage=False))
    cancels: asyncio.Queue[Cancel] = asyncio.Queue()

    async def on_cancel(msg: Any) -> None:
        await cancels.put(Cancel.decode(msg.data))

    await watcher.subscribe("pd.cancel", cb=on_cancel)
    try:
        async with await Client.connect(nats_server.url, MODEL) as client:
            started = time.monotonic()
            with pytest.raises(RequestTimeout, match="timed out"):
                await client.generate([1, 2, 3], rid="lonely", timeout=0.6)
            assert 0.55 < time.monotonic() - started < 3.0
            cancel = await asyncio.wait_for(cancels.get(), 5)
        assert cancel.rid == "lonely" and cancel.attempt == 0
        msg = await watcher.jetstream().get_last_msg("PD_REQUESTS", f"pd.req.{MODEL}")
        stored = json.loads(msg.data)
        assert stored["rid"] == "lonely" and stored["reply_to"].startswith("pd.tokens.client-")
        assert stored["deadline"] - stored["published_at"] == pytest.approx(0.6)
    finally:
        await watcher.close()


async def test_a_text_prompt_needs_a_tokenizer(nats_server: Any) -> None:
    async with await Client.connect(nats_server.url, MODEL) as client:
        with pytest.raises(ValueError, match="tokenizer"):
            await client.generate("hello")
