"""Who may call the API, and how much at once.

With API keys configured, every route but ``/health`` needs ``Authorization: Bearer
<key>`` (or, as Anthropic's clients send it, ``x-api-key: <key>``); anything else gets 401
with an OpenAI-style body before the route runs (before the body is read). Keys are compared in constant time, each against every configured
key. A generation route may have ``max_concurrent_requests`` requests of one key in
flight (streams included, until their last byte is sent); one more gets 429 with
``Retry-After``. Without keys every client shares one budget.
"""

from __future__ import annotations

import contextvars
import hmac
import ipaddress
from collections import Counter

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.api.errors import APIError, error_response

OPEN_PATHS = frozenset({"/health"})
LIMITED_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})
RETRY_AFTER_SECONDS = 1
# Where the key a request was allowed with is kept in its ASGI scope (``None``: no keys configured).
KEY_SCOPE = "pdserve.api_key"
# The same, for what the request's handling calls (the gateway records who published a
# request, so that /abort_request aborts only the caller's own): -1 without keys.
CALLER: contextvars.ContextVar[int] = contextvars.ContextVar("pdserve_caller", default=-1)


def match_key(header: str | None, keys: tuple[bytes, ...]) -> int | None:
    """The index of the key ``header`` (``Bearer <key>``) carries, or ``None``. Every key
    is compared, each in constant time, whatever matched before."""
    if header is None:
        return None
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    candidate = presented.strip().encode()
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(candidate, key) and found is None:
            found = i
    return found


def is_loopback(scope: Scope) -> bool:
    """The client connected over loopback (or through a Unix socket)."""
    client = scope.get("client")
    if not client:
        return True
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def is_trusted(scope: Scope) -> bool:
    """The caller may see what only operators should (``/workers``' transfer endpoints):
    it showed a key, or no keys are configured and it is on this machine."""
    key = scope.get(KEY_SCOPE)
    return key is not None or is_loopback(scope)


class AccessMiddleware:
    """API keys and per-key concurrency (see the module)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...] = (), max_concurrent: int = 0) -> None:
        self.app = app
        self.keys = tuple(key.encode() for key in keys)
        self.max_concurrent = max_concurrent
        self.in_flight: Counter[int] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        who = -1  # no keys configured: everyone
        if self.keys and path not in OPEN_PATHS:
            headers = dict(scope["headers"])
            raw = headers.get(b"authorization")
            if raw is None and b"x-api-key" in headers:  # Anthropic's clients send the key so
                raw = b"Bearer " + headers[b"x-api-key"]
            index = match_key(raw.decode("latin-1") if raw is not None else None, self.keys)
            if index is None:
                await self._refuse(scope, receive, send, raw is not None)
                return
            who = index
            scope[KEY_SCOPE] = index
        CALLER.set(who)  # (this request's task: the app runs in it)
        if not self.max_concurrent or path not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight[who] >= self.max_concurrent:
            error = APIError(
                f"too many requests in flight for this key: at most {self.max_concurrent}",
                429,
                "rate_limit_error",
                "too_many_concurrent_requests",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
            await error_response(error)(scope, receive, send)
            return
        self.in_flight[who] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[who] -= 1

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, presented: bool) -> None:
        message = "incorrect API key" if presented else "an API key is required: send 'Authorization: Bearer <key>'"
        error = APIError(
            message, 401, "invalid_request_error", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await error_response(error)(scope, receive, send)
