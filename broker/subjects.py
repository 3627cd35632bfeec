"""Every subject, stream and consumer name pdserve uses, built in one place.

Subjects run general to specific: ``pd.<channel>.<scope>``. Model names become one
subject token (dots, wildcards and whitespace replaced), so ``Qwen/Qwen2.5-7B`` and
``qwen2.5`` are both safe.
"""

from __future__ import annotations

import re

REQUEST_STREAM = "PD_REQUESTS"
KV_STREAM = "PD_KV"
WORKER_BUCKET = "PD_WORKERS"
CANCEL = "pd.cancel"

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def token(name: str) -> str:
    """``name`` as a single NATS subject token (and a valid consumer name)."""
    cleaned = _UNSAFE.sub("_", name)
    if not cleaned:
        raise ValueError("empty subject token")
    return cleaned


def requests(model: str) -> str:
    return f"pd.req.{token(model)}"


def kv_ready(model: str) -> str:
    return f"pd.kv.{token(model)}"


def kv_release(prefill_id: str) -> str:
    return f"pd.release.{token(prefill_id)}"


def tokens_prefix(api_id: str) -> str:
    """Wildcard an API instance subscribes to once for all of its requests."""
    return f"pd.tokens.{token(api_id)}.*"


def tokens(api_id: str, rid: str) -> str:
    return f"pd.tokens.{token(api_id)}.{token(rid)}"


def prefill_consumer(model: str) -> str:
    return f"prefill-{token(model)}"


def decode_consumer(model: str) -> str:
    return f"decode-{token(model)}"


def worker_key(worker_id: str) -> str:
    return token(worker_id)


REQUEST_SUBJECTS = "pd.req.*"
KV_SUBJECTS = "pd.kv.*"
