"""What a NATS server offers pdserve, read the way ``pdserve doctor`` reports it: is it
reachable, is JetStream on (and clustered), do pdserve's streams and consumers exist with
the settings this deployment asks for, and are their replicas caught up."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from pdserve.broker import subjects
from pdserve.broker.auth import NatsAuth
from pdserve.broker.connection import connect
from pdserve.broker.streams import BrokerConfig, dead_stream, kv_stream, request_stream

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One line of a check's report: ``status`` is ``ok``, ``warn``, ``fail`` or ``info``."""

    check: str
    status: str
    detail: str


async def survey(
    url: str, auth: NatsAuth, config: BrokerConfig, model: str | None, timeout: float = 5.0
) -> list[Finding]:
    """Connect once (no reconnect loop) and report the server, JetStream, and each of
    pdserve's streams and consumers against ``config``. ``model``: also check that its two
    consumers exist (else every consumer found is reported)."""
    try:
        async with asyncio.timeout(timeout):
            nc = await connect(url, "pdserve-doctor", auth, reconnect=False)
    except Exception as exc:  # any failure to connect is the finding
        return [Finding("nats", FAIL, f"cannot connect to {url}: {type(exc).__name__}: {exc}")]
    try:
        return [_server(nc), *await _jetstream(nc.jetstream(), config, model, timeout)]
    finally:
        await nc.close()


def _server(nc: Client) -> Finding:
    info: dict[str, Any] = getattr(nc, "_server_info", {}) or {}
    where = nc.connected_url.netloc if nc.connected_url else "?"
    name = info.get("server_name") or info.get("server_id", "?")
    cluster = info.get("cluster")
    peers = info.get("connect_urls") or []
    shape = (
        f"cluster {cluster!r}" + (f", other nodes advertised: {', '.join(peers)}" if peers else "")
        if cluster
        else "no cluster"
    )
    return Finding("nats", OK, f"connected to {where} (server {name}, version {info.get('version', '?')}; {shape})")


async def _jetstream(js: JetStreamContext, config: BrokerConfig, model: str | None, timeout: float) -> list[Finding]:
    try:
        async with asyncio.timeout(timeout):
            account = await js.account_info()
    except Exception as exc:
        return [Finding("jetstream", FAIL, f"not available on this server/account: {type(exc).__name__}: {exc}")]
    found = [
        Finding(
            "jetstream",
            OK,
            f"on: {account.streams} streams, {account.consumers} consumers, "
            f"{account.storage / 2**20:.1f} MiB file storage used",
        )
    ]
    expected = [request_stream(config), kv_stream(config), dead_stream(config)]
    for want in expected:
        found += await _stream(js, want, config)
    found += await _bucket(js, config)
    for name, consumer in (
        (subjects.REQUEST_STREAM, subjects.prefill_consumer),
        (subjects.KV_STREAM, subjects.decode_consumer),
    ):
        found += await _consumers(js, name, consumer(model) if model else None, config)
    return found


def _replicas(info: Any) -> str:
    """``leader n1, replicas n2 (current), n3 (lagging 12)``, from a stream's or consumer's cluster info."""
    cluster = info.cluster
    if cluster is None or cluster.name is None:
        return "single server"
    if not cluster.leader:
        return f"cluster {cluster.name}: NO LEADER"
    peers = [
        f"{p.name} ({'offline' if p.offline else 'current' if p.current else f'behind by {p.lag or 0}'})"
        for p in cluster.replicas or []
    ]
    return f"cluster {cluster.name}: leader {cluster.leader}" + (f", replicas {', '.join(peers)}" if peers else "")


def _lagging(info: Any) -> bool:
    cluster = info.cluster
    if cluster is None or cluster.name is None:
        return False
    return not cluster.leader or any(p.offline or not p.current for p in cluster.replicas or [])


async def _stream(js: JetStreamContext, want: js_api.StreamConfig, config: BrokerConfig) -> list[Finding]:
    name = want.name or "?"
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        return [Finding(f"stream {name}", WARN, "not created yet (the first worker or API creates it)")]
    except Exception as exc:  # a user without the right to read it: the request times out
        return [Finding(f"stream {name}", WARN, _unreadable(exc))]
    have = info.config
    differs = [
        f"{field} {_show(getattr(have, field))} (this deployment: {_show(getattr(want, field))})"
        for field in (
            "retention",
            "storage",
            "discard",
            "num_replicas",
            "max_age",
            "max_bytes",
            "max_msgs",
            "duplicate_window",
        )
        if getattr(want, field) not in (None, 0) and _show(getattr(have, field)) != _show(getattr(want, field))
    ]
    state = f"{info.state.messages} messages, {info.state.consumer_count} consumers; {_replicas(info)}"
    shape = f"{_show(have.retention)}, {_show(have.storage)} storage, R{have.num_replicas or 1}"
    if differs:
        return [
            Finding(
                f"stream {name}",
                WARN,
                f"{shape}; differs: {'; '.join(differs)} — the next worker or API to start updates what it can. {state}",
            )
        ]
    return [Finding(f"stream {name}", WARN if _lagging(info) else OK, f"{shape}, as configured. {state}")]


async def _bucket(js: JetStreamContext, config: BrokerConfig) -> list[Finding]:
    name = subjects.bucket_stream(subjects.WORKER_BUCKET)
    try:
        info = await js.stream_info(name)
    except Exception as exc:
        if not isinstance(exc, NotFoundError):
            return [Finding("registry", WARN, _unreadable(exc))]
        return [
            Finding(
                "registry",
                WARN,
                f"bucket {subjects.WORKER_BUCKET} not created yet (the first worker or API creates it)",
            )
        ]
    replicas = info.config.num_replicas or 1
    status = OK if replicas == config.replicas and not _lagging(info) else WARN
    return [
        Finding(
            "registry",
            status,
            f"bucket {subjects.WORKER_BUCKET}: R{replicas} (this deployment: R{config.replicas}), {info.state.messages} live workers; {_replicas(info)}",
        )
    ]


async def _consumers(js: JetStreamContext, stream: str, wanted: str | None, config: BrokerConfig) -> list[Finding]:
    """``wanted`` (read by name: pdserve's roles may), else every consumer of ``stream``
    (listing them takes a user that may list, such as ``admin``)."""
    try:
        consumers = [await js.consumer_info(stream, wanted)] if wanted else await js.consumers_info(stream)
    except NotFoundError:
        if not wanted:
            return []
        return [Finding(f"consumer {stream}/{wanted}", WARN, "not created yet (the first worker or API creates it)")]
    except Exception as exc:
        return [Finding(f"consumer {stream}/{wanted or '*'}", WARN, _unreadable(exc))]
    found = []
    for c in consumers:
        cfg = c.config
        problems = []
        if cfg.ack_policy != js_api.AckPolicy.EXPLICIT:
            problems.append(f"ack policy {_show(cfg.ack_policy)}, pdserve needs explicit")
        if cfg.ack_wait is not None and abs(cfg.ack_wait - config.ack_wait) > 1e-3:
            problems.append(f"ack_wait {cfg.ack_wait:g}s (this deployment: {config.ack_wait:g}s)")
        if cfg.max_deliver != config.max_deliver:
            problems.append(f"max_deliver {cfg.max_deliver} (this deployment: {config.max_deliver})")
        detail = (
            f"explicit ack, ack_wait {cfg.ack_wait or 0:g}s, max_deliver {cfg.max_deliver}, "
            f"max_ack_pending {cfg.max_ack_pending}; {c.num_pending} waiting, {c.num_ack_pending} in hand; {_replicas(c)}"
        )
        status = WARN if problems or _lagging(c) else OK
        found.append(
            Finding(f"consumer {stream}/{c.name}", status, detail + ("; " + "; ".join(problems) if problems else ""))
        )
    return found


def _unreadable(exc: Exception) -> str:
    return f"could not read it ({type(exc).__name__}: {exc or 'timeout'}): does this NATS user have the right?"


def _show(value: Any) -> str:
    if hasattr(value, "value"):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value if value is not None else 1)
