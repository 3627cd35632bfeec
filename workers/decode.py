"""The decode worker: claims ``KVReady`` events while it has free pages, pulls the KV
with one batched transfer, tells the prefill worker to release, and decodes.

With conditional disaggregation the API sends some requests (short prompts, or a busy
prefill pool) to the local-prefill queue instead: a decode worker takes them only while
its KV backlog is empty, its batch has room and less than one prefill chunk of prompt
tokens waits in its engine, and prefills and decodes them itself, like a unified worker
(counted in ``local_prefills``). Such a request is acked when it finishes, so a worker that
dies with it has it redelivered, and its client's API moves it on, as any work message.

A handle that is about to expire or a failed pull end the same way: the worker computes
the prompt itself (counted in ``recomputes``), and the stream goes on. A handle this
worker can never read (another transfer backend or protocol, another KV layout, or a
prefill worker that refuses the link's handshake) is a deployment mistake: the request
gets an error that says what differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pdserve.broker import contract, queues, tracing
from pdserve.broker.consumer import Delivery
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestError, RequestOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.threads import helper_pool
from pdserve.schemas import GenerateRequest, KVLease, KVReady, KVRelease, WorkerInfo
from pdserve.schemas.sampling import sample_rid
from pdserve.schemas.tokens import ALIVE
from pdserve.workers.config import WorkerConfig
from pdserve.workers.intake import Intake
from pdserve.workers.replies import Tracked
from pdserve.workers.runtime import WorkerRuntime
from pdserve.workers.tensor_parallel import ShardedPull
from pdserve.workers.transfer import LinkRefused, ReadStuck, TransferError, plan_reads
from pdserve.workers.transfer.shards import shard_mismatch

log = logging.getLogger(__name__)
T = TypeVar("T")

KV_READY_BATCH = 32
LOCAL_BATCH = 8  # local-prefill requests taken at once
LEASE_TIMEOUT = 2.0
TRANSFER_THREADS = 4  # pulls from several prefill workers at once
# A read still running this many leases after it began is stuck in the transfer engine (a
# frozen peer, a transport that never times out): the worker cannot know when, or whether,
# the bytes will land in the pages it reserved, so it may neither use nor reuse them.
STUCK_READ_LEASES = 2.0


class DecodeWorker(WorkerRuntime):
    def __init__(self, config: WorkerConfig, engine: Engine, engine_thread: ThreadPoolExecutor | None = None) -> None:
        super().__init__(config, engine, engine_thread)
        self.backlog: deque[tuple[Tracked, KVReady]] = deque()  # claimed, waiting for pages
        self.importing: set[str] = set()
        self._peers_seen: set[str] = set()
        self._transfer_threads = helper_pool(TRANSFER_THREADS, "kv-pull")
        self.reads_stuck = 0

    async def setup(self) -> None:
        assert self.nc is not None
        self.transfer = await self.start_transfer(serve=False)
        queue = queues.WorkQueue(self.nc, contract.KV_READY, self.config.model_name, self.worker_id)
        await queue.start()
        self.intake = Intake(queue, self._room, self._take, KV_READY_BATCH, self.config.fetch_timeout, idle_wait=0.02)
        urgent = queues.WorkQueue(self.nc, contract.URGENT_KV_READY, self.config.model_name, self.worker_id)
        await urgent.start()
        self.side_intakes.append(
            Intake(urgent, self._urgent_room, self._take, KV_READY_BATCH, self.config.fetch_timeout, idle_wait=0.02)
        )
        local = await self.request_intake(False, contract.LOCAL_REQUESTS, self.room_for_local)
        self.side_intakes.append(local)

    def room_for_local(self) -> int:
        """Local-prefill requests to take now: none while claimed KV waits for pages or a
        prefill chunk's worth of prompt tokens waits here (the running batch's steps come
        first); else the batch's room, a few at a time."""
        engine = self.engine
        if engine.num_prefill_tokens_waiting >= engine.config.chunked_prefill_size:
            return 0
        return min(self.room(), LOCAL_BATCH)

    async def admit(self, d: Delivery[GenerateRequest], prefill_only: bool) -> None:
        """A local-prefill request: prefilled and decoded here (see the module)."""
        await super().admit(d, prefill_only)
        if self.tracked.get(d.message.rid) is not None:
            self.count("local_prefills")

    def room(self) -> int:
        engine = self.engine
        if self.backlog or engine.pages.num_free_pages < engine.pages.num_pages // 10:
            return 0
        busy = engine.num_running + engine.num_waiting + len(self.importing)
        return max(engine.config.max_num_seqs - busy, 0)

    async def _room(self) -> int:
        """Claims what waits in the backlog first; then the room for new events."""
        await self._drain_backlog()
        return self.room()

    async def _urgent_room(self) -> int:
        """Events of requests of a priority above the default (``priority`` below 0): taken
        while fewer than a batch of them are held here, however full the batch is with others
        (they are claimed ahead of the backlog, and the scheduler gives each the seat of a
        running request of a lower priority). The backlog is drained by the main intake's
        :meth:`_room` alone (two drains at once could claim one event twice)."""
        engine = self.engine
        urgent = engine.num_urgent + sum(1 for rid in self.importing if self._urgent(rid))
        return max(engine.config.max_num_seqs - urgent, 0)

    def _urgent(self, rid: str) -> bool:
        seq = self.engine.seqs.get(rid)
        return seq is not None and seq.sampling.priority < 0

    async def _take(self, deliveries: list[Delivery[KVReady]]) -> None:
        taken = []
        for d in deliveries:
            ready = d.message
            t = self.track(
                d, ready.rid, ready.reply_to, ready.deadline, ready.attempt, ready.request_published_at, ready.batch_to
            )
            t.timings = dict(ready.timings or {})
            t.samples = [sample_rid(ready.rid, i) for i in ready.samples]
            t.sample_seq = dict.fromkeys(t.samples, 1)
            if ready.published_at:
                t.timings["kv_queue"] = max(d.received_at - ready.published_at, 0.0)
                self.span(tracing.QUEUE_DECODE, t, ready.published_at, d.received_at)
            t.next_seq = len(ready.output_ids)
            taken.append((t, ready))
        # First tell every client its request has a holder (were this worker to die now, its
        # API would move the request at once instead of waiting for the stream's ack_wait).
        await asyncio.gather(*(self.replies.state(t, ALIVE) for t, _ in taken))
        for t, ready in taken:
            if await self._drop_if_stale(t, ready):
                continue
            urgent = ready.sampling.priority < 0  # claimed ahead of the backlog, waits ahead of it
            if (self.backlog and not urgent) or not await self._claim(t, ready):
                self._wait_for_pages(t, ready)

    def _wait_for_pages(self, t: Tracked, ready: KVReady) -> None:
        """Into the backlog, behind those of its priority or a higher one (lower values)."""
        p = ready.sampling.priority
        at = next((i for i, (_, r) in enumerate(self.backlog) if r.sampling.priority > p), len(self.backlog))
        self.backlog.insert(at, (t, ready))

    async def _drain_backlog(self) -> None:
        while self.backlog:
            t, ready = self.backlog[0]
            if not await self._claim(t, ready):
                return
            self.backlog.popleft()

    async def _drop_if_stale(self, t: Tracked, ready: KVReady) -> bool:
        """True (``t`` settled, its KV released) when ``t`` must not run: cancelled, late,
        or an attempt this worker already has or has a newer one of. A newer ``t`` drops
        an older attempt that waits in the backlog or decodes here."""
        for i, (waiting, old) in enumerate(self.backlog):
            if waiting.rid != t.rid:
                continue
            if t.attempt == waiting.attempt:  # a redelivery: keep the newest delivery alive
                waiting.delivery, waiting.acked = t.delivery, False
                return True
            if t.attempt < waiting.attempt:
                break
            del self.backlog[i]
            await waiting.settle()
            await self._release(old, ok=False)
            break
        else:
            if t.rid in self.importing and t.attempt > self.tracked[t.rid].attempt:
                return False  # claimed once the older attempt's pull ends (it waits in the backlog)
            if not await self.superseded(t):
                return False
        await t.settle()
        await self._release(ready, ok=False)
        return True

    async def _claim(self, t: Tracked, ready: KVReady) -> bool:
        """Start importing ``ready`` (or computing its prompt); False if it must wait for
        pages or for an older attempt of the request to leave (then it stays in the backlog)."""
        if self.is_cancelled(t.rid, t.attempt, t.published_at) or (ready.deadline and time.time() > ready.deadline):
            await self._release(ready, ok=False)
            await t.settle()
            return True
        if ready.rid in self.importing or ready.rid in self.engine.seqs:
            return False
        if ready.model != self.config.model_name:
            await self._refuse(ready, t, f"model {ready.model!r} is not served here")
            return True
        mismatch = self.unreadable(ready)
        if mismatch is not None:
            log.error("KV handle cannot be read here", extra={"rid": ready.rid, "reason": mismatch})
            await self._refuse(ready, t, mismatch, "server_error")
            return True
        if ready.handle.expires_at - time.time() < self.config.kv_pull_margin:
            log.warning("KV handle (nearly) expired; computing the prompt here", extra={"rid": ready.rid})
            await self._recompute(ready, t)
            return True
        try:
            if ready.sampling.constraint is not None:  # compiled off the loop (cached after the first)
                await asyncio.get_running_loop().run_in_executor(None, self.engine.compile_constraint, ready.sampling)
            seq = self.engine.reserve_import(
                ready.rid, list(ready.prompt_ids), list(ready.output_ids), ready.sampling, _samples(ready)
            )
        except RequestError as exc:
            await self._refuse(ready, t, str(exc))
            return True
        if seq is None:
            return False
        self.tracked[ready.rid] = t
        self.importing.add(ready.rid)
        self.spawn(self._pull(ready, seq, t))
        await self._started(t, ready)
        return True

    async def _started(self, t: Tracked, ready: KVReady) -> None:
        if ready.attempt > 0 or len(ready.output_ids) > 1:
            self.count("migrations")

    def unreadable(self, ready: KVReady) -> str | None:
        """Why this worker can never read ``ready``'s handle (a deployment mistake, answered
        as an error rather than hidden by a recompute), or ``None``."""
        h = ready.handle
        assert self.transfer is not None
        here = f"decode worker {self.worker_id}"
        there = f"prefill worker {ready.prefill_id}"
        if h.backend != self.transfer.name:
            return (
                f"{there} hands KV over {h.backend!r}, {here} over {self.transfer.name!r}: "
                "run both pools with the same --disaggregation-transfer-backend"
            )
        if h.protocol and h.protocol != self.transfer.protocol:
            return (
                f"{there} moves KV over {h.protocol}, {here} over {self.transfer.protocol}: "
                "give both pools the same --disaggregation-ib-device (rdma) or none (tcp)"
            )
        layout = self.engine.runner.pool.layout
        if h.backend != "mooncake" and max(h.tp_size, self.tp_size) > 1:
            return (
                f"{there} has {h.tp_size} tensor-parallel ranks, {here} {self.tp_size}: the {h.backend} backend "
                "pairs workers of one rank each; move KV between tensor-parallel workers over mooncake"
            )
        problem = shard_mismatch(h.layout, h.tp_size, layout, self.tp_size)
        if problem is not None:
            return (
                f"{there} ({h.tp_size} tensor-parallel ranks) holds KV that {here} ({self.tp_size} ranks) cannot "
                f"map: {problem}; run both pools with the same model, --page-size, --dtype and --kv-cache-dtype"
            )
        expected = ready.num_kv_tokens
        if h.num_tokens != expected:
            return f"{there} holds KV of {h.num_tokens} tokens, the request needs {expected}"
        return None

    async def _recompute(self, ready: KVReady, t: Tracked) -> None:
        try:
            self.engine.add_request(
                ready.rid, list(ready.prompt_ids), ready.sampling, list(ready.output_ids), samples=_samples(ready)
            )
        except RequestError as exc:
            await self._refuse(ready, t, str(exc))
            return
        self.tracked[ready.rid] = t
        t.decode_from = time.time()
        t.timings["recomputed"] = 1.0
        self.count("recomputes")
        await self._release(ready, ok=False)
        await self._started(t, ready)
        self.wake()

    async def _refuse(self, ready: KVReady, t: Tracked, reason: str, kind: str = "invalid_request_error") -> None:
        await self.fail(t, reason, kind)
        await self._release(ready, ok=False)

    def _transfer_pages(self, ready: KVReady, reads: list[tuple[int, int, int]]) -> int:
        """In a transfer thread: pull into the reserved pages (no step still queued writes them:
        ``Engine.park_freed``). Returns the transport operations it took."""
        assert self.transfer is not None
        return self.transfer.read(ready.handle.endpoint, reads)

    def _transfer_shards(self, ready: KVReady, pages: list[int], skip: int) -> tuple[int, int]:
        """In a transfer thread: like :meth:`_transfer_pages`, every rank reading its own
        KV heads from the prefill rank(s) holding them (Mooncake). Operations and bytes."""
        assert self.transfer is not None
        pull = ShardedPull(self.engine.runner, self.transfer, self.config.kv_lease_seconds)
        return pull.run(ready.handle, pages, skip)

    async def _pull(self, ready: KVReady, seq: Sequence, t: Tracked) -> None:
        started = time.time()
        nbytes, refused = None, None
        try:
            nbytes = await self._read(ready, seq)
        except LinkRefused as exc:
            refused = str(exc)
        except ReadStuck:  # the worker is stopping; the request goes back unacked, its pages untouched
            return
        ok = nbytes is not None
        self.importing.discard(ready.rid)
        ended = t.decode_from = time.time()
        t.timings["kv_transfer"] = ended - started
        self.kv_pull_seconds += ended - started
        self.metrics.kv_transfer.observe(ended - started)
        self.span(tracing.KV_TRANSFER, t, started, ended, bytes=nbytes or 0, ok=ok, prefill_id=ready.prefill_id)
        await self._release(ready, ok=ok)
        if self.tracked.get(ready.rid) is not t:  # cancelled (or superseded) during the pull
            self.engine.abort(ready.rid)
            await t.settle()
            return
        if refused is not None:  # the two workers cannot pair: an error that says why, not a recompute
            self.count("kv_pull_failures")
            self.engine.abort(ready.rid)
            self.tracked.pop(ready.rid, None)
            await self.fail(t, refused)
            self.wake()
            return
        if ok:
            self.engine.commit_import(seq)
            t.prompt_cached = ready.cached_tokens
        else:
            self.count("recomputes")
            self.engine.fail_import(seq)
        # The KVReady stays unacked (kept alive) until the request finishes.
        self.wake()

    async def _read(self, ready: KVReady, seq: Sequence) -> int | None:
        """Lease the handle's hold, read the pages this pool lacks, check the read ended
        within the lease; the bytes read. ``None`` (logged and counted) if the KV is not to
        be used; raises :class:`LinkRefused` if the prefill worker will never pair with this
        one."""
        assert self.transfer is not None and self.nc is not None
        h = ready.handle
        lease = KVLease(ready.rid, ready.prefill_id, h.generation, self.config.kv_lease_seconds)
        asked = time.monotonic()
        try:
            reply = await contract.ask(self.nc, contract.KV_LEASE, lease, ready.prefill_id, timeout=LEASE_TIMEOUT)
            refused = None if reply.granted else reply.reason
        except contract.Unanswered as exc:
            refused = str(exc)
        if refused is not None:
            self.count("kv_leases_refused")
            log.warning("KV not leased; computing the prompt here", extra={"rid": ready.rid, "reason": refused})
            return None
        pool = self.engine.runner.pool
        page = pool.layout.page_size
        pages = seq.page_table[: -(-h.num_tokens // page)]
        loop = asyncio.get_running_loop()
        try:
            if self.transfer.name == "mooncake":
                ops, nbytes = await self._bounded(
                    ready,
                    loop.run_in_executor(
                        self._transfer_threads, self._transfer_shards, ready, pages, seq.num_cached // page
                    ),
                    lease.seconds,
                )
            else:
                reads = plan_reads(h.segments, pool.page_bytes, pages, pool.data_ptr, skip_pages=seq.num_cached // page)
                ops = await self._bounded(
                    ready,
                    loop.run_in_executor(self._transfer_threads, self._transfer_pages, ready, reads),
                    lease.seconds,
                )
                nbytes = sum(n for _, _, n in reads)
        except (LinkRefused, ReadStuck):
            raise
        except TransferError as exc:
            self.count("kv_pull_failures")
            log.warning("KV pull failed; computing the prompt here", extra={"rid": ready.rid, "error": str(exc)})
            return None
        if time.monotonic() - asked > lease.seconds:
            self.count("kv_pull_failures")
            log.warning("KV read outlasted its lease; computing the prompt here", extra={"rid": ready.rid})
            return None
        self.count("kv_pulls")
        self.count("kv_pull_bytes", nbytes)
        self.count("kv_pull_ops", ops)
        return nbytes

    async def _bounded(self, ready: KVReady, read: asyncio.Future[T], lease_seconds: float) -> T:
        """``read``'s result, or, if it is still running :data:`STUCK_READ_LEASES` leases on
        (or a tensor-parallel rank's part of it was, :class:`ReadStuck` from the read), the
        worker crashes (loudly: it stops heartbeating, hands its requests back and exits
        even with the read's thread still in the transfer engine) and :class:`ReadStuck` is
        raised: the pages the read may still write into are never used again (the worker hands
        everything back at once and exits)."""
        limit = STUCK_READ_LEASES * lease_seconds
        try:
            done, _ = await asyncio.wait({read}, timeout=limit)
        except asyncio.CancelledError:  # the request or the worker went: the read ends in its thread
            read.add_done_callback(_unheeded)
            raise
        if done:
            try:
                return read.result()
            except ReadStuck as exc:  # a tensor-parallel rank's part still running
                self._stuck(exc)
                raise
        read.add_done_callback(_unheeded)  # if it ever ends: nobody waits for it
        stuck = ReadStuck(
            f"the KV read of {ready.rid} from {ready.prefill_id} ({ready.handle.endpoint}) is still running "
            f"{limit:g} s after it began ({STUCK_READ_LEASES:g} leases): the transfer engine is stuck"
        )
        self._stuck(stuck)
        raise stuck

    def _stuck(self, exc: ReadStuck) -> None:
        self.reads_stuck += 1
        self.lifecycle.crash("kv pull", exc)

    async def _release(self, ready: KVReady, ok: bool) -> None:
        assert self.nc is not None
        release = KVRelease(rid=ready.rid, prefill_id=ready.prefill_id, ok=ok, generation=ready.handle.generation)
        with contextlib.suppress(Exception):
            await contract.publish(self.nc, contract.KV_RELEASE, release, ready.prefill_id)

    async def apply_cancel(self, rid: str, reason: str) -> None:
        for t, ready in [(t, r) for t, r in self.backlog if t.rid == rid]:
            if self.is_cancelled(rid, t.attempt, t.published_at):
                self.backlog.remove((t, ready))
                await t.settle()
                await self._release(ready, ok=False)
        await super().apply_cancel(rid, reason)

    async def cancel(self, rid: str, reason: str) -> None:
        if rid in self.importing:
            self.tracked.pop(rid, None)  # _pull sees it gone and frees the pages after the transfer
            return
        await super().cancel(rid, reason)

    def in_hand(self) -> list[Tracked]:
        return super().in_hand() + [t for t, _ in self.backlog]

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        await self.stream_outputs(outputs)
        if self.backlog and self.intake is not None:
            self.intake.room_freed.set()

    async def on_peers(self, peers: list[WorkerInfo]) -> None:
        """Log, once per worker, each prefill worker of this model whose KV this worker
        cannot read (its requests will get an error here that says why)."""
        await super().on_peers(peers)
        assert self.transfer is not None
        layout = self.engine.runner.pool.layout
        for w in peers:
            if w.role != "prefill" or w.model != self.config.model_name or w.worker_id in self._peers_seen:
                continue
            self._peers_seen.add(w.worker_id)
            problems = []
            if w.kv_layout is not None:
                problem = shard_mismatch(w.kv_layout, w.tp_size, layout, self.tp_size)
                if problem is not None:
                    problems.append(problem)
            if w.transfer_backend and w.transfer_backend != self.transfer.name:
                problems.append(f"backend {w.transfer_backend}, here {self.transfer.name}")
            if w.transfer_protocol and w.transfer_protocol != self.transfer.protocol:
                problems.append(f"protocol {w.transfer_protocol}, here {self.transfer.protocol}")
            if problems:
                log.error(
                    "a prefill worker's KV cannot be read by this decode worker; its requests will fail",
                    extra={"prefill": w.worker_id, "differs": "; ".join(problems)},
                )

    def busy(self) -> bool:
        return self.engine.has_work() or bool(self.importing)

    async def hand_back(self) -> None:
        for t, _ in self.backlog:
            await self.give_back(t)
        self.backlog.clear()
        await super().hand_back()

    async def teardown(self) -> None:
        await super().teardown()
        if self.reads_stuck:  # its thread may never come back: neither wait for it nor pull the memory from under it
            self._transfer_threads.shutdown(wait=False, cancel_futures=True)
            return
        self._transfer_threads.shutdown(wait=True)
        if self.transfer is not None:
            self.transfer.close()


def _samples(ready: KVReady) -> list[tuple[int, int]] | None:
    """(index, first token) of each sample of an ``n > 1`` request that goes on; ``None`` else."""
    return list(zip(ready.samples, ready.first_ids, strict=True)) or None


def _unheeded(read: asyncio.Future[T]) -> None:
    """Done callback of a KV read nobody awaits any more: its outcome is taken (a failure is
    then not logged as "never retrieved" when the future is collected) and dropped."""
    if not read.cancelled():
        read.exception()
