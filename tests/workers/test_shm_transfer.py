"""The ``shm`` backend: CPU page pools in /dev/shm files, read by peers of the same host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdserve.engine.kv_pool import SHARED_PREFIX, KVPool
from pdserve.schemas import KVLayout
from pdserve.workers.transfer import LinkRefused, TransferError, create_transfer, plan_reads
from pdserve.workers.transfer.shm import ShmTransfer, parse_endpoint

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")


def started(pool: KVPool, worker_id: str) -> ShmTransfer:
    transfer = create_transfer("shm", pool=pool, worker_id=worker_id)
    assert isinstance(transfer, ShmTransfer)
    transfer.register(pool.data_ptr, pool.nbytes)
    return transfer


def test_a_pool_in_shared_memory_is_private_and_read_by_a_peer(tmp_path: Path) -> None:
    prefill = KVPool(LAYOUT, 10, torch.device("cpu"), str(tmp_path))
    decode = KVPool(LAYOUT, 10, torch.device("cpu"), str(tmp_path))
    assert Path(prefill.shared_path).stat().st_mode & 0o777 == 0o600
    prefill.tensor.normal_()
    src, dst = started(prefill, "p"), started(decode, "d")
    assert parse_endpoint(src.endpoint)[1:] == ("p", prefill.shared_path, prefill.data_ptr)
    reads = plan_reads(prefill.segments([2, 3, 7]), prefill.page_bytes, [0, 1, 5], decode.data_ptr)
    assert dst.read(src.endpoint, reads) == 2
    for r, page in ((2, 0), (3, 1), (7, 5)):
        assert torch.equal(decode.tensor[page], prefill.tensor[r])
    dst.retain({"someone-else"})  # the peer left the registry: its mapping goes
    prefill.close()  # the worker stopped: its file is gone
    assert not Path(prefill.shared_path).exists()
    with pytest.raises(TransferError, match="is gone") as gone:
        dst.read(src.endpoint, reads)
    assert not isinstance(gone.value, LinkRefused)
    decode.close()


def test_another_host_is_refused_and_a_pool_must_be_shared(tmp_path: Path) -> None:
    decode = KVPool(LAYOUT, 4, torch.device("cpu"), str(tmp_path))
    dst = started(decode, "d")
    with pytest.raises(LinkRefused, match="between the processes of one host"):
        dst.read(f"shm:elsewhere:p:{decode.shared_path}@0", [])
    with pytest.raises(LinkRefused, match="not an shm endpoint"):
        dst.read("127.0.0.1:1234", [])
    with pytest.raises(TransferError, match="needs the page pool in shared memory"):
        ShmTransfer(KVPool(LAYOUT, 4, torch.device("cpu")), "x")
    decode.close()


def test_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / f"{SHARED_PREFIX}999999999-abcd"
    stale.write_bytes(b"x")
    mine = tmp_path / f"{SHARED_PREFIX}{os.getpid()}-keep"
    mine.write_bytes(b"x")
    pool = KVPool(LAYOUT, 4, torch.device("cpu"), str(tmp_path))
    assert not stale.exists() and mine.exists()
    pool.close()
