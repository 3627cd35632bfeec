"""Connecting to NATS and publishing into JetStream with request-id dedup."""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref

import nats
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError, NoStreamResponseError

from pdserve.broker.auth import NatsAuth
from pdserve.schemas.codec import Message

log = logging.getLogger(__name__)

# JetStream error codes for a stream that refuses new messages (discard-new limits).
_FULL_CODES = {10077, 10047, 10027, 10028}


class QueueFullError(RuntimeError):
    """The stream is at its limits; the caller should retry later (HTTP 503)."""


class BrokerUnavailableError(RuntimeError):
    """No stream answered the publish: the broker is away, or a clustered stream is
    electing a leader (a node died). The message may still have been stored (a lost ack):
    the caller should retry later (HTTP 503) and cancel what it meant to publish."""


async def end_tasks(tasks: list[asyncio.Task[None]], seconds: float, again: float = 0.2) -> list[asyncio.Task[None]]:
    """Cancel ``tasks`` and wait up to ``seconds`` for them to end; those still running then.

    A cancellation can be lost: Python 3.11's ``asyncio.wait_for`` (inside nats-py's requests
    and flushes) returns the result instead of raising when the cancel lands as the reply
    arrives, and the loop that called it goes on. So a task still running ``again`` seconds
    after its cancel is cancelled once more (at its next wait), and counted in the log."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    pending = {t for t in tasks if not t.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=max(min(again, deadline - loop.time()), 0.0))
        if not pending or loop.time() >= deadline:
            break
        for task in pending:
            log.warning("a task went on after its cancel; cancelling it again", extra={"task": task.get_name()})
            task.cancel()
    return list(pending)


def server_urls(url: str) -> list[str]:
    """``--nats-url`` as the servers to try: one URL, or several separated by commas (the
    nodes of a cluster; the client also learns the others from the server it reaches)."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"no NATS server in {url!r}")
    return urls


async def connect(url: str, name: str, auth: NatsAuth | None = None, reconnect: bool = True) -> Client:
    """Connect to ``url`` (one server or a comma-separated list) as ``auth`` says, with
    endless reconnects (``reconnect=False``: one try of each server, for a check that must
    end: each is tried twice); connection problems are logged, not raised later (quietly while the connection
    is being drained or closed on purpose). Refused credentials raise at once."""
    holder: list[Client] = []

    def closing() -> bool:
        return bool(holder) and (holder[0].is_draining or holder[0].is_closed)

    async def on_error(exc: Exception) -> None:
        (log.debug if closing() else log.warning)("nats error", extra={"error": str(exc), "client": name})

    async def on_disconnect() -> None:
        (log.debug if closing() else log.warning)("nats disconnected", extra={"client": name})

    async def on_reconnect() -> None:
        log.info("nats reconnected", extra={"client": name})

    nc = await nats.connect(
        server_urls(url),
        name=name,
        allow_reconnect=reconnect,
        max_reconnect_attempts=-1 if reconnect else 1,  # nats-py drops a server only past a positive limit
        reconnect_time_wait=0.5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        **(auth or NatsAuth()).options(),
    )
    holder.append(nc)
    return nc


async def publish_work(
    nc: Client,
    subject: str,
    message: Message,
    msg_id: str,
    timeout: float = 5.0,
    headers: dict[str, str] | None = None,
) -> bool:
    """Publish ``message`` to a work stream, deduplicated on ``msg_id``, with ``headers``
    besides the ``Nats-Msg-Id`` one.

    Returns ``False`` when the server saw ``msg_id`` already (a duplicate), raises
    :class:`QueueFullError` when the stream is full, :class:`BrokerUnavailableError` when no
    stream answered within ``timeout`` (or at once: no responders).
    """
    return (await publish_work_at(nc, subject, message, msg_id, timeout, headers)) is not None


async def publish_work_at(
    nc: Client,
    subject: str,
    message: Message,
    msg_id: str,
    timeout: float = 5.0,
    headers: dict[str, str] | None = None,
) -> int | None:
    """:func:`publish_work`, returning the message's sequence in its stream (``None`` for a
    duplicate), which is what deleting it later takes."""
    try:
        ack = await _publisher(nc).publish(subject, message.encode(), msg_id, timeout, headers)
    except (NoStreamResponseError, NatsTimeoutError) as exc:
        kind = "no stream responded" if isinstance(exc, NoStreamResponseError) else f"no ack within {timeout:g}s"
        raise BrokerUnavailableError(f"JetStream is not taking messages now ({kind})") from None
    except APIError as exc:
        if exc.err_code in _FULL_CODES or (exc.description and "maximum" in exc.description):
            raise QueueFullError(exc.description or "stream full") from None
        raise
    if ack.get("duplicate", False):
        return None
    seq = ack.get("seq", 0)
    return seq if isinstance(seq, int) else 0


class AckedPublisher:
    """JetStream publishes whose acknowledgements come back on one wildcard inbox.

    ``js.publish`` is a request per message (a new reply future, a timeout task, a JSON
    parse into a dataclass): publishing a burst of 64 requests took ~60 us of CPU each on
    the development machine, and each message of the burst waits for the ones before it.
    Here a publish is one core-NATS publish with a reply subject under this publisher's
    inbox plus a future; the acks are read by one subscription. One per connection."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._ids = itertools.count()
        self._waiting: dict[str, asyncio.Future[dict[str, object]]] = {}
        self._started: asyncio.Lock | None = None

    async def publish(
        self, subject: str, data: bytes, msg_id: str, timeout: float, headers: dict[str, str] | None = None
    ) -> dict[str, object]:
        """The stream's ack (``{"stream", "seq", "duplicate"?}``) for ``data`` at ``subject``."""
        if not self._prefix:
            await self._start()
        token = str(next(self._ids))
        waiting = asyncio.get_running_loop().create_future()
        self._waiting[token] = waiting
        try:
            headers = {**(headers or {}), "Nats-Msg-Id": msg_id}
            await self._nc.publish(subject, data, reply=self._prefix + token, headers=headers)
            async with asyncio.timeout(timeout):  # wait_for (3.11) can drop a cancel
                return await waiting
        except TimeoutError:
            raise NatsTimeoutError from None
        finally:
            self._waiting.pop(token, None)

    async def _start(self) -> None:
        self._started = self._started or asyncio.Lock()
        async with self._started:
            if self._prefix:
                return
            prefix = self._nc.new_inbox() + "."
            await self._nc.subscribe(prefix + "*", cb=self._on_ack)
            self._prefix = prefix

    async def _on_ack(self, msg: Msg) -> None:
        waiting = self._waiting.get(msg.subject[len(self._prefix) :])
        if waiting is None or waiting.done():
            return  # timed out already
        if msg.headers and msg.headers.get("Status") == "503":
            waiting.set_exception(NoStreamResponseError())
            return
        try:
            reply = orjson.loads(msg.data)
        except orjson.JSONDecodeError:
            waiting.set_exception(APIError(description=f"unreadable ack {msg.data[:80]!r}"))
            return
        if isinstance(reply, dict) and "error" in reply:
            try:
                APIError.from_error(reply["error"])  # raises the error's own class
            except APIError as exc:
                waiting.set_exception(exc)
        elif isinstance(reply, dict):
            waiting.set_result(reply)
        else:
            waiting.set_exception(APIError(description=f"unexpected ack {msg.data[:80]!r}"))


_publishers: weakref.WeakKeyDictionary[Client, AckedPublisher] = weakref.WeakKeyDictionary()


def _publisher(nc: Client) -> AckedPublisher:
    publisher = _publishers.get(nc)
    if publisher is None:
        publisher = _publishers[nc] = AckedPublisher(nc)
    return publisher
