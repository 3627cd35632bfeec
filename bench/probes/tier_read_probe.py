"""Probe: where the time of a KV load from the disk tier goes, stage by stage, on one host.

Writes ``--groups`` page groups of a 7B model's KV (Qwen2.5-7B: 28 layers, 4 KV heads of 128,
pages of 16 tokens, ``--group-pages`` pages a group, bf16) as the disk tier stores them
(:class:`pdserve.engine.kv_disk.DiskTier`, blobs of :mod:`pdserve.engine.kv_blob`), then reads
them all back ``--repeat`` times a variant, ``--threads`` groups at once as a load does, and
reports GB/s of payload:

- ``read``: the tier's ``get`` alone (a fresh ``bytearray`` a group, ``readinto``);
- ``read_pinned``: ``readinto`` a reused pinned host buffer (on a GPU; else a reused buffer);
- ``crc``: the blob's checksum alone (``kv_blob._checksum``, threads at once);
- ``decode``: ``get`` and :func:`kv_blob.decode` (the checks): what ``_fetch_group`` does;
- ``h2d_pageable`` / ``h2d_pinned``: the groups' copies to the device from pageable / pinned
  host memory, one after another on one thread, then ``index_copy_`` into a pool (GPU only);
- ``load_now``: ``decode`` on the threads, the copies and ``index_copy_`` on the caller, in
  order: what ``KVTiers.load`` does today;
- ``load_pinned``: the same reading each group into a pinned buffer of a ring;
- ``cold_*``: ``read`` and ``load_now`` after the files left the page cache
  (``posix_fadvise(DONTNEED)``: the device's own read rate).

With ``--store``, the same groups in a Mooncake Store (a master and a store server started on
this host, the tier's client over tcp on loopback; ``--only-store``: these variants alone):

- ``store_get``: the tier's ``get`` (the client's copy into Python bytes), threads at once
  (``store_get_1``: on one thread);
- ``store_get_into``: ``get_into`` a registered buffer of a ring and :func:`kv_blob.decode`,
  threads at once: what a load reads a group from the store with;
- ``store_get_into_1``: the same on one thread, group after group (the per-call cost).

    python bench/probes/tier_read_probe.py --out /tmp/tier_read_probe.json [--store --group-pages 16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.engine import kv_blob
from pdserve.engine.kv_disk import DiskTier
from pdserve.engine.kv_pool import page_bytes, page_shape
from pdserve.schemas import KVLayout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--groups", type=int, default=64, help="page groups (64 x 8 pages: an 8,192-token context)")
    parser.add_argument("--group-pages", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the tier's files go (default: a temp dir)")
    parser.add_argument("--store", action="store_true", help="also read the groups from a Mooncake Store")
    parser.add_argument("--only-store", action="store_true", help="the store's variants alone")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    layout = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, page_size=16, dtype="bfloat16")
    ident = kv_blob.identity(b"probe", layout, args.group_pages)
    shape = (args.group_pages, *page_shape(layout))
    group_bytes = args.group_pages * page_bytes(layout)
    root = Path(tempfile.mkdtemp(prefix="tier-probe-", dir=args.dir))
    disk = DiskTier(root, ident, max_bytes=(args.groups + 1) * (group_bytes + 4096))
    keys = [i.to_bytes(4, "little") * 4 for i in range(args.groups)]
    for key in keys:
        pages = torch.randn(shape, dtype=torch.float32).to(torch.bfloat16)
        disk.put(key, *kv_blob.encode_parts(ident, key, pages))
    pool = torch.empty((args.groups * args.group_pages + 1, *page_shape(layout)), dtype=torch.bfloat16, device=device)
    total = args.groups * group_bytes
    pinned = [
        torch.empty(group_bytes + kv_blob.HEADER_BYTES, dtype=torch.uint8, pin_memory=cuda)
        for _ in range(args.threads * 2)
    ]
    pool_threads = ThreadPoolExecutor(args.threads)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def read_into(key: bytes, buf: torch.Tensor) -> memoryview:
        with open(disk.path(key), "rb") as f:
            view = memoryview(buf.numpy()).cast("B")
            got = f.readinto(view)
        return view[:got]

    def uncache() -> None:
        for key in keys:
            fd = os.open(disk.path(key), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    blobs = [disk.get(k) for k in keys]

    def variant_read() -> None:
        list(pool_threads.map(disk.get, keys))

    def variant_read_pinned() -> None:
        list(pool_threads.map(lambda i: read_into(keys[i], pinned[i % len(pinned)]), range(len(keys))))

    def variant_crc() -> None:
        list(pool_threads.map(lambda b: kv_blob._checksum(memoryview(b)[kv_blob.HEADER_BYTES :]), blobs))

    def variant_decode() -> None:
        list(pool_threads.map(lambda k: kv_blob.decode(disk.get(k), ident, k, layout), keys))

    host_groups = [kv_blob.decode(b, ident, k, layout) for b, k in zip(blobs, keys, strict=True)]
    pinned_groups = [g.pin_memory() if cuda else g.clone() for g in host_groups[: args.threads * 2]]

    def copy_in(i: int, src: torch.Tensor) -> None:
        first = i * args.group_pages
        index = torch.tensor(list(range(first, first + args.group_pages)), device=device)
        pool.index_copy_(0, index, src.to(device, non_blocking=True))

    def variant_h2d_pageable() -> None:
        for i, g in enumerate(host_groups):
            copy_in(i, g)
        sync()

    def variant_h2d_pinned() -> None:
        for i in range(len(keys)):
            copy_in(i, pinned_groups[i % len(pinned_groups)])
        sync()

    def variant_load_now() -> None:
        futures = [pool_threads.submit(lambda k=k: kv_blob.decode(disk.get(k), ident, k, layout)) for k in keys]
        for i, fut in enumerate(futures):
            copy_in(i, fut.result())
        sync()

    def variant_load_pinned() -> None:
        # a ring of pinned buffers: a group's buffer goes back once its copy has run
        events: dict[int, torch.cuda.Event] = {}

        def fetch(key: bytes, slot: int) -> torch.Tensor:
            view = read_into(key, pinned[slot])
            group = kv_blob.decode(view, ident, key, layout)
            return group

        futures = []
        slots = []
        for i, key in enumerate(keys):
            slot = i % len(pinned)
            if slot in events:
                events.pop(slot).synchronize()
            slots.append(slot)
            futures.append(pool_threads.submit(fetch, key, slot))
            if i >= len(pinned) - 1:  # copy the oldest in flight before its slot comes round
                j = i - len(pinned) + 1
                copy_in(j, futures[j].result())
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record()
                    events[slots[j]] = ev
        for j in range(max(0, len(keys) - len(pinned) + 1), len(keys)):
            copy_in(j, futures[j].result())
        sync()

    variants = {
        "read": variant_read,
        "read_pinned": variant_read_pinned,
        "crc": variant_crc,
        "decode": variant_decode,
        "load_now": variant_load_now,
        "load_pinned": variant_load_pinned,
    }
    if cuda:
        variants.update(h2d_pageable=variant_h2d_pageable, h2d_pinned=variant_h2d_pinned)
    results: dict[str, dict] = {}

    def timed(name: str, fn, cold: bool = False) -> None:
        fn()  # warm: threads started, kernels loaded
        seconds = []
        for _ in range(args.repeat):
            if cold:
                uncache()
            began = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - began)
        best = min(seconds)
        results[name] = {
            "best_s": round(best, 4),
            "gb_s": round(total / best / 1e9, 2),
            "runs_s": [round(s, 4) for s in seconds],
        }
        print(f"{name:14s} {total / best / 1e9:6.2f} GB/s  ({best * 1e3:.1f} ms for {total / 1e6:.0f} MB)", flush=True)

    if not args.only_store:
        for name, fn in variants.items():
            timed(name, fn)
        timed("cold_read", variant_read, cold=True)
        timed("cold_load_now", variant_load_now, cold=True)
        timed("cold_load_pinned", variant_load_pinned, cold=True)
    if args.store or args.only_store:
        store_variants(args, keys, blobs, ident, layout, group_bytes, cuda, pool_threads, timed)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cpus": os.cpu_count(),
        "dir": str(root),
        "params": {k: str(v) for k, v in vars(args).items()},
        "group_bytes": group_bytes,
        "total_bytes": total,
        "variants": results,
    }
    args.out.write_text(json.dumps(report, indent=1))
    for key in keys:
        disk.discard(key)
    return 0


def store_variants(
    args: argparse.Namespace,
    keys: list[bytes],
    blobs: list[bytearray | None],
    ident: bytes,
    layout: KVLayout,
    group_bytes: int,
    cuda: bool,
    pool_threads: ThreadPoolExecutor,
    timed: Callable[[str, Callable[[], object]], None],
) -> None:
    """The groups put into a Mooncake Store started here, then read back as the store tier
    reads them (see the module's doc)."""
    from pdserve.engine.kv_buffers import ReadBuffers
    from pdserve.engine.kv_store import StoreTier
    from pdserve.kv_store import running_store

    with tempfile.TemporaryDirectory() as logs, running_store(len(keys) * (group_bytes + 8192) * 2, Path(logs)) as m:
        tier = StoreTier(m.address, m.metadata_url, ident)
        try:
            for key, blob in zip(keys, blobs, strict=True):
                assert blob is not None
                tier.put(key, blob)
            ring = ReadBuffers(group_bytes + kv_blob.HEADER_BYTES, args.threads * 2, pin=cuda)
            tier.prepare(ring.allocate())

            def read_into(key: bytes) -> int:
                buffer = ring.take()
                assert buffer is not None
                try:
                    view = tier.get_into(key, buffer)
                    assert view is not None
                    kv_blob.decode(view, ident, key, layout)
                    return len(view)
                finally:
                    ring.give(buffer)

            timed("store_get", lambda: list(pool_threads.map(tier.get, keys)))
            timed("store_get_1", lambda: [tier.get(k) for k in keys])
            timed("store_get_into", lambda: list(pool_threads.map(read_into, keys)))
            timed("store_get_into_1", lambda: [read_into(k) for k in keys])
            for key in keys:
                tier.discard(key)
        finally:
            tier.close()


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
