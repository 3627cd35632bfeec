"""A KV read that never returns: the decode worker must not become a zombie that heartbeats.

The prefill side here is a real Mooncake engine in a process of its own, frozen with SIGSTOP
after it registered its memory (what a wedged peer looks like to Mooncake's tcp transport:
connections accepted by the kernel, no answer); the lease is granted by the test. The decode
worker's read hangs inside the transfer engine; two leases on, the worker crashes loudly
(stops heartbeating, hands its work back, does not wait for the stuck thread), and the
KV-ready message is delivered again for another worker: nothing is lost."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
import time
from typing import Any

import nats
import pytest

from pdserve.broker import contract, subjects
from pdserve.broker.connection import publish_work
from pdserve.schemas import KVHandle, KVLayout, KVLease, KVLeaseReply, KVReady, SamplingParams
from pdserve.workers.lifecycle import CRASH_EXIT_SECONDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LEASE = 1.0


def _peer(q: Any) -> None:
    """A Mooncake engine with 1 MiB registered; reports (endpoint, address), then waits."""
    from pdserve.workers.transfer import create_transfer

    transfer = create_transfer("mooncake", host="127.0.0.1", protocol="tcp")
    buffer = ctypes.create_string_buffer(1 << 20)
    transfer.register(ctypes.addressof(buffer), len(buffer))
    q.put((transfer.endpoint, ctypes.addressof(buffer)))
    time.sleep(3600)


async def test_a_read_stuck_in_the_transfer_engine_crashes_the_worker_and_loses_nothing(
    workers: Any, nats_server: Any
) -> None:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    peer = ctx.Process(target=_peer, args=(q,), daemon=True)
    peer.start()
    nc = await nats.connect(nats_server.url)
    try:
        endpoint, address = q.get(timeout=60)
        decode = await workers("decode", kv_lease_seconds=LEASE)
        model = decode.config.model_name
        layout: KVLayout = decode.engine.runner.pool.layout
        page_bytes = decode.engine.runner.pool.page_bytes

        async def grant(lease: KVLease) -> KVLeaseReply:
            return KVLeaseReply(rid=lease.rid, granted=True)

        await contract.answer(nc, contract.KV_LEASE, grant, "frozen-prefill")
        os.kill(peer.pid, signal.SIGSTOP)
        prompt = tuple(range(100, 140))
        handle = KVHandle(
            backend="mooncake",
            endpoint=endpoint,
            layout=layout,
            segments=((address, -(-len(prompt) // layout.page_size) * page_bytes),),
            num_tokens=len(prompt),
            expires_at=time.time() + 60,
            protocol="tcp",
            generation=1,
        )
        ready = KVReady(
            rid="stuck-1",
            model=model,
            prompt_ids=prompt,
            output_ids=(5,),
            reply_to="pd.tokens.stuck.stuck-1",
            sampling=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
            prefill_id="frozen-prefill",
            handle=handle,
            published_at=time.time(),
        )
        await publish_work(nc, subjects.kv_ready(model), ready, msg_id="stuck-1")

        deadline = time.monotonic() + 30
        while decode.lifecycle.crashed is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert decode.lifecycle.crashed is not None, "the worker kept running with a read stuck"
        assert "stuck" in decode.lifecycle.crashed and decode.reads_stuck == 1
        # What `serve` does after a crash: stop, bounded; the stuck thread is not waited for.
        began = time.monotonic()
        await asyncio.wait_for(decode.shutdown(), CRASH_EXIT_SECONDS)
        assert decode.stopped.is_set() and time.monotonic() - began < CRASH_EXIT_SECONDS
        assert decode.counters["recomputes"] == 0  # the pages it reserved were never computed into

        # Not lost: the message is there for the next decode worker, delivered a second time.
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            subjects.kv_ready(model), durable=subjects.decode_consumer(model), stream=subjects.KV_STREAM
        )
        (msg,) = await sub.fetch(1, timeout=30)
        assert KVReady.decode(msg.data).rid == "stuck-1" and msg.metadata.num_delivered >= 2
        await msg.term()
    finally:
        await nc.close()
        os.kill(peer.pid, signal.SIGKILL)  # the stuck read fails once its peer's sockets close
        peer.join(10)
