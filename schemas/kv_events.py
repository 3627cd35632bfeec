"""``KVEvents``: what a worker's prefix cache gained and lost, for prefix-aware placement,
and the chained page hash both sides compute."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence

from pdserve.schemas.codec import Message


def page_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chained hash of one full page of tokens: equal hashes mean equal whole prefixes."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def page_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The chained hashes of the leading full pages of ``tokens``."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_hash(parent, tokens[start : start + page_size])
        hashes.append(parent)
    return hashes


@dataclasses.dataclass(frozen=True, slots=True)
class KVEvents(Message):
    """Full pages ``worker_id``'s prefix cache indexed (``stored``) and forgot (``evicted``)
    since its last event, as hex :func:`page_hash` values of pages of ``page_size`` tokens
    (one message per engine step that changed anything). Core NATS: a lost message leaves
    the receiver's index approximate, never wrong about where a request may run."""

    worker_id: str
    model: str
    page_size: int
    stored: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()
    v: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementClaim(Message):
    """Who runs attempt ``attempt`` of a placed request: the worker it was placed on
    (``owner`` = its id) or the API that moved it to the shared queue (``owner`` = the
    API's id). The first to store it wins; the other drops its copy."""

    rid: str
    attempt: int
    owner: str
    v: int = 1
