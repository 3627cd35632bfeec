"""Tracing on for this process when the environment asks (:func:`settings.tracing_requested`):
the OpenTelemetry SDK with a batching OTLP/HTTP exporter, configured by the standard
``OTEL_*`` variables. Off (the default), no SDK is loaded and no span is made."""

from __future__ import annotations

import logging

from pdserve import settings

log = logging.getLogger(__name__)


def setup_tracing(role: str, instance: str = "") -> bool:
    """Install the SDK's tracer provider for a process of ``role`` (service
    ``pdserve-<role>`` unless ``OTEL_SERVICE_NAME`` says otherwise). Returns whether tracing
    is on. Spans still queued are exported at interpreter exit (the SDK's own hook)."""
    if not settings.tracing_requested():
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {SERVICE_NAME: settings.service_name(f"pdserve-{role}"), "pdserve.role": role}
    if instance:
        attributes[SERVICE_INSTANCE_ID] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    log.info("tracing on", extra={"service": attributes[SERVICE_NAME]})
    return True
