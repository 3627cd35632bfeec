"""The ``http request`` span: one per HTTP request to a generation endpoint, the root of
the request's trace (the workers' stage spans hang under it, see
:mod:`pdserve.broker.tracing`). With tracing off the middleware passes requests through."""

from __future__ import annotations

from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.broker import tracing

TRACED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


class TraceMiddleware:
    """Starts ``http request`` for each traced path (continuing a client's ``traceparent``),
    current while the endpoint runs and streams, ended when the response is sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACED_PATHS or not tracing.is_on():
            await self.app(scope, receive, send)
            return
        carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        parent = propagate.extract(carrier)
        attributes = {"http.request.method": scope["method"], "url.path": scope["path"]}
        with tracing.tracer().start_as_current_span(
            tracing.HTTP_REQUEST, context=parent, kind=SpanKind.SERVER, attributes=attributes
        ) as span:

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_traced)
