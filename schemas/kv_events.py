"""``KVEvents``: what a worker's prefix cache gained and lost, for prefix-aware placement,
and the chained page hash both sides compute."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

from pdserve.schemas.codec import Message


def page_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chained hash of one full page of tokens: equal hashes mean equal whole prefixes."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def salt_root(salt: str | None) -> bytes | None:
    """The hash a salted prompt's page chain starts from (``cache_salt``): its first page's
    ``parent``; ``None`` without a salt (the chain every unsalted prompt shares)."""
    if salt is None:
        return None
    return hashlib.blake2b(b"pdserve-cache-salt\0" + salt.encode(), digest_size=16).digest()


def page_hashes(tokens: Sequence[int], page_size: int, parent: bytes | None = None) -> list[bytes]:
    """The chained hashes of the leading full pages of ``tokens`` (:func:`page_hash` of each,
    the tokens packed once: a 4,096-token prompt's 256 pages in a third of the time).
    ``parent``: the hash of the page before ``tokens`` (they continue a chain)."""
    full = len(tokens) // page_size * page_size
    words = array("q", tokens[:full])
    if sys.byteorder != "little":
        words.byteswap()  # page_hash packs little-endian
    packed = memoryview(words.tobytes())
    step = page_size * 8
    hashes: list[bytes] = []
    parent = parent or b""
    for start in range(0, full * 8, step):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(packed[start : start + step])
        parent = h.digest()
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
