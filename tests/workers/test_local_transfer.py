"""The ``local`` backend: KV handed over between two page pools of one process."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_pool import KV_FP8, KVPool
from pdserve.schemas import KVLayout
from pdserve.workers.transfer import LinkRefused, TransferError, create_transfer, plan_reads
from pdserve.workers.transfer.local import LocalTransfer, local_endpoint

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")


def pool(layout: KVLayout = LAYOUT, pages: int = 12) -> KVPool:
    return KVPool(layout, pages, torch.device("cpu"))


def started(p: KVPool, worker_id: str) -> LocalTransfer:
    transfer = create_transfer("local", pool=p, worker_id=worker_id)
    assert isinstance(transfer, LocalTransfer)
    transfer.register(p.data_ptr, p.nbytes)
    return transfer


def test_a_read_copies_the_planned_pages_and_nothing_else() -> None:
    prefill, decode = pool(), pool()
    prefill.tensor.normal_()
    src, dst = started(prefill, "p"), started(decode, "d")
    try:
        remote_pages = [3, 4, 5, 9]  # two runs on the prefill side
        local_pages = [0, 1, 7, 8]  # two runs on the decode side, broken elsewhere
        reads = plan_reads(prefill.segments(remote_pages), prefill.page_bytes, local_pages, decode.data_ptr)
        assert dst.read(src.endpoint, reads) == len(reads) == 3
        for r, page in zip(remote_pages, local_pages, strict=True):
            assert torch.equal(decode.tensor[page], prefill.tensor[r])
        untouched = [p for p in range(decode.num_pages) if p not in local_pages]
        assert not decode.tensor[untouched].any()
    finally:
        src.close()
        dst.close()


def test_layouts_that_differ_are_refused_saying_which() -> None:
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=8, dtype="float32")
    prefill, decode = pool(other), pool()
    src, dst = started(prefill, "p2"), started(decode, "d2")
    try:
        with pytest.raises(LinkRefused, match="page_size: prefill 8, decode 4"):
            dst.read(src.endpoint, [(decode.data_ptr, prefill.data_ptr, decode.page_bytes)])
    finally:
        src.close()
        dst.close()


def test_a_16_bit_pool_and_an_fp8_one_are_refused_naming_the_flag() -> None:
    fp8 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=KV_FP8)
    prefill, decode = pool(fp8), pool()
    src, dst = started(prefill, "p-fp8"), started(decode, "d-fp8")
    try:
        with pytest.raises(LinkRefused, match=r"the prefill pool holds FP8 KV pages.*same --kv-cache-dtype"):
            dst.read(src.endpoint, [(decode.data_ptr, prefill.data_ptr, decode.page_bytes)])
        assert not decode.tensor.any()
    finally:
        src.close()
        dst.close()


def test_another_process_pool_is_refused_and_a_gone_one_is_a_transfer_error() -> None:
    decode = pool()
    dst = started(decode, "d3")
    try:
        with pytest.raises(LinkRefused, match="not a page pool of this process"):
            dst.read("local:elsewhere:1:prefill-x", [])
        with pytest.raises(TransferError, match="is gone") as gone:
            dst.read(local_endpoint("prefill-stopped"), [(decode.data_ptr, 0, decode.page_bytes)])
        assert not isinstance(gone.value, LinkRefused)  # the caller recomputes: the worker may have stopped
    finally:
        dst.close()


def test_a_read_outside_the_pools_and_a_partial_registration_are_errors() -> None:
    prefill, decode = pool(), pool()
    src, dst = started(prefill, "p4"), started(decode, "d4")
    try:
        with pytest.raises(TransferError, match="outside the pools"):
            dst.read(src.endpoint, [(decode.data_ptr, prefill.data_ptr + prefill.nbytes, prefill.page_bytes)])
        with pytest.raises(TransferError, match="whole page pools"):
            LocalTransfer(prefill, "p5").register(prefill.data_ptr, prefill.page_bytes)
    finally:
        src.close()
        dst.close()
    with pytest.raises(TransferError, match="is gone"):  # closed: no longer readable
        LocalTransfer(decode, "d6").read(src.endpoint, [(decode.data_ptr, prefill.data_ptr, 4)])
