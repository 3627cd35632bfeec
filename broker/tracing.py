"""Trace context across NATS: W3C ``traceparent`` in the headers of work messages, and
the stage spans workers record after the fact.

A request's trace starts at the API (``http request``); the context travels in the
headers of its ``GenerateRequest`` and on to its ``KVReady``, so every stage a worker
records (``queue wait (prefill)``, ``prefill``, ``queue wait (decode)``, ``kv transfer``,
``decode``) is a child of the API's span in one trace.

Only the OpenTelemetry API is used here: which SDK and exporter record spans is the
process's choice (``pdserve.telemetry``). Without one, :func:`is_on` is False and
nothing here does any work.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

TRACER_NAME = "pdserve"

# The stages of one request, in order: every span name pdserve records.
HTTP_REQUEST = "http request"
QUEUE_PREFILL = "queue wait (prefill)"
PREFILL = "prefill"
QUEUE_DECODE = "queue wait (decode)"
KV_TRANSFER = "kv transfer"
DECODE = "decode"
STAGES = (HTTP_REQUEST, QUEUE_PREFILL, PREFILL, QUEUE_DECODE, KV_TRANSFER, DECODE)


def is_on() -> bool:
    """Whether an SDK records spans in this process (the API alone records nothing)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def headers(context: Context | None = None) -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of ``context`` (default: the current one), for
    a message's headers; empty when tracing is off or there is no span."""
    if not is_on():
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def context_of(msg_headers: Mapping[str, str] | None) -> Context | None:
    """The trace context a message's headers carry, or ``None`` (tracing off, or none sent)."""
    if not msg_headers or "traceparent" not in msg_headers or not is_on():
        return None
    return propagate.extract(dict(msg_headers))


def record(
    name: str, parent: Context | None, start: float, end: float, attributes: Mapping[str, AttributeValue]
) -> None:
    """A finished span ``name`` from ``start`` to ``end`` (Unix seconds) under ``parent``.
    Nothing without a parent (tracing off, or the request came without a context)."""
    if parent is None:
        return
    span = tracer().start_span(name, context=parent, start_time=int(start * 1e9), attributes=attributes)
    span.end(end_time=int(max(end, start) * 1e9))
