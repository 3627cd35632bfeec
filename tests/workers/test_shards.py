"""The read plan between tensor-parallel sizes, run for real: pools in memory, each
planned read done with ``memmove`` (what Mooncake does across processes), each decode rank
left with exactly its KV heads of the pulled pages and nothing else written."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdserve.engine.kv_pool import KV_FP8, page_shape
from pdserve.schemas import KVHandle, KVLayout
from pdserve.workers.transfer.shards import plan_shard_reads, shard_mismatch, source_ranks

LAYERS, HEADS, PAGE, DIM = 3, 4, 4, 8


def layout(tp: int, dtype: str = "float32") -> KVLayout:
    return KVLayout(num_layers=LAYERS, num_kv_heads=HEADS // tp, head_dim=DIM, page_size=PAGE, dtype=dtype)


def pools(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each rank's pool: its heads of ``full`` ``[pages, layers, 2, heads, ...]`` (a 16-bit pool's
    ``page, dim``, an FP8 pool's block of bytes: values, then their scales)."""
    return [part.contiguous() for part in full.chunk(tp, dim=3)]


def handle(prefill: list[torch.Tensor], pages: list[int], dtype: str = "float32") -> KVHandle:
    tp = len(prefill)
    page_bytes = prefill[0][0].numel() * prefill[0].element_size()
    base = prefill[0].data_ptr()
    segments = tuple((base + p * page_bytes, page_bytes) for p in pages)
    return KVHandle(
        backend="mooncake",
        endpoint="rank0",
        layout=layout(tp, dtype),
        segments=segments,
        num_tokens=len(pages) * PAGE,
        expires_at=0.0,
        tp_size=tp,
        rank_endpoints=tuple(f"rank{r}" for r in range(tp)) if tp > 1 else (),
        rank_bases=tuple(p.data_ptr() for p in prefill) if tp > 1 else (),
    )


@pytest.mark.parametrize("dtype", ["float32", KV_FP8])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (1, 4)])
def test_each_decode_rank_gets_exactly_its_heads(prefill_tp: int, decode_tp: int, dtype: str) -> None:
    full = (
        torch.randn(10, *page_shape(layout(1)))
        if dtype == "float32"
        else torch.randint(0, 255, (10, *page_shape(layout(1, dtype))), dtype=torch.uint8)
    )
    prefill = pools(full, prefill_tp)
    remote_pages = [2, 3, 4, 7, 8]
    local_pages = [5, 6, 7, 1, 2]
    skip = 1  # the first page is cached on the decode side already
    h = handle(prefill, remote_pages, dtype)
    expected = pools(torch.zeros_like(full), decode_tp)
    for rank, pool in enumerate(torch.zeros_like(full).chunk(decode_tp, dim=3)):
        local = pool.contiguous()
        plans = plan_shard_reads(h, layout(decode_tp, dtype), rank, local_pages, local.data_ptr(), skip)
        endpoints = [e for e, _ in plans]
        holders = [p for p, _, _ in source_ranks(h, HEADS // decode_tp, rank)]
        assert endpoints == [h.rank_endpoint(p) for p in holders]
        assert len(endpoints) == max(1, prefill_tp // decode_tp)
        for _, reads in plans:
            for dst, src, n in reads:
                ctypes.memmove(dst, src, n)
        heads = slice(rank * HEADS // decode_tp, (rank + 1) * HEADS // decode_tp)
        want = expected[rank]
        want[local_pages[skip:]] = full[remote_pages[skip:]][:, :, :, heads]
        assert torch.equal(local, want)
        ops = sum(len(reads) for _, reads in plans)
        if prefill_tp == decode_tp:  # whole pages: one read per run of pages on both sides
            assert ops == 2  # pages 3, 4 -> 6, 7 and 7, 8 -> 1, 2
        else:
            assert ops == (len(local_pages) - skip) * LAYERS * 2 * len(plans)


def test_mismatch_names_both_sides() -> None:
    assert shard_mismatch(layout(1), 1, layout(2), 2) is None
    assert shard_mismatch(layout(2), 2, layout(1), 1) is None
    problem = shard_mismatch(layout(1), 1, layout(1), 2)
    assert problem == "KV heads: prefill 4 (4 on each of 1 ranks), decode 8 (4 on each of 2 ranks)"
    other = KVLayout(num_layers=LAYERS, num_kv_heads=2, head_dim=DIM, page_size=16, dtype="bfloat16")
    problem = shard_mismatch(layout(2), 2, other, 2)
    assert problem is not None and "page size: prefill 4, decode 16" in problem and "dtype: prefill float32" in problem
    problem = shard_mismatch(layout(2, "bfloat16"), 2, layout(2, KV_FP8), 2)
    assert problem == (
        "dtype: prefill bfloat16, decode float8_e4m3fn/block (the decode pool holds FP8 KV pages, --kv-cache-dtype "
        "fp8_e4m3, the other 16-bit ones: run both with the same --kv-cache-dtype)"
    )


def test_handle_of_several_ranks_names_each() -> None:
    with pytest.raises(ValueError, match="each rank's endpoint"):
        KVHandle("mooncake", "e", layout(2), ((1, 1),), 1, 0.0, tp_size=2, rank_endpoints=("a",), rank_bases=(1,))
