"""The KV of one prompt between two processes, one per device (``bench/two_gpu_pd.py``'s
first phase): the whole pull a decode worker makes through the ``nccl`` (or ``gloo``)
backend, pages in one run and scattered, the bare send/recv of the same bytes, and
Mooncake's own path beside it, each in child processes with a timeout."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port

from pdserve.schemas import KVLayout


def _p2p_end(
    role: str,
    backend: str,
    device: str,
    layout: KVLayout,
    tokens: int,
    nats_url: str,
    wire: str,
    q: Any,
    go: Any,
    reps: int,
    remote_base: int = 0,
) -> None:
    """One end of the point-to-point measurement, in its own process. The prefill end owns the
    TCP store of the bare send/recv (``wire``: its address), which starts once the decode end
    sets ``go`` (after its pulls, so the two communicators never work at once). The decode end
    reads the prefill end's pool at ``remote_base``; a failure is put on ``q``."""
    from pdserve.engine.kv_pool import KVPool
    from pdserve.workers.transfer.p2p import P2PTransfer

    async def main() -> None:
        import nats

        n = tokens // layout.page_size
        kv = KVPool(layout, 2 * n + 2, torch.device(device))
        if role == "prefill":
            kv.tensor.copy_(_pattern(kv))
        nc = await nats.connect(nats_url)
        transfer = P2PTransfer(backend, kv, f"{role}-bench", timeout=120.0)
        await transfer.attach(nc, role == "prefill", lambda where, exc: q.put(("crash", role, where, repr(exc))))
        if role == "prefill":
            q.put(("ready", kv.data_ptr))
            await asyncio.to_thread(go.wait)
            await asyncio.to_thread(_wire, "prefill", backend, kv, n, reps, wire)
            await asyncio.sleep(3600)  # the parent ends this process
        pb = kv.page_bytes
        contiguous = [(kv.page_address(n + 1), remote_base, n * pb)]
        scattered = [(kv.page_address(2 * i + 1), remote_base + 2 * i * pb, pb) for i in range(n)]
        times: dict[str, list[float]] = {"pull": [], "pull_scattered": []}
        for name, reads in (("pull", contiguous), ("pull_scattered", scattered)):
            for i in range(reps + 2):
                t0 = time.perf_counter()
                await asyncio.to_thread(transfer.read, "prefill-bench", reads)
                if i >= 2:  # the first opens the link
                    times[name].append((time.perf_counter() - t0) * 1e3)
        expected = _pattern(kv).cpu()
        ok = torch.equal(kv.tensor[1 : 2 * n : 2].cpu(), expected[0 : 2 * n - 1 : 2])
        kv.tensor.zero_()
        await asyncio.to_thread(transfer.read, "prefill-bench", contiguous)
        ok = ok and torch.equal(kv.tensor[n + 1 : 2 * n + 1].cpu(), expected[0:n])
        go.set()
        bare = await asyncio.to_thread(_wire, "decode", backend, kv, n, reps, wire)
        q.put(("done", times, bare, ok, transfer.counts(), n * pb))
        transfer.close()
        await nc.close()

    try:
        asyncio.run(main())
    except Exception as exc:  # told to the parent, which records it
        q.put(("error", role, f"{type(exc).__name__}: {exc}"))
        raise


def _pattern(kv: Any) -> torch.Tensor:
    """The prefill end's pool contents, reproducible on the decode end for the check."""
    return torch.randn(kv.tensor.shape, generator=torch.Generator().manual_seed(3)).to(kv.tensor)


def _wire(role: str, backend: str, kv: Any, n: int, reps: int, address: str) -> list[float]:
    """The bare send/recv of the same bytes over a communicator of the same kind (no NATS, no
    staging): what the link costs beyond the wire. Times the receive after a token message,
    so the sender is known to be there."""
    from torch.distributed import PrefixStore, TCPStore

    from pdserve.workers.transfer.p2p import new_group

    host, _, port = address.rpartition(":")
    prefill = role == "prefill"
    store = TCPStore(
        host, int(port), is_master=prefill, wait_for_workers=False, timeout=datetime.timedelta(seconds=600)
    )
    group = new_group(backend, PrefixStore("wire", store), 0 if prefill else 1, host, 600.0)
    data = (kv.tensor[0:n] if prefill else kv.tensor[n + 1 : 2 * n + 1]).view(torch.uint8)
    token = torch.zeros(8, dtype=torch.uint8, device=kv.tensor.device)

    def sync() -> None:
        if kv.tensor.is_cuda:
            torch.cuda.synchronize(kv.tensor.device)

    times = []
    for i in range(reps + 2):
        if prefill:
            group.send([token], 1, 0).wait()
            group.send([data], 1, 0).wait()
            sync()
        else:
            group.recv([token], 0, 0).wait()
            sync()
            t0 = time.perf_counter()
            group.recv([data], 0, 0).wait()
            sync()
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure_p2p(args: argparse.Namespace, layout: KVLayout, devices: list[str], backend: str) -> dict[str, Any]:
    """Median times of the pull and of the bare send/recv, in ms; the bytes checked."""
    from pdserve.broker.server import start_nats_server

    server = start_nats_server(Path(tempfile.mkdtemp(prefix="pd-two-nats-")))
    ctx = multiprocessing.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    wire = f"127.0.0.1:{free_port()}"
    ends = []
    remote = 0
    try:
        for role, device in (("prefill", devices[0]), ("decode", devices[1])):
            argv = (role, backend, device, layout, args.tokens, server.url, wire, q, go, args.reps, remote)
            ends.append(ctx.Process(target=_p2p_end, args=argv, daemon=True))
            ends[-1].start()
            if role == "prefill":
                msg = q.get(timeout=args.transfer_timeout)
                if msg[0] != "ready":
                    return {"error": repr(msg)}
                remote = msg[1]
        result = q.get(timeout=args.transfer_timeout)
    except Exception as exc:  # a timeout or a dead end: recorded, the run goes on
        return {"error": repr(exc)}
    finally:
        for p in ends:
            p.kill()
            p.join(10)
        server.stop()
    if result[0] != "done":
        return {"error": repr(result)}
    _, times, bare, ok, counts, nbytes = result
    pull, wire_ms = statistics.median(times["pull"]), statistics.median(bare)
    return {
        "backend": backend,
        "bytes": nbytes,
        "pull_ms": times["pull"],
        "pull_median_ms": pull,
        "pull_gb_per_s": nbytes / pull / 1e6,
        "pull_scattered_ms": times["pull_scattered"],
        "pull_scattered_median_ms": statistics.median(times["pull_scattered"]),
        "wire_ms": bare,
        "wire_median_ms": wire_ms,
        "wire_gb_per_s": nbytes / wire_ms / 1e6,
        "bytes_equal": ok,
        "counts": counts,
    }


def _mooncake_end(role: str, protocol: str, device: str, layout: KVLayout, tokens: int, q: Any, peer: Any) -> None:
    """One end of Mooncake's read of the same bytes (its own process)."""
    from pdserve.engine.kv_pool import KVPool
    from pdserve.workers.transfer.mooncake import MooncakeTransfer

    n = tokens // layout.page_size
    kv = KVPool(layout, n + 1, torch.device(device))
    transfer = MooncakeTransfer(host="127.0.0.1", protocol=protocol)
    transfer.register(kv.data_ptr, kv.nbytes)
    if role == "prefill":
        kv.tensor.fill_(1.0)
        q.put(("ready", transfer.endpoint, kv.data_ptr))
        time.sleep(3600)  # the parent ends this process
    endpoint, remote = peer
    reads = [(kv.data_ptr, remote, n * kv.page_bytes)]
    times = []
    for i in range(7):
        t0 = time.perf_counter()
        transfer.read(endpoint, reads)
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    ok = bool((kv.tensor[:n] == 1.0).all())
    q.put(("done", times, ok))


def measure_mooncake(args: argparse.Namespace, layout: KVLayout, devices: list[str], protocol: str) -> dict[str, Any]:
    """Mooncake reading the same bytes between the two devices; a hang costs at most
    ``--mooncake-timeout``."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    ends: list[Any] = []
    started = time.monotonic()
    try:
        ends.append(
            ctx.Process(
                target=_mooncake_end, args=("prefill", protocol, devices[0], layout, args.tokens, q, None), daemon=True
            )
        )
        ends[0].start()
        msg = q.get(timeout=args.mooncake_timeout)
        if msg[0] != "ready":
            return {"protocol": protocol, "error": repr(msg)}
        left = max(args.mooncake_timeout - (time.monotonic() - started), 1.0)
        argv = ("decode", protocol, devices[1], layout, args.tokens, q, (msg[1], msg[2]))
        ends.append(ctx.Process(target=_mooncake_end, args=argv, daemon=True))
        ends[1].start()
        _, times, ok = q.get(timeout=left)
    except Exception as exc:  # a hang (the timeout) or a failure: recorded, the run goes on
        return {"protocol": protocol, "error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    finally:
        for p in ends:
            p.kill()
            p.join(10)
    return {"protocol": protocol, "read_ms": times, "read_median_ms": statistics.median(times), "bytes_equal": ok}
