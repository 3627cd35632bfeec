"""broker.connection against a real nats-server: a list of servers, and a publish that no
stream answers."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.broker.connection import BrokerUnavailableError, connect, publish_work, server_urls
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
