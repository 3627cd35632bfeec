"""Pull consumption that adds no latency of its own, and the delivery wrapper.

``nats-py``'s ``fetch(n, timeout)`` waits for a full batch after the first message of a
lingering pull, which under bursts adds most of the timeout to every request. Here a
fetch is one lingering pull for a single message (delivered the moment it is
published) followed by one ``no_wait`` pull for whatever else is already there, so a
burst of 64 arrives in two round trips and an idle queue costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.context import Context

from pdserve.broker import subjects, tracing
from pdserve.schemas.codec import Message, MessageError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

_STATUS = "Status"


NO_WAIT_EXPIRES_NS = 50_000_000


def _pending_after(msg: Msg) -> int:
    """Messages the server still had for the consumer when it delivered ``msg``."""
    try:
        return int(msg.metadata.num_pending or 0)
    except Exception:  # not a JetStream delivery: let the extra pull find out
        return 1


def _status(msg: Msg) -> str | None:
    if msg.headers and not msg.data:
        return msg.headers.get(_STATUS)
    return None


class PullConsumer:
    """Fetches from a durable pull consumer over one reply inbox. Not thread-safe."""

    def __init__(self, nc: Client, stream: str, consumer: str) -> None:
        self._nc = nc
        self._next = subjects.pull_next(stream, consumer)
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._lock = asyncio.Lock()
        self._pull_open_until = 0.0  # a lingering pull may be open at the server until then

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._inbox)

    async def stop(self) -> None:
        """Stop consuming without stranding a message.

        A lingering pull stays open at the server until it expires; a message it
        delivers after we stopped listening would sit unacked for ``ack_wait``. So we
        listen until it closes and hand back (nak) whatever it brings.
        """
        if self._sub is None:
            return
        while (remaining := self._pull_open_until - time.monotonic()) > 0:
            try:
                msg = await self._sub.next_msg(timeout=remaining + 0.2)
            except TimeoutError:
                break
            status = _status(msg)
            if status is None:
                await msg.nak()
            elif status in ("408", "404", "409"):
                break
        self._pull_open_until = 0.0
        await self._sub.unsubscribe()
        self._sub = None

    async def fetch(self, max_msgs: int, timeout: float) -> list[Msg]:
        """Up to ``max_msgs`` messages; waits at most ``timeout`` for the first one.

        Returns an empty list on timeout. Never returns more than ``max_msgs``.
        """
        assert self._sub is not None, "start() first"
        if max_msgs < 1:
            return []
        async with self._lock:
            msgs = self._drain(max_msgs)
            if not msgs:
                first = await self._linger(timeout)
                if first is None:
                    return []
                msgs.append(first)
            more = min(max_msgs - len(msgs), _pending_after(msgs[-1]))
            if more > 0:
                msgs.extend(await self._no_wait(more))
            return msgs

    def _drain(self, max_msgs: int) -> list[Msg]:
        """Messages that arrived after an earlier fetch stopped waiting."""
        assert self._sub is not None
        out: list[Msg] = []
        queue = self._sub._pending_queue  # nats-py keeps delivered messages here
        while len(out) < max_msgs and not queue.empty():
            msg = queue.get_nowait()
            self._sub._pending_size -= len(msg.data)
            if _status(msg) is None:
                out.append(msg)
        return out

    async def _linger(self, timeout: float) -> Msg | None:
        assert self._sub is not None
        expires_ns = max(int(timeout * 1e9), 1_000_000)
        self._pull_open_until = time.monotonic() + expires_ns / 1e9
        await self._nc.publish(self._next, orjson.dumps({"batch": 1, "expires": expires_ns}), reply=self._inbox)
        deadline = time.monotonic() + timeout + 1.0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                msg = await self._sub.next_msg(timeout=remaining)
            except TimeoutError:
                return None
            status = _status(msg)
            if status is None or status in ("408", "404", "409"):
                self._pull_open_until = 0.0  # the one-message pull is fulfilled or closed
                return msg if status is None else None
            # 100 = idle heartbeat; anything else is logged and the wait goes on.
            if status != "100":
                log.debug("pull status", extra={"status": status})

    async def _no_wait(self, batch: int) -> list[Msg]:
        """What is waiting now, up to ``batch``. The short ``expires`` ends the request
        even when ``max_ack_pending`` stops the server from filling it (it then sends
        nothing, and a request left open would pull messages nobody is waiting for)."""
        assert self._sub is not None
        request = {"batch": batch, "no_wait": True, "expires": NO_WAIT_EXPIRES_NS}
        self._pull_open_until = time.monotonic() + NO_WAIT_EXPIRES_NS / 1e9
        await self._nc.publish(self._next, orjson.dumps(request), reply=self._inbox)
        out: list[Msg] = []
        while len(out) < batch:
            try:
                msg = await self._sub.next_msg(timeout=2.0)
            except TimeoutError:
                return out
            if _status(msg) is not None:
                break
            out.append(msg)
        self._pull_open_until = 0.0  # filled, or closed by the server
        return out


@dataclass
class Delivery(Generic[M]):
    """A decoded message with its JetStream acknowledgement handle."""

    message: M
    raw: Msg
    received_at: float

    @property
    def num_delivered(self) -> int:
        return self.raw.metadata.num_delivered

    @property
    def trace(self) -> Context | None:
        """The trace context its publisher sent (``traceparent`` header), if tracing is on."""
        return tracing.context_of(self.raw.headers)

    async def ack(self) -> None:
        await self.raw.ack()

    async def in_progress(self) -> None:
        await self.raw.in_progress()

    async def nak(self, delay: float | None = None) -> None:
        await self.raw.nak(delay=delay)

    async def term(self) -> None:
        await self.raw.term()


@dataclass
class Rejected:
    """A message that did not decode. It has been terminated; ``reply_to`` is a best guess."""

    error: str
    rid: str | None
    reply_to: str | None
    code: str = MessageError.code


async def decode_deliveries(msgs: list[Msg], kind: type[M]) -> tuple[list[Delivery[M]], list[Rejected]]:
    """Decode each message; malformed ones are terminated at once (never redelivered)."""
    now = time.time()
    good: list[Delivery[M]] = []
    bad: list[Rejected] = []
    for msg in msgs:
        try:
            good.append(Delivery(kind.decode(msg.data), msg, now))
        except MessageError as exc:
            rid, reply_to = best_guess(msg.data)
            log.error("malformed message terminated", extra={"subject": msg.subject, "error": str(exc), "rid": rid})
            await msg.term()
            bad.append(Rejected(str(exc), rid, reply_to, exc.code))
    return good, bad


def best_guess(data: bytes) -> tuple[str | None, str | None]:
    """The ``rid`` and ``reply_to`` of a payload that did not decode, where they can be read."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(raw, dict):
        return None, None
    rid = raw.get("rid") if isinstance(raw.get("rid"), str) else None
    reply_to = raw.get("reply_to") if isinstance(raw.get("reply_to"), str) else None
    return rid, reply_to
