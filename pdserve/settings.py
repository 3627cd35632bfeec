"""Environment variables, read in this one place. Every one has a working default."""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "PDSERVE_"


def env(name: str, default: str) -> str:
    return os.environ.get(PREFIX + name, default)


def default_data_dir() -> Path:
    return Path(env("DATA_DIR", ".pdserve"))


def default_nats_url() -> str:
    return env("NATS_URL", "nats://127.0.0.1:4222")


def default_transfer_host() -> str:
    """``PDSERVE_TRANSFER_HOST``: the address a worker advertises for KV transfers (on
    Kubernetes the pod IP, from the downward API); empty: the worker's ``--host``."""
    return env("TRANSFER_HOST", "")


def default_log_level() -> str:
    return env("LOG_LEVEL", "INFO")


def api_keys() -> tuple[str, ...]:
    """``PDSERVE_API_KEYS``: API keys separated by commas or whitespace (none by default)."""
    return tuple(key for key in env("API_KEYS", "").replace(",", " ").split() if key)


def nats_password() -> str | None:
    """``PDSERVE_NATS_PASSWORD``: the password of ``--nats-user`` (unset by default)."""
    return os.environ.get(PREFIX + "NATS_PASSWORD") or None


def tracing_requested() -> bool:
    """Spans are exported when an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), unless ``OTEL_SDK_DISABLED=true`` or
    ``OTEL_TRACES_EXPORTER=none``. The exporter reads the other ``OTEL_*`` variables itself."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def service_name(default: str) -> str:
    """``OTEL_SERVICE_NAME`` when set (every process then shares it), else ``default``."""
    return os.environ.get("OTEL_SERVICE_NAME") or default
