"""broker.connection against a real nats-server: a list of servers, and a publish that no
stream answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import pytest

from pdserve.broker.connection import BrokerUnavailableError, connect, end_tasks, publish_work, server_urls
from pdserve.broker.streams import BrokerConfig, ensure_model
from pdserve.schemas import GenerateRequest


def test_a_comma_separated_url_is_a_list_of_servers() -> None:
    assert server_urls("nats://a:4222") == ["nats://a:4222"]
    assert server_urls(" nats://a:1, nats://b:2 ,nats://c:3") == ["nats://a:1", "nats://b:2", "nats://c:3"]
    with pytest.raises(ValueError):
        server_urls(" , ")


async def test_a_cluster_url_list_connects_past_a_node_that_is_down(nats_server: Any) -> None:
    nc = await connect(f"nats://127.0.0.1:9,{nats_server.url}", "test", reconnect=False)
    try:
        assert nc.is_connected and nc.connected_url is not None
        assert nats_server.url.endswith(str(nc.connected_url.port))
    finally:
        await nc.close()


async def test_a_publish_no_stream_answers_is_broker_unavailable(nats_server: Any, make_request: Any) -> None:
    nc = await connect(nats_server.url, "test")
    try:
        request: GenerateRequest = make_request("r1", model="m")
        with pytest.raises(BrokerUnavailableError, match="no stream responded"):
            await publish_work(nc, "pd.req.m", request, "r1", timeout=2)
        await ensure_model(nc.jetstream(), "m", BrokerConfig(file_storage=False))
        assert await publish_work(nc, "pd.req.m", request, "r1", timeout=2)
    finally:
        await nc.close()


async def test_end_tasks_cancels_again_a_task_that_went_on_after_its_cancel(caplog: pytest.LogCaptureFixture) -> None:
    """Python 3.11's wait_for (inside nats-py's requests) returns the result when a cancel
    lands as the reply arrives, and the loop that called it goes on: such a loop, its first
    cancel lost here as wait_for loses it, still ends, cancelled a second time."""
    loop = asyncio.get_running_loop()
    replied = loop.create_future()
    rounds = 0

    async def a_loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            try:
                await asyncio.sleep(3600)  # a request in flight
            except asyncio.CancelledError:
                if rounds == 1:  # what wait_for does when its reply came with the cancel
                    replied.set_result(None)
                    continue
                raise

    async def plain() -> None:
        await asyncio.sleep(3600)

    tasks = [asyncio.create_task(a_loop(), name="swallows"), asyncio.create_task(plain(), name="plain")]
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="pdserve.broker.connection"):
        assert await end_tasks(tasks, seconds=5, again=0.05) == []
    assert replied.done() and rounds == 2
    assert all(t.cancelled() for t in tasks)
    again = [r for r in caplog.records if "cancelling it again" in r.getMessage()]
    assert [r.__dict__["task"] for r in again] == ["swallows"]


async def test_end_tasks_returns_what_would_not_end_within_its_bound() -> None:
    holding = True

    async def stubborn() -> None:
        while holding:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    began = time.monotonic()
    assert await end_tasks([task], seconds=0.3, again=0.05) == [task]
    assert 0.25 < time.monotonic() - began < 2
    holding = False
    assert await end_tasks([task], seconds=1) == [] and task.done()
