"""What every endpoint shares: the app's state, JSON responses, disconnect watching,
and gateway errors turned into HTTP errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse

from pdserve.api.config import ApiConfig
from pdserve.api.errors import APIError
from pdserve.api.gateway import DuplicateRequestError, Gateway, StreamError
from pdserve.api.model_info import ModelInfo
from pdserve.broker.connection import BrokerUnavailableError, QueueFullError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class AppState:
    """What the lifespan builds: the config, the model's tokenizer and limits, the NATS gateway."""

    config: ApiConfig
    info: ModelInfo
    gateway: Gateway
    started_at: float


def state_of(request: Request) -> AppState:
    return request.app.state.pd  # type: ignore[no-any-return]


class ORJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (which cancels the request)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise APIError("client closed the request", 499, "client_closed")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes (from
    ``Content-Length`` before reading anything, else while reading)."""
    declared = request.headers.get("content-length")
    too_large = APIError(f"the request body exceeds {limit} bytes", 413, "invalid_request_error", "body_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


def translate(exc: Exception) -> APIError:
    """Errors from the gateway as HTTP errors."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(
            f"the request queue is full: {exc}", 503, "server_overloaded", "queue_full", headers={"Retry-After": "1"}
        )
    if isinstance(exc, BrokerUnavailableError):
        return APIError(
            f"the broker is not taking requests now: {exc}",
            503,
            "server_overloaded",
            "broker_unavailable",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, DuplicateRequestError):
        return APIError(str(exc), 409, "invalid_request_error", "duplicate_request_id")
    if isinstance(exc, StreamError):
        if exc.kind == "invalid_request_error":
            return APIError(str(exc), 400)
        if exc.kind == "timeout":
            return APIError(str(exc), 504, "timeout")
        return APIError(str(exc), 500, exc.kind)
    log.exception("unexpected error", exc_info=exc)
    return APIError(f"internal error: {exc}", 500, "server_error")
