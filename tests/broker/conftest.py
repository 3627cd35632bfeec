"""Fixtures for the broker tests: a real nats-server (``nats_server`` from tests/conftest.py),
a client connected through :func:`broker.connection.connect`, and small helpers.

Helpers are handed out as fixtures (a test module cannot import this conftest).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from pdserve.broker.connection import connect
from pdserve.schemas import GenerateRequest

# A model name with characters that are not valid in a subject token.
MODEL = "Qwen/Qwen2.5-0.5B"


@pytest.fixture
def model() -> str:
    return MODEL


@pytest.fixture
async def nc(nats_server: Any) -> AsyncIterator[Client]:
    client = await connect(nats_server.url, "broker-test")
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def js(nc: Client) -> JetStreamContext:
    return nc.jetstream()


def _request(rid: str, model: str = MODEL, **kwargs: Any) -> GenerateRequest:
    return GenerateRequest(rid=rid, model=model, prompt_ids=(1, 2, 3), reply_to=f"pd.tokens.api.{rid}", **kwargs)


@pytest.fixture
def make_request() -> Callable[..., GenerateRequest]:
    """``make_request(rid, model=..., **fields)`` builds a valid GenerateRequest."""
    return _request


async def _eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds, also
    where one call of ``check`` is still waiting then (a hang is named here, with the await it
    was stuck in, not left to the suite's timeout minutes later)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = await asyncio.wait_for(check(), timeout=max(deadline - time.monotonic(), interval))
        except TimeoutError:
            pytest.fail(f"{what}: a check was still waiting after {timeout}s (traceback: where it waited)")
        if last:
            return last
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout}s (last value: {last!r})")
        await asyncio.sleep(interval)


@pytest.fixture
def eventually() -> Callable[..., Awaitable[Any]]:
    return _eventually
