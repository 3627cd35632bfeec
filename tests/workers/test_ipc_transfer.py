"""The ``ipc`` backend: CUDA page pools of one host mapped by peers through CUDA IPC.

On the CPU: the endpoint's encoding, the refusals (another host, this process, another
layout, a CPU pool, expandable segments). On a GPU (``-m gpu``): a second process holds a
pool, exports it, and the pages pulled through the backend equal its bytes; a 4,096-token
pull at Qwen2.5-7B dimensions is timed; a pool whose process ended cannot be opened."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from pdserve.engine.kv_pool import KVPool
from pdserve.schemas import KVLayout
from pdserve.workers.transfer import LinkRefused, TransferError, create_transfer, plan_reads
from pdserve.workers.transfer.base import backend_device_error
from pdserve.workers.transfer.ipc import (
    PROCESS,
    IpcExport,
    IpcTransfer,
    expandable_segments,
    handle_kind,
    ipc_endpoint,
    parse_endpoint,
    refusal,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")
PAGE_BYTES = LAYOUT.page_numel * 2
QWEN_7B = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, page_size=16, dtype="bfloat16")


def export(**changes: object) -> IpcExport:
    fields: dict[str, object] = dict(
        pid=4242,
        process="a1b2",
        gpu="GPU-0a1b",
        handle=b"\x02c" + bytes(range(64)),
        storage_bytes=10 * PAGE_BYTES,
        storage_offset=2 << 20,
        ref_counter=b"/torch_4242_123_0",
        ref_counter_offset=7,
        tensor_offset=0,
        address=0x7F0000000000,
        nbytes=10 * PAGE_BYTES,
        page_bytes=PAGE_BYTES,
        layout=LAYOUT,
    )
    fields.update(changes)
    return IpcExport(**fields)  # type: ignore[arg-type]


def test_an_endpoint_carries_the_export_and_names_host_and_worker() -> None:
    endpoint = ipc_endpoint("gpu-host", "prefill-1", export())
    assert endpoint.startswith("ipc:gpu-host:prefill-1:")
    assert parse_endpoint(endpoint) == ("gpu-host", "prefill-1", export())
    for bad in ("127.0.0.1:1234", "shm:h:w:/dev/shm/x@1", "ipc:h:w:not-base64!", "ipc:h:w:" + "e30=", "ipc:h"):
        with pytest.raises(LinkRefused, match="not an ipc endpoint"):
            parse_endpoint(bad)
    # An export whose sizes cannot be right is no export.
    with pytest.raises(LinkRefused, match="not an ipc endpoint"):
        parse_endpoint(ipc_endpoint("h", "w", export(tensor_offset=PAGE_BYTES)))


def test_a_pool_of_another_host_this_process_or_another_layout_is_refused() -> None:
    assert refusal(export(), "h", "h", PROCESS, LAYOUT, PAGE_BYTES) == ""
    assert "a pool of host elsewhere, this is h" in refusal(export(), "elsewhere", "h", PROCESS, LAYOUT, PAGE_BYTES)
    assert "use mooncake across hosts" in refusal(export(), "elsewhere", "h", PROCESS, LAYOUT, PAGE_BYTES)
    assert "this very process" in refusal(export(), "h", "h", "a1b2", LAYOUT, PAGE_BYTES)
    # The same pid is not the same process (containers of one host each start at 1).
    assert refusal(export(pid=os.getpid()), "h", "h", PROCESS, LAYOUT, PAGE_BYTES) == ""
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=8, dtype="bfloat16")
    differ = refusal(export(), "h", "h", PROCESS, other, PAGE_BYTES * 2)
    assert differ == "KV layouts differ: page size: prefill 4, decode 8"
    assert "page bytes: prefill" in refusal(export(), "h", "h", PROCESS, LAYOUT, PAGE_BYTES * 2)


def test_a_cpu_pool_or_expandable_segments_are_refused_at_start() -> None:
    pool = KVPool(LAYOUT, 4, torch.device("cpu"))
    with pytest.raises(TransferError, match="maps CUDA page pools, not cpu ones"):
        create_transfer("ipc", pool=pool, worker_id="w")
    assert backend_device_error("ipc", "cpu") == (
        "the ipc backend moves cuda pools, not cpu ones (a cpu pool moves over gloo or mooncake)"
    )
    assert backend_device_error("ipc", "cuda") is None
    assert expandable_segments({}) == ""
    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:False"}) == ""
    on = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert expandable_segments(on) == "PYTORCH_ALLOC_CONF=expandable_segments:True"
    assert handle_kind(bytes(64)) == "cudaMalloc"
    assert handle_kind(b"\x02c" + bytes(64)) == "cudaMalloc"
    assert handle_kind(b"\x02e" + bytes(40)) == "expandable"
    assert handle_kind(b"") == "unknown"


def test_the_launcher_refuses_ipc_on_a_cpu_worker() -> None:
    from pdserve.cli import build_parser
    from pdserve.configs import UsageError, check_worker_flags

    args = build_parser().parse_args(["decode", "--disaggregation-transfer-backend", "ipc"])
    with pytest.raises(UsageError, match="the ipc backend moves cuda pools"):
        check_worker_flags(args, "decode")


# ---- on a GPU ------------------------------------------------------------------------------


def started(pool: KVPool, worker_id: str) -> IpcTransfer:
    transfer = create_transfer("ipc", pool=pool, worker_id=worker_id)
    assert isinstance(transfer, IpcTransfer)
    transfer.register(pool.data_ptr, pool.nbytes)
    return transfer


def devices() -> list[str]:
    return ["cuda:0", "cuda:1"] if torch.cuda.is_available() and torch.cuda.device_count() > 1 else ["cuda:0"]


@pytest.mark.parametrize("device", devices())
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pages_pulled_from_another_process_equal_its_pool(device: str) -> None:
    from pdserve.bench.ipc_peer import pattern, start_peer

    peer = start_peer(LAYOUT, 12, "cuda:0", seed=7)
    try:
        pool = KVPool(LAYOUT, 12, torch.device(device))
        dst = started(pool, "decode")
        assert parse_endpoint(peer.endpoint)[1] == "peer"
        source = pattern(12 * PAGE_BYTES, 7, pool.tensor.device).view(12, PAGE_BYTES)
        remote, local = [2, 3, 4, 9], [0, 1, 2, 6]  # runs 2-4 and 9 into runs 0-2 and 6: two copies
        reads = plan_reads(peer.segments(remote), PAGE_BYTES, local, pool.data_ptr)
        assert dst.read(peer.endpoint, reads) == 2
        got = pool.tensor.view(12, -1).view(torch.uint8)
        for r, page in zip(remote, local, strict=True):
            assert torch.equal(got[page], source[r]), (r, page)
        assert not got[[3, 4, 5, 7]].any()  # nothing else written
        # The mapping is kept (one link) until the peer leaves the registry.
        assert dst.read(peer.endpoint, plan_reads(peer.segments([5]), PAGE_BYTES, [3], pool.data_ptr)) == 1
        assert torch.equal(got[3], source[5])
        assert dst.counts() == {"kv_links_opened": 1, "kv_links_refused": 0}
        # A read outside the peer's pool is refused before any copy.
        outside = [(pool.data_ptr, peer.address + 12 * PAGE_BYTES, PAGE_BYTES)]
        with pytest.raises(TransferError, match="outside the pools"):
            dst.read(peer.endpoint, outside)
        # An endpoint of this very process: refused, counted.
        with pytest.raises(LinkRefused, match="this very process"):
            dst.read(dst.endpoint, [])
        assert dst.counts()["kv_links_refused"] == 1
    finally:
        peer.stop()
    # The peer is gone and has left the registry: its pool cannot be opened any more.
    dst.retain(set())
    with pytest.raises(TransferError, match="cannot be opened") as gone:
        dst.read(peer.endpoint, reads)
    assert not isinstance(gone.value, LinkRefused)
    dst.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_4096_token_pull_at_qwen2_5_7b_dimensions() -> None:
    from pdserve.bench.ipc_peer import pattern, start_peer

    page_bytes = QWEN_7B.page_numel * 2
    pages = 4096 // QWEN_7B.page_size
    assert pages * page_bytes == 234_881_024  # 235 MB
    peer = start_peer(QWEN_7B, pages + 8, "cuda:0", seed=3)
    try:
        pool = KVPool(QWEN_7B, pages + 8, torch.device("cuda:0"))
        dst = started(pool, "decode")
        reads = plan_reads(peer.segments(list(range(4, 4 + pages))), page_bytes, list(range(pages)), pool.data_ptr)
        assert len(reads) == 1
        times = []
        for _ in range(10):
            began = time.perf_counter()
            assert dst.read(peer.endpoint, reads) == 1  # one copy launch for the whole prompt
            times.append(time.perf_counter() - began)
        expected = pattern((pages + 8) * page_bytes, 3, pool.tensor.device)[4 * page_bytes : (4 + pages) * page_bytes]
        assert torch.equal(pool.tensor[:pages].reshape(-1).view(torch.uint8), expected)
        median = statistics.median(times[1:])  # the first one maps the pool
        print(f"ipc pull of 235 MB: median {median * 1e3:.3f} ms ({pages * page_bytes / median / 1e9:.0f} GB/s)")
        assert median < 0.01  # a device copy (0.12 ms measured on one H200), not a trip through the host
        dst.close()
    finally:
        peer.stop()
