"""A worker of several tensor-parallel ranks (``--tensor-parallel-size N``).

Rank 0 is the worker: NATS, the scheduler, the sampler, holds and leases. Ranks 1..N-1
are its followers (:func:`serve_follower`): each runs the steps rank 0 sends
(:meth:`ModelRunner.follow`) on its share of the weights and of the KV heads, and, on a
prefill or decode worker, has a transfer endpoint of its own for its share of the pages.
Rank 0 learns the followers' endpoints and pool addresses from the group's store, puts
them in every ``KVHandle`` it publishes, and on a decode worker hands each follower its
part of a pull (:class:`ShardedPull`). A follower dies when rank 0 does (its next receive
fails, and it gets SIGTERM as rank 0's child); rank 0 ends (exit 70, supervised) when a
follower dies (:class:`Followers`).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.threads import helper_pool
from pdserve.schemas import KVHandle
from pdserve.workers.config import WorkerConfig
from pdserve.workers.transfer import ReadStuck, TransferBackend, TransferError, create_transfer
from pdserve.workers.transfer.shards import plan_shard_reads

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.parallel import TPGroup

log = logging.getLogger(__name__)

PULL_THREADS = 4
POLL_SECONDS = 0.001


def _endpoint_key(rank: int) -> str:
    return f"endpoint/{rank}"


def follower_endpoints(tp: TPGroup) -> list[tuple[str, int]]:
    """Rank 0: each follower's ``(transfer endpoint, pool address)``, in rank order (waits
    until each has published its own)."""
    out = []
    for rank in range(1, tp.size):
        endpoint, base = tp.store.get(_endpoint_key(rank)).decode().split()
        out.append((endpoint, int(base)))
    return out


def start_transfer(config: WorkerConfig, runner: ModelRunner, worker_id: str) -> TransferBackend:
    """The configured KV transfer backend over ``runner``'s whole page pool, registered: a
    worker's (which then attaches it to NATS) or a follower rank's (Mooncake: one-sided
    reads need nothing else of it)."""
    pool = runner.pool
    transfer = create_transfer(
        config.transfer_backend,
        host=config.transfer_host or config.host,
        protocol=config.transfer_protocol,
        device_name=config.ib_device,
        pool=pool,
        worker_id=worker_id,
        timeout=config.kv_lease_seconds,  # a read that ends later is not trusted anyway
    )
    transfer.register(pool.data_ptr, pool.nbytes)
    return transfer


def serve_follower(config: WorkerConfig, runner: ModelRunner) -> None:
    """A follower's whole life: publish its transfer endpoint, then run rank 0's commands
    until it says stop. Raises (the process ends non-zero) when rank 0 is gone."""
    tp = runner.tp
    assert tp is not None and not tp.is_leader
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is rank 0's to handle
    transfer = None
    if config.role != "unified":
        transfer = start_transfer(config, runner, f"{config.worker_id}/rank{tp.rank}")
        tp.store.set(_endpoint_key(tp.rank), f"{transfer.endpoint} {runner.pool.data_ptr}")
    pulls = helper_pool(PULL_THREADS, "kv-pull")

    def pull(key: str, handle: KVHandle, pages: list[int], skip: int) -> None:
        fence = None
        if runner.device.type == "cuda":  # after the steps queued before it, as on rank 0
            fence = torch.cuda.Event()
            fence.record()
        pulls.submit(_pull_here, tp, runner, transfer, key, handle, pages, skip, fence)

    try:
        runner.follow({"pull": pull})
    except RuntimeError as exc:
        log.error("rank 0 of this worker is gone: this rank ends too", extra={"rank": tp.rank, "error": str(exc)})
        raise
    finally:
        pulls.shutdown(wait=False, cancel_futures=True)
        if transfer is not None:
            transfer.close()
    log.info("tensor-parallel rank stopped", extra={"rank": tp.rank})


def _pull_here(
    tp: TPGroup,
    runner: ModelRunner,
    transfer: TransferBackend | None,
    key: str,
    handle: KVHandle,
    pages: list[int],
    skip: int,
    fence: Any,
) -> None:
    """A follower's part of a pull; the outcome goes to the store for rank 0."""
    try:
        if transfer is None:
            raise TransferError("this rank has no transfer backend")
        if fence is not None:
            fence.synchronize()
        ops, nbytes = read_shard(transfer, runner, tp.rank, handle, pages, skip)
        outcome = f"ok {ops} {nbytes}"
    except Exception as exc:  # every failure goes back to rank 0, which fails the pull
        outcome = f"error {exc}"
    tp.store.set(f"{key}/{tp.rank}", outcome)


def read_shard(
    transfer: TransferBackend, runner: ModelRunner, rank: int, handle: KVHandle, pages: list[int], skip: int
) -> tuple[int, int]:
    """Read this rank's KV heads of ``handle``'s pages ``skip..`` into ``pages[skip..]``:
    the transport operations and bytes it took."""
    pool = runner.pool
    plans = plan_shard_reads(handle, pool.layout, rank, pages, pool.data_ptr, skip_pages=skip)
    ops = sum(transfer.read(endpoint, reads) for endpoint, reads in plans)
    return ops, sum(n for _, reads in plans for _, _, n in reads)


class ShardedPull:
    """Rank 0 of a decode worker: a pull of one handle into every rank's pool at once."""

    def __init__(self, runner: ModelRunner, transfer: TransferBackend, timeout: float) -> None:
        self.runner = runner
        self.transfer = transfer
        self.timeout = timeout

    def run(self, handle: KVHandle, pages: list[int], skip: int) -> tuple[int, int]:
        """Pull (blocking, in a transfer thread); the operations and bytes of all ranks.
        Raises :class:`TransferError` if any rank's part failed, :class:`ReadStuck` if one
        did not end in time (it may still write into the pages)."""
        tp = self.runner.tp
        key = f"pull/{uuid.uuid4().hex}"
        if tp is not None:
            tp.send(("pull", key, handle, pages, skip))
        ops, nbytes = read_shard(self.transfer, self.runner, 0, handle, pages, skip)
        if tp is None:
            return ops, nbytes
        keys = [f"{key}/{rank}" for rank in range(1, tp.size)]
        deadline = time.monotonic() + self.timeout
        while not tp.store.check(keys):
            if time.monotonic() > deadline:
                raise ReadStuck(f"a follower rank did not finish its part of the pull in {self.timeout:g}s")
            time.sleep(POLL_SECONDS)
        failures = []
        for rank, k in enumerate(keys, start=1):
            outcome = tp.store.get(k).decode()
            tp.store.delete_key(k)
            kind, _, rest = outcome.partition(" ")
            if kind != "ok":
                failures.append(f"rank {rank}: {rest}")
                continue
            more_ops, more_bytes = rest.split()
            ops += int(more_ops)
            nbytes += int(more_bytes)
        if failures:
            raise TransferError("; ".join(failures))
        return ops, nbytes


class Followers:
    """Rank 0's follower processes: whether one has died, and stopping them."""

    def __init__(self, processes: list[subprocess.Popen[bytes]]) -> None:
        self.processes = processes

    def dead(self) -> str | None:
        for rank, proc in enumerate(self.processes, start=1):
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {proc.returncode}"
        return None

    def wait(self, seconds: float) -> None:
        """Wait for them to leave (after rank 0 said stop); kill what is left."""
        deadline = time.monotonic() + seconds
        for proc in self.processes:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("a tensor-parallel rank did not stop; killing it", extra={"pid": proc.pid})
                proc.kill()
                proc.wait()
