"""The gloo backend between two page pools against a real nats-server: pages move as one
message over a link opened once and reused; the handshake refuses a layout mismatch on
both sides without hanging; a link is dropped when its peer leaves and opened again.
(The nccl backend is the same code on CUDA pools: ``test_nccl_between_two_gpus``.)"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
import pytest
import torch

from pdserve.engine.kv_pool import KV_FP8, KVPool
from pdserve.schemas import KVLayout
from pdserve.workers.transfer import LinkRefused, TransferError, create_transfer, plan_reads
from pdserve.workers.transfer.p2p import P2PTransfer, layout_differences, merge_runs

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")


def pool(layout: KVLayout = LAYOUT, num_pages: int = 32, seed: int | None = None) -> KVPool:
    p = KVPool(layout, num_pages, torch.device("cpu"))
    if seed is not None:
        p.tensor.copy_(torch.randn(p.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return p


Ends = Callable[..., Any]


@pytest.fixture
async def ends(nats_server) -> AsyncIterator[Ends]:
    """``await ends(pool, worker_id, serve)``: a started gloo backend on its own NATS
    connection; each is closed at the end, and no background job of theirs may fail."""
    failures: list[tuple[str, BaseException]] = []
    made: list[tuple[P2PTransfer, Any]] = []

    async def start(kv: KVPool, worker_id: str, serve: bool) -> P2PTransfer:
        nc = await nats.connect(nats_server.url)
        transfer = create_transfer("gloo", pool=kv, worker_id=worker_id, timeout=5.0)
        assert isinstance(transfer, P2PTransfer)
        transfer.register(kv.data_ptr, kv.nbytes)
        await transfer.attach(nc, serve, lambda where, exc: failures.append((where, exc)))
        made.append((transfer, nc))
        return transfer

    yield start
    for transfer, nc in made:
        transfer.close()
        await nc.close()
    assert not failures


async def sent(prefill: P2PTransfer, n: int) -> dict[str, int]:
    """The prefill end's counts once it has finished ``n`` sends (its side of a send may end
    just after the receiver's)."""
    deadline = time.monotonic() + 5.0
    while prefill.counts()["kv_sends"] < n and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return prefill.counts()


def reads_for(src: KVPool, src_pages: list[int], dst: KVPool, dst_pages: list[int]) -> list[tuple[int, int, int]]:
    return plan_reads(src.segments(src_pages), src.page_bytes, dst_pages, dst.data_ptr)


async def test_pages_move_as_one_message_over_one_link(ends: Ends) -> None:
    src, dst = pool(seed=1), pool()
    prefill = await ends(src, "prefill-a", serve=True)
    decode = await ends(dst, "decode-a", serve=False)
    cases = [
        ([3, 4, 5, 6], [10, 11, 12, 13]),  # one run on both sides: no copy on either
        ([1, 7, 8, 20], [2, 3, 4, 5]),  # gathered on the prefill side
        ([21, 22, 23], [9, 30, 0]),  # scattered on the decode side
        ([2, 9, 14, 15, 31], [16, 18, 17, 1, 6]),  # both
    ]
    for src_pages, dst_pages in cases:
        reads = reads_for(src, src_pages, dst, dst_pages)
        ops = await asyncio.to_thread(decode.read, prefill.endpoint, reads)
        assert ops == 1
        assert torch.equal(dst.tensor[dst_pages], src.tensor[src_pages])
    moved = sum(len(p) for p, _ in cases)
    counts = await sent(prefill, len(cases))
    assert decode.counts()["kv_links_opened"] == 1 and counts["kv_links_opened"] == 1
    assert counts["kv_sends"] == len(cases) and counts["kv_send_failures"] == 0
    assert counts["kv_send_bytes"] == moved * src.page_bytes
    untouched = sorted(set(range(dst.num_pages)) - {p for _, pages in cases for p in pages})
    assert not dst.tensor[untouched].any()


async def test_a_layout_mismatch_is_refused_on_both_sides_at_once(ends: Ends, caplog: pytest.LogCaptureFixture) -> None:
    prefill = await ends(pool(), "prefill-b", serve=True)
    other = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, page_size=2, dtype="float16")
    dst = pool(other)
    decode = await ends(dst, "decode-b", serve=False)
    reads = [(dst.data_ptr, 1 << 20, dst.page_bytes)]
    started = time.monotonic()
    with caplog.at_level(logging.ERROR), pytest.raises(LinkRefused) as refused:
        await asyncio.to_thread(decode.read, prefill.endpoint, reads)
    assert time.monotonic() - started < 3.0  # an answer, not a timeout
    message = str(refused.value)
    for expected in (
        "page size: prefill 4, decode 2",
        "dtype: prefill float32, decode float16",
        "KV heads: prefill 2, decode 4",
    ):
        assert expected in message
    assert "layers" not in message  # only what differs
    assert prefill.counts()["kv_links_refused"] == 1 and decode.counts()["kv_links_refused"] == 1
    assert prefill.counts()["kv_links_opened"] == 0 and not dst.tensor.any()
    logged = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("refused its link" in m for _, m in logged) and any("refused a KV link" in m for _, m in logged)


async def test_a_link_is_dropped_when_its_peer_leaves_and_opened_again(ends: Ends) -> None:
    src, dst = pool(seed=2), pool()
    prefill = await ends(src, "prefill-c", serve=True)
    decode = await ends(dst, "decode-c", serve=False)
    await asyncio.to_thread(decode.read, prefill.endpoint, reads_for(src, [0, 1], dst, [0, 1]))
    decode.retain({"decode-c", "someone-else"})  # the prefill worker left the registry
    prefill.retain(set())
    src.tensor[[5, 6]] += 1.0
    await asyncio.to_thread(decode.read, prefill.endpoint, reads_for(src, [5, 6], dst, [2, 3]))
    assert torch.equal(dst.tensor[[2, 3]], src.tensor[[5, 6]])
    assert decode.counts()["kv_links_opened"] == 2 and prefill.counts()["kv_links_opened"] == 2


async def test_bad_pushes_and_absent_peers_fail_fast(ends: Ends) -> None:
    src, dst = pool(seed=3), pool()
    prefill = await ends(src, "prefill-d", serve=True)
    decode = await ends(dst, "decode-d", serve=False)
    outside = [(dst.data_ptr, src.data_ptr + src.nbytes, src.page_bytes)]
    misaligned = [(dst.data_ptr, src.data_ptr + 3, src.page_bytes)]
    for reads in (outside, misaligned):
        started = time.monotonic()
        with pytest.raises(TransferError, match="will not push"):
            await asyncio.to_thread(decode.read, prefill.endpoint, reads)
        assert time.monotonic() - started < 3.0
    # The refused push dropped the link; the next pull opens a new one and works.
    await asyncio.to_thread(decode.read, prefill.endpoint, reads_for(src, [4], dst, [4]))
    assert torch.equal(dst.tensor[4], src.tensor[4])
    assert (await sent(prefill, 1))["kv_sends"] == 1
    with pytest.raises(TransferError, match="nobody answers"):
        await asyncio.to_thread(decode.read, "prefill-nowhere", reads_for(src, [4], dst, [5]))


def test_the_backend_refuses_a_pool_on_the_wrong_device() -> None:
    with pytest.raises(TransferError, match="the nccl backend moves cuda pools, not cpu ones"):
        create_transfer("nccl", pool=pool(), worker_id="w")


def test_layout_differences_and_run_merging() -> None:
    same = layout_differences(LAYOUT, LAYOUT)
    assert same == []
    other = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")
    assert layout_differences(LAYOUT, other) == ["layers: prefill 3, decode 4", "head dim: prefill 8, decode 16"]
    assert merge_runs([(100, 10), (110, 5), (200, 10), (210, 10), (300, 1)]) == [(100, 15), (200, 20), (300, 1)]


# ---- two GPUs ---------------------------------------------------------------------------
def _gpu_end(role: str, nats_url: str, device: str, pages: list[int], out: Any, remote: int = 0) -> None:
    """One end of the nccl test, in its own process (NCCL pairs two processes)."""

    async def main() -> None:
        layout = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, page_size=16, dtype="bfloat16")
        kv = KVPool(layout, 64, torch.device(device))
        if role == "prefill":
            kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=torch.Generator().manual_seed(5)).to(kv.tensor))
        nc = await nats.connect(nats_url)
        transfer = P2PTransfer("nccl", kv, f"{role}-gpu", timeout=30.0)
        await transfer.attach(nc, role == "prefill", lambda where, exc: out.put(("crash", where, repr(exc))))
        if role == "prefill":
            out.put(("ready", kv.data_ptr))
            await asyncio.sleep(60)
        else:
            reads = [(kv.page_address(p), remote + p * kv.page_bytes, kv.page_bytes) for p in pages]
            ops = [await asyncio.to_thread(transfer.read, "prefill-gpu", reads) for _ in range(3)]
            expect = torch.randn(kv.tensor.shape, generator=torch.Generator().manual_seed(5)).to(kv.tensor)
            out.put(("done", ops, torch.equal(kv.tensor[pages].cpu(), expect[pages].cpu()), transfer.counts()))
        transfer.close()
        await nc.close()

    asyncio.run(main())


@pytest.mark.gpu
def test_nccl_between_two_gpus(nats_server) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    pages = [3, 4, 5, 9, 10]
    prefill = ctx.Process(target=_gpu_end, args=("prefill", nats_server.url, "cuda:0", pages, out), daemon=True)
    prefill.start()
    ready, remote = out.get(timeout=120)
    assert ready == "ready"
    decode = ctx.Process(target=_gpu_end, args=("decode", nats_server.url, "cuda:1", pages, out, remote), daemon=True)
    decode.start()
    result = out.get(timeout=120)
    prefill.kill()
    decode.join(30)
    assert result[0] == "done", result
    _, ops, equal, counts = result
    assert ops == [1, 1, 1] and equal and counts["kv_links_opened"] == 1


def test_layout_differences_say_a_mixed_fp8_pair_and_the_flag() -> None:
    fp8 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=KV_FP8)
    assert layout_differences(fp8, fp8) == []
    (line,) = layout_differences(LAYOUT, fp8)
    assert line.startswith("dtype: prefill float32, decode float8_e4m3fn/block (the decode pool holds FP8 KV pages")
    assert line.endswith("run both with the same --kv-cache-dtype)")
