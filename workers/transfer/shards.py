"""KV between workers of different tensor-parallel sizes: which prefill rank holds which of
a decode rank's KV heads, and the reads that fetch exactly those.

Every rank's pool is ``[pages, layers, 2, heads_per_rank, page_size, head_dim]``, so one
head's ``[page_size, head_dim]`` block (an FP8 one with its scales after it) is contiguous and a rank's heads of one (layer, K|V)
are one contiguous span. A decode rank with heads ``[lo, hi)`` reads, from each prefill
rank whose heads overlap them, the overlap:

- the same heads on both sides (equal TP sizes): whole pages, merged into runs, one read
  per run as with one rank;
- otherwise one read per (page, layer, K|V) of the overlapping heads, joined where they
  happen to be contiguous on both sides. That is as few as this page layout allows without
  moving heads the decode rank does not own.

A pair of layouts that cannot be mapped (another model, page size, dtype; a total of KV
heads that differs) is :func:`shard_mismatch`'s, said in one line naming both sides.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.kv_pool import block_bytes, dtype_difference, page_bytes
from pdserve.schemas import KVHandle, KVLayout
from pdserve.workers.transfer.base import TransferError, plan_reads

_FIELDS = {  # and the dtype, said by kv_pool.dtype_difference
    "page_size": "page size",
    "num_layers": "layers",
    "head_dim": "head dim",
    "order": "page order",
}


def shard_mismatch(prefill: KVLayout, prefill_tp: int, decode: KVLayout, decode_tp: int) -> str | None:
    """Why KV held as ``prefill`` over ``prefill_tp`` ranks cannot be read into ``decode``
    over ``decode_tp`` ranks (each layout is one rank's), or ``None``."""
    reasons = [
        f"{label}: prefill {getattr(prefill, name)}, decode {getattr(decode, name)}"
        for name, label in _FIELDS.items()
        if getattr(prefill, name) != getattr(decode, name)
    ]
    dtype = dtype_difference(prefill, decode)
    if dtype:
        reasons.append(dtype)
    total_p, total_d = prefill.num_kv_heads * prefill_tp, decode.num_kv_heads * decode_tp
    if total_p != total_d:
        reasons.append(
            f"KV heads: prefill {total_p} ({prefill.num_kv_heads} on each of {prefill_tp} ranks), "
            f"decode {total_d} ({decode.num_kv_heads} on each of {decode_tp} ranks)"
        )
    return "; ".join(reasons) or None


def source_ranks(handle: KVHandle, heads: int, rank: int) -> list[tuple[int, int, int]]:
    """``(prefill rank, first head, end head)`` of each prefill rank holding some of the
    heads ``[rank * heads, (rank + 1) * heads)`` (global head numbers), in order."""
    lo, hi = rank * heads, (rank + 1) * heads
    per = handle.layout.num_kv_heads
    out = []
    for p in range(handle.tp_size):
        a, b = max(lo, p * per), min(hi, (p + 1) * per)
        if a < b:
            out.append((p, a, b))
    return out


def plan_shard_reads(
    handle: KVHandle,
    local: KVLayout,
    rank: int,
    local_pages: Sequence[int],
    local_base: int,
    skip_pages: int = 0,
) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """``(endpoint, reads)`` per prefill rank for decode rank ``rank`` (its pool ``local``,
    at ``local_base``): the reads copy its KV heads of pages ``skip_pages..`` into
    ``local_pages[skip_pages..]``. ``(local_address, remote_address, nbytes)`` as in
    :func:`~pdserve.workers.transfer.base.plan_reads`."""
    remote = handle.layout
    block = block_bytes(local)  # one head of one (layer, K|V), with its FP8 scales if any
    local_page = page_bytes(local)
    remote_page = page_bytes(remote)
    plans = []
    for p, a, b in source_ranks(handle, local.num_kv_heads, rank):
        shift = handle.rank_offset(p)
        segments = [(address + shift, n) for address, n in handle.segments]
        if remote.num_kv_heads == local.num_kv_heads:  # the same heads: whole pages
            plans.append(
                (handle.rank_endpoint(p), plan_reads(segments, local_page, local_pages, local_base, skip_pages))
            )
            continue
        pages = _page_addresses(segments, remote_page)
        if len(pages) != len(local_pages):
            raise TransferError(f"remote has {len(pages)} pages, local reserved {len(local_pages)}")
        lo_local, lo_remote = a - rank * local.num_kv_heads, a - p * remote.num_kv_heads
        nbytes = (b - a) * block
        reads: list[tuple[int, int, int]] = []
        for i in range(skip_pages, len(local_pages)):
            page_l = local_base + local_pages[i] * local_page
            for kv in range(local.num_layers * 2):
                dst = page_l + (kv * local.num_kv_heads + lo_local) * block
                src = pages[i] + (kv * remote.num_kv_heads + lo_remote) * block
                if reads and reads[-1][0] + reads[-1][2] == dst and reads[-1][1] + reads[-1][2] == src:
                    reads[-1] = (reads[-1][0], reads[-1][1], reads[-1][2] + nbytes)
                else:
                    reads.append((dst, src, nbytes))
        plans.append((handle.rank_endpoint(p), reads))
    return plans


def _page_addresses(segments: Sequence[tuple[int, int]], page_bytes: int) -> list[int]:
    pages: list[int] = []
    for address, nbytes in segments:
        if nbytes % page_bytes:
            raise TransferError(f"segment of {nbytes} bytes is not whole pages of {page_bytes}")
        pages.extend(address + i * page_bytes for i in range(nbytes // page_bytes))
    return pages
