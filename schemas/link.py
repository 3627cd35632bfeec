"""The point-to-point link of the ``nccl`` and ``gloo`` transfer backends: how a decode
worker opens a communicator with a prefill worker and asks it to push a request's pages.

Only the handshake and the push requests travel over NATS; the pages move over the
communicator (NCCL between GPUs, gloo between CPU pools).
"""

from __future__ import annotations

import dataclasses

from pdserve.schemas.codec import Message
from pdserve.schemas.kv import KVLayout


@dataclasses.dataclass(frozen=True, slots=True)
class KVLink(Message):
    """Decode asks a prefill worker for a communicator: rank 0 is the prefill worker, rank
    1 the decode worker. ``device`` names the decode worker's pool device (a CUDA device's
    UUID, or ``cpu``); the prefill worker refuses a layout, backend or device it cannot pair
    with, and says why."""

    decode_id: str
    prefill_id: str
    backend: str
    layout: KVLayout
    page_bytes: int
    device: str
    v: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class KVLinkReply(Message):
    """``granted``: both sides now build the communicator over the TCP store at ``store``
    (``host:port``) under ``prefix``; ``epoch`` names this link in later pushes. Else
    ``reason`` says what differs."""

    granted: bool
    reason: str = ""
    store: str = ""
    prefix: str = ""
    epoch: int = 0
    v: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class KVPush(Message):
    """Decode asks the prefill worker to send ``segments`` (``(address, nbytes)`` runs of
    whole pages of its pool, in order) as one message over link ``epoch``; the decode
    worker receives exactly ``sum(nbytes)`` bytes."""

    decode_id: str
    prefill_id: str
    epoch: int
    segments: tuple[tuple[int, ...], ...]
    v: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class KVPushReply(Message):
    """``accepted``: the send is queued on the link, the decode worker may receive; else
    ``reason`` says why not (nothing will be sent)."""

    accepted: bool
    reason: str = ""
    v: int = 1
