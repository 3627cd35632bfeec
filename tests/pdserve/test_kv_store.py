"""``pdserve up --kv-store``: Mooncake Store's master and store server from the Mooncake
wheel, started and named to the workers; what one client puts outlives it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.autoscale import stop_children
from pdserve.children import Child
from pdserve.cli import build_parser
from pdserve.configs import UsageError
from pdserve.engine.kv_store import StoreTier
from pdserve.supervisor import KV_STORE, _store, worker_argv


def test_up_kv_store_starts_a_store_that_outlives_its_clients() -> None:
    args = build_parser().parse_args(["up", "--kv-store", "--kv-store-server-bytes", str(32 << 20)])
    children: list[Child] = []
    try:
        _store(args, children)
        assert [c.role for c in children] == [KV_STORE, KV_STORE]
        assert all(c.process is not None and c.process.poll() is None for c in children)
        argv = worker_argv(args, "prefill", Path("/m"), "nats://n:1", 1)
        assert argv[argv.index("--kv-store-master") + 1] == args.kv_store_master
        assert argv[argv.index("--kv-store-metadata") + 1] == args.kv_store_metadata
        writer = StoreTier(args.kv_store_master, args.kv_store_metadata, b"i" * 16)
        writer.put(b"k" * 16, b"kv" * 1000)
        writer.close()  # a worker that stops: its objects live in the store server
        reader = StoreTier(args.kv_store_master, args.kv_store_metadata, b"i" * 16)
        assert reader.get(b"k" * 16) == b"kv" * 1000
        reader.close()
    finally:
        stop_children(children)


def test_up_refuses_kv_store_with_a_master_of_its_own() -> None:
    args = build_parser().parse_args(["up", "--kv-store", "--kv-store-master", "h:1"])
    with pytest.raises(UsageError, match="--kv-store"):
        _store(args, [])
