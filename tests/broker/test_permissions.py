"""The embedded broker's users against the real nats-server: each role can do its part of the
wire contract and nothing else, wrong credentials are refused, secrets are private files."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from pdserve.broker import contract, permissions, queues, subjects
from pdserve.broker.auth import NatsAuth
from pdserve.broker.connection import connect
from pdserve.broker.credentials import ADMIN, EmbeddedCredentials, embedded_auth
from pdserve.broker.server import NatsServer, start_nats_server
from pdserve.broker.streams import BrokerConfig, ensure_model
from pdserve.schemas import KVHandle, KVLayout, KVReady, SamplingParams, TokenChunk

MODEL = "m"
API, OTHER_API = "api-test-0", "api-test-1"
PUBLISHER = "batch-job"


@pytest.fixture
def secured(tmp_path: Path) -> Any:
    credentials = EmbeddedCredentials.create(tmp_path / "nats" / "auth", [API, OTHER_API], [PUBLISHER])
    server = start_nats_server(tmp_path / "nats", users=credentials.entries())
    yield server, credentials
    server.stop()


@pytest.fixture
async def client(secured: Any) -> AsyncIterator[Callable[..., Any]]:
    """``await client(user)``: a connection as ``user``, with the errors the server sent it."""
    server, credentials = secured
    opened: list[Client] = []

    async def open_as(user: str) -> tuple[Client, list[str]]:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(server.url, error_cb=on_error, **credentials.auth(user).options())
        opened.append(nc)
        return nc, errors

    yield open_as
    for nc in opened:
        await nc.close()


def _kv_ready(rid: str) -> KVReady:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="float16")
    handle = KVHandle(
        backend="mooncake", endpoint="10.0.0.9:1", layout=layout, segments=((4096, 64),), num_tokens=3, expires_at=0.0
    )
    return KVReady(
        rid=rid,
        model=MODEL,
        prompt_ids=(1, 2, 3),
        output_ids=(4,),
        reply_to=f"pd.tokens.{API}.{rid}",
        sampling=SamplingParams(),
        prefill_id="prefill-0",
        handle=handle,
    )


async def test_the_api_cannot_forge_kv_ready_and_the_stream_stores_nothing(client: Any) -> None:
    admin, _ = await client(ADMIN)
    await ensure_model(admin.jetstream(), MODEL, BrokerConfig())
    api, errors = await client(API)
    with pytest.raises(Exception):  # noqa: B017 - refused: no stream ack ever comes
        await queues.submit(api, contract.KV_READY, _kv_ready("forged"), MODEL, "forged")
    await api.publish(subjects.kv_ready(MODEL), _kv_ready("forged-2").encode())
    await api.publish(subjects.kv_release("prefill-0"), b"{}")
    await api.flush()
    await asyncio.sleep(0.2)
    assert any("permissions violation for publish" in e and subjects.kv_ready(MODEL) in e for e in errors), errors
    assert any(subjects.kv_release("prefill-0") in e for e in errors), errors
    info = await admin.jetstream().stream_info(subjects.KV_STREAM)
    assert info.state.messages == 0
    # What the API is there to do, it can: publish a request (stored) and a cancel.
    assert await _stored_after(api, admin, subjects.requests(MODEL), subjects.REQUEST_STREAM) == 1


async def _stored_after(nc: Client, admin: Client, subject: str, stream: str) -> int:
    ack = await nc.jetstream().publish(subject, b"{}")
    assert ack.stream == stream
    return (await admin.jetstream().stream_info(stream)).state.messages  # type: ignore[no-any-return]


async def test_an_api_reads_its_own_replies_and_no_other_apis(client: Any) -> None:
    api, errors = await client(API)
    worker, worker_errors = await client("decode")
    mine: list[bytes] = []
    theirs: list[bytes] = []

    async def take_mine(msg: Any) -> None:
        mine.append(msg.data)

    async def take_theirs(msg: Any) -> None:
        theirs.append(msg.data)

    await api.subscribe(subjects.tokens_prefix(API), cb=take_mine)
    await api.subscribe(subjects.tokens_prefix(OTHER_API), cb=take_theirs)
    await api.subscribe(f"{subjects.inbox_prefix(OTHER_API)}.>", cb=take_theirs)
    await api.flush()
    await asyncio.sleep(0.2)
    violations = [e for e in errors if "permissions violation for subscription" in e]
    assert len(violations) == 2, errors
    chunk = TokenChunk(rid="r", seq=0, token_ids=(1,)).encode()
    await worker.publish(subjects.tokens(API, "r"), chunk)
    await worker.publish(subjects.tokens(OTHER_API, "r"), chunk)
    await worker.flush()
    await asyncio.sleep(0.3)
    assert mine == [chunk] and theirs == [] and worker_errors == []


async def test_wrong_or_missing_credentials_are_refused(secured: Any) -> None:
    server, credentials = secured
    for auth in (NatsAuth(user=API, password="not-the-password"), NatsAuth(user="nobody", password="x"), NatsAuth()):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, **auth.options())
    nc = await connect(server.url, "ok", credentials.auth("prefill"))
    assert nc.is_connected
    await nc.close()


def test_secrets_are_readable_by_their_owner_only(secured: Any, tmp_path: Path) -> None:
    _, credentials = secured
    auth_dir = tmp_path / "nats" / "auth"
    assert stat.S_IMODE(auth_dir.stat().st_mode) == 0o700
    for path in [*auth_dir.iterdir(), tmp_path / "nats" / "nats.conf"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert embedded_auth(auth_dir, API) == credentials.auth(API)
    assert "password" not in repr(credentials.auth(API)).replace("password=", "")
    assert credentials.auth(API).password not in repr(credentials)


def test_every_channel_names_its_roles_and_each_role_gets_its_subjects() -> None:
    for channel in contract.CHANNELS:
        assert channel.senders and channel.receivers, channel.name
        assert set(channel.senders) | set(channel.receivers) <= set(permissions.ROLES), channel.name
    api = permissions.for_role("api", API)
    assert "pd.req.*" in api.publish and "pd.cancel" in api.publish
    assert f"pd.tokens.{API}.*" in api.subscribe and f"pd.tokens.{API}" in api.subscribe
    assert "pd.kv.*" not in api.publish and not any(s.startswith("pd.tokens.*") for s in api.subscribe)
    prefill = permissions.for_role("prefill")
    assert "pd.kv.*" in prefill.publish and "pd.release.*" in prefill.subscribe and prefill.allow_responses
    assert "$JS.API.CONSUMER.MSG.NEXT.PD_REQUESTS.*" in prefill.publish
    decode = permissions.for_role("decode")
    assert "pd.lease.*" in decode.publish and "pd.kv.*" not in decode.publish
    for role in permissions.ROLES:
        rights = permissions.for_role(role, PUBLISHER if role == permissions.CLIENT else None)
        assert not any("DELETE.PD_" in s and "MSG" not in s for s in rights.publish)
        assert not any("PURGE" in s for s in rights.publish)
    assert permissions.pattern(subjects.tokens) == "pd.tokens.*.*"
    assert permissions.pattern(subjects.prefill_consumer) == "*"
    with pytest.raises(ValueError):
        permissions.for_role("root")
    with pytest.raises(ValueError, match="id"):
        permissions.for_role(permissions.CLIENT)
    publisher = permissions.for_role(permissions.CLIENT, PUBLISHER)
    assert set(publisher.publish) == {"pd.req.*", "pd.urgent.*", "pd.cancel"}
    assert set(publisher.subscribe) == {f"_INBOX.{PUBLISHER}.>", f"pd.tokens.{PUBLISHER}.*", f"pd.tokens.{PUBLISHER}"}
    with pytest.raises(ValueError, match="unique"):
        EmbeddedCredentials.create(Path("/nonexistent"), [API], [API])
    with pytest.raises(ValueError, match="subject tokens"):
        EmbeddedCredentials.create(Path("/nonexistent"), [API], ["has.dot"])


async def test_a_direct_publisher_requests_cancels_and_reads_its_own_replies_only(client: Any) -> None:
    admin, _ = await client(ADMIN)
    await ensure_model(admin.jetstream(), MODEL, BrokerConfig())
    publisher, errors = await client(PUBLISHER)
    worker, _ = await client("decode")
    assert await _stored_after(publisher, admin, subjects.requests(MODEL), subjects.REQUEST_STREAM) == 1
    await publisher.publish(subjects.cancel(), b"{}")
    mine: list[bytes] = []

    async def take(msg: Any) -> None:
        mine.append(msg.data)

    await publisher.subscribe(subjects.tokens_prefix(PUBLISHER), cb=take)
    await publisher.subscribe(subjects.tokens_prefix(API), cb=take)  # refused
    await publisher.publish(subjects.kv_ready(MODEL), _kv_ready("forged").encode())  # refused
    await publisher.publish("$JS.API.STREAM.DELETE.PD_REQUESTS", b"")  # refused
    await publisher.flush()
    await asyncio.sleep(0.2)
    chunk = TokenChunk(rid="r", seq=0, token_ids=(1,)).encode()
    await worker.publish(subjects.tokens(PUBLISHER, "r"), chunk)
    await worker.publish(subjects.tokens(API, "r"), chunk)
    await worker.flush()
    await asyncio.sleep(0.3)
    assert mine == [chunk]
    assert sum("permissions violation" in e for e in errors) == 3, errors
    assert not any(subjects.cancel() in e or subjects.requests(MODEL) in e for e in errors), errors
    assert (await admin.jetstream().stream_info(subjects.KV_STREAM)).state.messages == 0


def test_a_server_without_users_stays_open(nats_server: NatsServer) -> None:
    conf = Path(nats_server.store_dir).parent / "nats.conf"
    assert "authorization" not in conf.read_text()


def test_a_colocated_process_may_do_what_its_prefill_and_decode_workers_do() -> None:
    both = permissions.for_role(permissions.COLOCATED)
    for half in ("prefill", "decode"):
        rights = permissions.for_role(half)
        mine = f"{subjects.inbox_prefix(half)}.>"
        assert set(rights.publish) <= set(both.publish)
        assert set(rights.subscribe) - {mine} <= set(both.subscribe)
        assert mine not in both.subscribe  # its inboxes are its own: _INBOX.colocated
    assert f"{subjects.inbox_prefix('colocated')}.>" in both.subscribe
    assert both.allow_responses
