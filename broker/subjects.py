"""Every subject, stream and consumer name pdserve uses, built in one place.

Subjects run general to specific: ``pd.<channel>.<scope>``. Model names become one
subject token (dots, wildcards and whitespace replaced), so ``Qwen/Qwen2.5-7B`` and
``qwen2.5`` are both safe.
"""

from __future__ import annotations

import re

REQUEST_STREAM = "PD_REQUESTS"
KV_STREAM = "PD_KV"
DEAD_STREAM = "PD_DEAD"
DEAD_LETTER_GROUP = "pd-dead-letter"
WORKER_BUCKET = "PD_WORKERS"
CLAIM_BUCKET = "PD_CLAIMS"
CANCEL = "pd.cancel"

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def token(name: str) -> str:
    """``name`` as a single NATS subject token (and a valid consumer name)."""
    cleaned = _UNSAFE.sub("_", name)
    if not cleaned:
        raise ValueError("empty subject token")
    return cleaned


def cancel() -> str:
    """The one fan-out subject every worker listens on."""
    return CANCEL


def requests(model: str) -> str:
    return f"pd.req.{token(model)}"


def urgent_requests(model: str) -> str:
    """Requests of a priority above the default (``priority`` below 0): their own queue,
    which workers take from even while full of others."""
    return f"pd.urgent.{token(model)}"


def local_requests(model: str) -> str:
    """Requests a decode worker prefills itself (conditional disaggregation)."""
    return f"pd.local.{token(model)}"


def placed(model: str, worker_id: str) -> str:
    """Requests the API placed on one worker (prefix-aware placement)."""
    return f"pd.place.{token(model)}.{token(worker_id)}"


def kv_events(model: str) -> str:
    """Where workers tell what their prefix caches gained and lost."""
    return f"pd.kvevents.{token(model)}"


def kv_ready(model: str) -> str:
    return f"pd.kv.{token(model)}"


def urgent_kv_ready(model: str) -> str:
    """KV-ready events of requests of a priority above the default: their own queue, which
    decode workers take from even while full of others."""
    return f"pd.kvurgent.{token(model)}"


def kv_release(prefill_id: str) -> str:
    return f"pd.release.{token(prefill_id)}"


def kv_lease(prefill_id: str) -> str:
    return f"pd.lease.{token(prefill_id)}"


def kv_link(prefill_id: str) -> str:
    return f"pd.link.{token(prefill_id)}"


def kv_push(prefill_id: str) -> str:
    return f"pd.push.{token(prefill_id)}"


def flush_cache(worker_id: str) -> str:
    return f"pd.flush.{token(worker_id)}"


def tokens_prefix(api_id: str) -> str:
    """Wildcard an API instance subscribes to once for all of its requests."""
    return f"pd.tokens.{token(api_id)}.*"


def tokens(api_id: str, rid: str) -> str:
    return f"pd.tokens.{token(api_id)}.{token(rid)}"


def token_batches(api_id: str) -> str:
    """Where an API instance takes ``TokenBatch``es (outside its ``tokens_prefix``)."""
    return f"pd.tokens.{token(api_id)}"


def inbox_prefix(user: str) -> str:
    """The inbox prefix of ``user``'s connections (``_INBOX.<user>``): the only inboxes
    the broker's permissions let it read."""
    return f"_INBOX.{token(user)}"


def msg_id(rid: str, attempt: int = 0) -> str:
    """The ``Nats-Msg-Id`` a work message of ``rid`` is deduplicated on: the request id for
    the first attempt (what direct publishers use), ``rid~n`` for migration ``n``."""
    return rid if attempt == 0 else f"{rid}~{attempt}"


def prefill_consumer(model: str) -> str:
    return f"prefill-{token(model)}"


def urgent_consumer(model: str) -> str:
    return f"urgent-{token(model)}"


def local_consumer(model: str) -> str:
    return f"local-{token(model)}"


def placed_consumer(model: str, worker_id: str) -> str:
    return f"place-{token(model)}-{token(worker_id)}"


def decode_consumer(model: str) -> str:
    return f"decode-{token(model)}"


def urgent_decode_consumer(model: str) -> str:
    return f"decode-urgent-{token(model)}"


def worker_key(worker_id: str) -> str:
    return token(worker_id)


def claim_key(rid: str, attempt: int = 0) -> str:
    """The claim of a placed request's attempt: whoever creates it first runs it."""
    return f"{token(rid)}-{attempt}"


def placed_msg_id(rid: str) -> str:
    """The ``Nats-Msg-Id`` of a placed copy (its fallback to the shared queue uses
    :func:`msg_id`, so both may be stored)."""
    return f"{rid}~placed"


def bucket_stream(bucket: str) -> str:
    """The stream JetStream keeps a key-value bucket in."""
    return f"KV_{bucket}"


def bucket_key_prefix(bucket: str) -> str:
    """The subject prefix of a bucket's keys inside its stream."""
    return f"$KV.{bucket}."


def dead_letter(stream: str, model: str) -> str:
    """Where a message of ``stream`` goes after its last allowed delivery."""
    return f"pd.dead.{token(stream)}.{token(model)}"


def max_deliveries_advisory(stream: str, consumer: str) -> str:
    """JetStream's advisory when a message of ``consumer`` has been delivered ``max_deliver`` times."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


def pull_next(stream: str, consumer: str) -> str:
    """JetStream's API subject that asks a pull consumer for its next messages."""
    return f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"


REQUEST_SUBJECTS = "pd.req.*"
URGENT_SUBJECTS = "pd.urgent.*"
LOCAL_SUBJECTS = "pd.local.*"
PLACED_SUBJECTS = "pd.place.*.*"
KV_SUBJECTS = "pd.kv.*"
URGENT_KV_SUBJECTS = "pd.kvurgent.*"
DEAD_SUBJECTS = "pd.dead.>"
