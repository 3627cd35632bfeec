"""What every worker role shares: the table of requests in hand and admission of
``GenerateRequest``s here; the engine loop (:mod:`.stepping`) and cancels and timers
(:mod:`.housekeeping`) are parts of the same class.

The jobs around it live beside it: :mod:`.intake` receives work, :mod:`.replies` sends
results, :mod:`.lifecycle` starts, serves and stops.

Threading: the asyncio loop owns the engine's state (adds, aborts, releases,
scheduling, postprocessing); only a step's forward pass (:meth:`Engine.launch` and
:meth:`Engine.collect`) runs in the engine thread, so no lock is needed. Build the engine
in that thread too (:func:`engine_thread_pool`, as ``pdserve prefill|decode|unified`` do): on a
CPU each thread that runs a parallel torch operation gets its own OpenMP thread pool, and
with two of them libgomp counts more threads than cores and stops letting idle ones spin,
which cost the forward passes a quarter of their speed on two cores (docs/performance.md).
Transfers run in their own threads on reserved pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext

from pdserve.broker import contract, queues, streams, tracing
from pdserve.broker.claims import Claims
from pdserve.broker.consumer import Delivery
from pdserve.broker.deadletter import watch_dead_letters
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestError
from pdserve.schemas import (
    FlushCache,
    FlushCacheReply,
    GenerateRequest,
    KVEvents,
    WorkerCounters,
    WorkerInfo,
    WorkerStats,
)
from pdserve.schemas.sampling import sample_rid
from pdserve.schemas.tokens import ALIVE, HANDED_BACK, prompt_logprobs_bytes
from pdserve.workers.cancels import Cancels
from pdserve.workers.config import WorkerConfig
from pdserve.workers.housekeeping import Housekeeping
from pdserve.workers.intake import Intake
from pdserve.workers.lifecycle import Lifecycle
from pdserve.workers.metrics import WorkerMetrics
from pdserve.workers.replies import Replies, Tracked
from pdserve.workers.tensor_parallel import Followers, follower_endpoints, start_transfer
from pdserve.workers.transfer import TransferBackend

log = logging.getLogger(__name__)

REQUEST_BATCH = 64


def engine_thread_pool() -> ThreadPoolExecutor:
    """The one thread a worker's engine computes in (see the module's note on threading)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


class WorkerRuntime(Housekeeping):
    """Base of the prefill, decode and unified workers. Subclasses set :attr:`intake` in
    :meth:`setup` and implement :meth:`on_outputs`."""

    def __init__(self, config: WorkerConfig, engine: Engine, engine_thread: ThreadPoolExecutor | None = None) -> None:
        self.config = config
        self.engine = engine
        self.worker_id = config.worker_id
        self.lifecycle = Lifecycle(config, self.worker_info)
        self.stopping = self.lifecycle.stopping
        self.stopped = self.lifecycle.stopped
        self.replies = Replies(config.worker_id)
        self.intake: Intake[Any] | None = None
        self.side_intakes: list[Intake[Any]] = []  # more queues a role takes work from
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.tracked: dict[str, Tracked] = {}
        self.requests: dict[str, GenerateRequest] = {}
        self.cancels = Cancels()
        self.counters = dict.fromkeys((f.name for f in dataclasses.fields(WorkerCounters)), 0)
        self.kv_pull_seconds = 0.0
        self.metrics = WorkerMetrics(self.worker_info, engine.tiers, engine.stats.spec)
        self.transfer: TransferBackend | None = None
        # Tensor parallelism: the other ranks' processes, and their (endpoint, pool address).
        self.followers: Followers | None = None
        self.rank_transfers: list[tuple[str, int]] = []
        self.claims: Claims | None = None
        self._wake = asyncio.Event()
        self._engine_thread = engine_thread or engine_thread_pool()
        self._background: set[asyncio.Task[None]] = set()
        self._started_at = time.time()

    # ---- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        self.nc, self.js = await self.lifecycle.connect()
        self.replies.connect(self.nc)
        await contract.subscribe(self.nc, contract.CANCEL, self._on_cancel)
        await contract.answer(self.nc, contract.FLUSH_CACHE, self._on_flush, self.worker_id)
        await watch_dead_letters(self.nc, self.js, self.config.model_name, self._on_dead_letter)
        self.engine.pages.record_events = self.config.prefix_placement
        await self.setup()
        self.engine.time_steps = log.isEnabledFor(logging.DEBUG)  # the step timeline's device times
        work = [self._engine_loop(), self._tick_loop()]
        if self.followers is not None:
            work.append(self._watch_followers())
        for intake in (self.intake, *self.side_intakes):
            if intake is not None:
                work.append(intake.run(self.stopping))
        await self.lifecycle.report_ready(*work)

    async def _watch_followers(self) -> None:
        """A tensor-parallel rank that dies ends this worker (its steps cannot run without it)."""
        assert self.followers is not None
        while True:
            await asyncio.sleep(0.5)
            dead = self.followers.dead()
            if dead is not None:
                raise RuntimeError(dead)

    async def _on_dead_letter(self, rid: str) -> None:
        self.count("dead_lettered")

    async def setup(self) -> None:
        """Role-specific start-up (intake, transfer engine, extra subscriptions)."""

    async def serve(self) -> None:
        """Start, run until SIGTERM/SIGINT, then shut down gracefully."""
        await self.lifecycle.serve(self.start, self.shutdown)

    async def shutdown(self) -> None:
        """Stop taking work, let in-flight requests finish (up to ``drain_seconds``), hand
        back the rest, free KV, leave the registry, drain the connection."""
        self.stopping.set()
        self.wake()
        steps = [
            ("hand back", self.hand_back),
            ("teardown", self.teardown),
            ("engine thread", self._stop_engine),
            ("tensor-parallel ranks", self._stop_followers),
        ]
        await self.lifecycle.stop(self.busy, steps)

    def busy(self) -> bool:
        return self.engine.has_work()

    async def hand_back(self) -> None:
        """Unfinished requests go back to the stream for another worker; each client is
        told (a ``handed_back`` chunk), so its API resumes it from the tokens it has."""
        await self._discard_step()
        for rid, t in list(self.tracked.items()):
            self.engine.abort(rid)
            await self.give_back(t)
            self.tracked.pop(rid, None)
            self.requests.pop(rid, None)

    async def _discard_step(self) -> None:
        """After the engine loop stopped: wait out a forward pass still running in the
        engine thread, and drop the requests of the steps it left unfinished (their pages
        are freed; without this an abort would wait for a postprocess that never comes)."""
        await asyncio.get_running_loop().run_in_executor(self._engine_thread, time.sleep, 0)
        self.engine.discard_in_flight()

    async def give_back(self, t: Tracked) -> None:
        await self.replies.state(t, HANDED_BACK)
        if t.samples:
            await t.settle()  # its client moves each sample on alone: no redelivery of the whole
        else:
            await t.hand_back()
        self.count("handed_back")

    async def _on_flush(self, flush: FlushCache) -> FlushCacheReply:
        freed = self.engine.flush_cache()
        log.info("prefix cache flushed", extra={"pages_freed": freed, "reason": flush.reason})
        return FlushCacheReply(self.worker_id, freed, len(self.tracked))

    async def teardown(self) -> None:
        """Stop the intakes, finish the KV tiers' queued writes; roles add their own clean-up."""
        for intake in (self.intake, *self.side_intakes):
            if intake is not None:
                await intake.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)

    async def _stop_engine(self) -> None:
        self._engine_thread.shutdown(wait=True)

    async def _stop_followers(self) -> None:
        tp = self.engine.runner.tp
        if self.followers is None or tp is None or self.followers.dead() is not None:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.engine.runner.stop_followers)
        await loop.run_in_executor(None, self.followers.wait, 10.0)
        tp.close()

    async def start_transfer(self, serve: bool) -> TransferBackend:
        """The configured KV transfer backend, with this worker's whole page pool registered
        and its control plane on NATS (``serve``: answer the peers that read from this worker)."""
        cfg = self.config
        if cfg.transport_fallback:
            log.warning(
                "RDMA cannot work here: KV moves over tcp (--allow-tcp-fallback)",
                extra={"ib_device": cfg.transport_fallback_device, "why": cfg.transport_fallback},
            )
            self.count("kv_transport_fallbacks")
        transfer = start_transfer(cfg, self.engine.runner, self.worker_id)
        assert self.nc is not None
        await transfer.attach(self.nc, serve, self.lifecycle.crash)
        tp = self.engine.runner.tp
        if tp is not None:
            self.rank_transfers = await asyncio.get_running_loop().run_in_executor(None, follower_endpoints, tp)
            log.info("tensor-parallel ranks' transfer endpoints", extra={"ranks": self.rank_transfers})
        return transfer

    @property
    def tp_size(self) -> int:
        tp = self.engine.runner.tp
        return 1 if tp is None else tp.size

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to one of the :class:`WorkerCounters` (a ``KeyError`` for a misspelt name)."""
        self.counters[counter] += n

    def worker_info(self) -> WorkerInfo:
        pages = self.engine.pages
        transfer = self.transfer
        engine = self.engine
        tiers = engine.tiers
        stats = WorkerStats(
            steps=engine.stats.steps,
            batch_rows=engine.stats.batch_rows,
            prompt_tokens=engine.stats.prompt_tokens,
            cached_tokens=engine.stats.cached_tokens,
            generated_tokens=engine.stats.generated_tokens,
            busy_seconds=engine.stats.busy_seconds,
            turn_wait_seconds=engine.stats.turn_wait_seconds,
            kv_pull_seconds=self.kv_pull_seconds,
            waiting=engine.num_waiting,
            running=engine.num_running,
            prefill_tokens_waiting=engine.num_prefill_tokens_waiting,
            grammar_refusals=engine.stats.grammar_refusals,
            scored_prompt_tokens=engine.stats.scored_prompt_tokens,
            overlapped_steps=engine.stats.overlapped_steps,
            history_unoverlapped_steps=engine.stats.history_unoverlapped_steps,
            preemptions=engine.scheduler.num_preemptions,
            priority_preemptions=engine.scheduler.num_priority_preemptions,
            stop_regex_timeouts=engine.stats.stop_regex_timeouts,
        )
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.config.role,
            model=self.config.model_name,
            host=socket.gethostname(),
            pid=os.getpid(),
            capacity=self.engine.config.max_num_seqs,
            pages_total=pages.num_pages,
            pages_used=pages.num_used_pages,
            page_size=pages.page_size,
            requests_in_flight=len(self.tracked),
            transfer_endpoint=transfer.endpoint if transfer else "",
            model_path=str(self.config.model_path),
            started_at=self._started_at,
            updated_at=time.time(),
            counters=WorkerCounters(
                **{**self.counters, **(transfer.counts() if transfer else {}), **(tiers.totals() if tiers else {})}
            ),
            kv_layout=self.engine.runner.pool.layout if transfer else None,
            transfer_backend=transfer.name if transfer else "",
            transfer_protocol=transfer.protocol if transfer else "",
            stats=stats,
            kv_tiers=tiers.counts() if tiers else (),
            tp_size=self.tp_size,
        )

    # ---- requests in ---------------------------------------------------------
    async def request_intake(
        self,
        prefill_only: bool,
        channel: contract.WorkChannel[GenerateRequest] = contract.REQUESTS,
        room_for: Callable[[], int] | None = None,
        scope: tuple[str, ...] = (),
    ) -> Intake[GenerateRequest]:
        """Intake from a request queue (``channel``), admitting into the engine (prefill and
        unified from the request stream; decode from its local-prefill queue), while
        ``room_for()`` (default :meth:`room_for_requests`) says there is room."""
        assert self.nc is not None
        queue = queues.WorkQueue(self.nc, channel, self.config.model_name, self.worker_id, scope)
        await queue.start()
        claims = channel is contract.PLACED

        async def room() -> int:
            return room_for() if room_for is not None else self.room_for_requests()

        async def take(deliveries: list[Delivery[GenerateRequest]]) -> None:
            for d in deliveries:
                if claims and not await self._claim_placed(d):
                    continue
                await self.admit(d, prefill_only)
            self.wake()

        return Intake(queue, room, take, REQUEST_BATCH, self.config.fetch_timeout, idle_wait=0.01)

    async def urgent_intake(self, prefill_only: bool) -> Intake[GenerateRequest]:
        """Intake of the requests of a priority above the default (``priority`` below 0),
        from their own queue, taken while fewer than a batch of them are held here however
        full the batch is with others (the scheduler gives each the seat of one of a lower
        priority: :meth:`room_for_urgent`)."""
        return await self.request_intake(prefill_only, contract.URGENT_REQUESTS, self.room_for_urgent)

    def room_for_urgent(self) -> int:
        engine = self.engine
        return max(engine.config.max_num_seqs - engine.num_urgent, 0)

    async def placed_intake(self, prefill_only: bool) -> Intake[GenerateRequest]:
        """Intake of the requests the API placed on this worker (prefix-aware placement):
        its own durable consumer on its own subject; each is claimed before it runs."""
        assert self.js is not None
        broker = self.config.broker
        await streams.ensure_placed_consumer(self.js, self.config.model_name, self.worker_id, broker)
        self.claims = Claims(await streams.claim_bucket(self.js, broker))
        return await self.request_intake(prefill_only, contract.PLACED, scope=(self.worker_id,))

    async def _claim_placed(self, d: Delivery[GenerateRequest]) -> bool:
        """True when this worker holds the claim of placed ``d`` (it runs it); else ``d`` is
        dropped (the API moved it to the shared queue) or, with the broker away, handed back."""
        assert self.claims is not None
        req = d.message
        try:
            owner = await self.claims.claim(req.rid, req.attempt, self.worker_id)
        except Exception as exc:
            log.warning("placement claim failed; handing back", extra={"rid": req.rid, "error": str(exc)})
            await d.nak(delay=0.5)
            return False
        if owner == self.worker_id:
            self.count("placed_taken")
            return True
        self.count("placed_withdrawn")
        await d.ack()
        return False

    async def publish_kv_events(self) -> None:
        """What the prefix cache indexed and forgot since the last call, as one
        ``KVEvents`` (with prefix-aware placement; lost on a broker outage: the API's index
        is approximate)."""
        if not self.config.prefix_placement or self.nc is None:
            return
        pages = self.engine.pages
        stored, evicted = pages.take_events()
        if not (stored or evicted):
            return
        events = KVEvents(
            self.worker_id,
            self.config.model_name,
            pages.page_size,
            tuple(h.hex() for h in stored),
            tuple(h.hex() for h in evicted),
        )
        try:
            await contract.publish(self.nc, contract.KV_EVENTS, events, self.config.model_name)
        except Exception as exc:
            log.debug("KV events not published", extra={"error": str(exc)})

    def room_for_requests(self) -> int:
        """How many more requests to take: bounded by the batch size and free pages."""
        engine = self.engine
        if engine.pages.num_free_pages < engine.pages.num_pages // 10:
            return 0
        return max(engine.config.max_num_seqs - engine.num_waiting - engine.num_running, 0)

    def track(
        self,
        d: Delivery,
        rid: str,
        reply_to: str,
        deadline: float,
        attempt: int,
        published_at: float,
        batch_to: str = "",
    ) -> Tracked:
        """A delivery in hand, counted if it is a redelivery."""
        if d.num_delivered > 1:
            self.count("redeliveries")
        t = Tracked(rid, reply_to, d, deadline, attempt=attempt, published_at=published_at, batch_to=batch_to)
        t.trace, t.received_at = d.trace, d.received_at
        return t

    def span(self, name: str, t: Tracked, start: float, end: float, **attributes: int | str | bool) -> None:
        """Record stage ``name`` of ``t`` in its trace (nothing when it came without one)."""
        if t.trace is not None:
            named: dict[str, int | str | bool] = {f"pdserve.{key}": value for key, value in attributes.items()}
            named.update({"pdserve.rid": t.rid, "pdserve.attempt": t.attempt, "pdserve.worker_id": self.worker_id})
            tracing.record(name, t.trace, start, end, named)

    async def superseded(self, t: Tracked) -> bool:
        """Settle ``t`` and say True if it must not run: cancelled, past its deadline, or an
        attempt older than (or the same as) the one in hand; an older attempt in hand is
        dropped for the newer ``t``. The same attempt again is a redelivery: the newest
        delivery is the one kept alive and settled."""
        if self.is_cancelled(t.rid, t.attempt, t.published_at) or (t.deadline and time.time() > t.deadline):
            await t.settle(ok=True)
            return True
        held = self.tracked.get(t.rid)
        if held is None:
            return False
        if t.attempt > held.attempt:
            await self.cancel(t.rid, f"superseded by attempt {t.attempt}")
            return False
        if t.attempt == held.attempt and t.delivery is not None:
            held.delivery, held.acked = t.delivery, False
            return True
        await t.settle(ok=True)
        return True

    async def admit(self, d: Delivery[GenerateRequest], prefill_only: bool) -> None:
        req = d.message
        t = self.track(d, req.rid, req.reply_to, req.deadline, req.attempt, req.published_at, req.batch_to)
        t.next_seq = len(req.output_ids)
        if req.published_at:
            t.timings["request_queue"] = max(d.received_at - req.published_at, 0.0)
            self.span(tracing.QUEUE_PREFILL, t, req.published_at, d.received_at)
        if await self.superseded(t):
            return
        if req.model != self.config.model_name:
            await self.fail(t, f"model {req.model!r} is not served here", "invalid_request_error")
            return
        scoring = req.sampling.prompt_logprobs
        assert self.nc is not None
        if scoring is not None and prompt_logprobs_bytes(len(req.prompt_ids), scoring) > self.nc.max_payload:
            message = f"the prompt's log-probabilities would not fit in one message of {self.nc.max_payload} bytes"
            await self.fail(t, message, "invalid_request_error", "prompt_logprobs_too_large")
            return
        if not await self.make_room(t):
            return
        if req.rid in self.engine.seqs or req.rid in self.engine.held:  # an older attempt leaves after its step
            await t.hand_back(delay=0.5)
            return
        try:
            if req.sampling.constraint is not None:  # compiled off the loop (cached after the first)
                await asyncio.get_running_loop().run_in_executor(None, self.engine.compile_constraint, req.sampling)
            self.engine.add_request(
                req.rid, list(req.prompt_ids), req.sampling, list(req.output_ids), prefill_only=prefill_only
            )
        except RequestError as exc:
            await self.fail(t, str(exc), "invalid_request_error")
            return
        self.tracked[req.rid] = t
        self.requests[req.rid] = req
        if req.sampling.n > 1:
            t.samples = [sample_rid(req.rid, i) for i in range(req.sampling.n)]
        if req.output_ids:
            self.count("migrations")
        await self.replies.state(t, ALIVE)  # the client's API now knows a worker holds it

    async def make_room(self, t: Tracked) -> bool:
        """Roles that hold more of a request than ``tracked`` shows (prefill: its held KV)
        free it here for a newer attempt; False when that must wait (``t`` handed back)."""
        return True

    async def fail(self, t: Tracked, message: str, kind: str = "server_error", code: str | None = None) -> None:
        """Answer ``t`` with an error and terminate its delivery."""
        await self.replies.fail(t, message, kind, code)
        await t.settle(ok=False)

    def wake(self) -> None:
        self._wake.set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background, supervised (an exception ends the worker),
        keeping a reference until it ends."""
        task = self.lifecycle.supervise(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def is_cancelled(self, rid: str, attempt: int = 0, published_at: float = 0.0) -> bool:
        return self.cancels.applies(rid, attempt, published_at)
