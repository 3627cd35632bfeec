"""Autoscaling on this machine: ``pdserve autoscale`` and ``pdserve up --autoscale``.

Once per ``--scale-interval`` the loop reads each work queue's backlog
(:mod:`pdserve.broker.backlog`) and the worker registry (pages, busy time, work admitted),
asks the rule (:mod:`pdserve.scaling`) how many replicas each role should run, and starts
worker processes or retires them. A retired worker gets SIGTERM and drains like any
stopping worker (stops fetching, finishes or hands back what it holds, frees KV) and is
never restarted (:func:`pdserve.children.tend`). Decisions are logged when they change
something (DEBUG otherwise) and exported as ``pdserve_desired_replicas{role}`` and friends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from nats import errors as nats_errors
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.broker.auth import NatsAuth
from pdserve.broker.backlog import Backlog, pool_backlog
from pdserve.broker.connection import connect
from pdserve.broker.registry import WorkerRegistry
from pdserve.broker.streams import BrokerConfig, worker_bucket
from pdserve.children import Child, tend, threads_per_worker, worker_argv
from pdserve.configs import broker_config, choose_transport, model_name, nats_auth, resolve_model, scaling_config
from pdserve.scaling import (
    ROLES,
    Autoscaler,
    Decision,
    PoolReading,
    RoleRate,
    ScalingConfig,
    ServiceRates,
    WorkerSample,
)
from pdserve.schemas import WorkerInfo

log = logging.getLogger("pdserve.autoscale")

EXIT_FAILED = 70


class Pool:
    """One role's worker processes on this machine. Its children live in ``children``, the
    list :func:`~pdserve.children.tend` keeps running (shared by every pool)."""

    def __init__(self, role: str, argv: list[str], children: list[Child]) -> None:
        self.role = role
        self.argv = argv
        self.children = children
        self._next_index = 0

    def serving(self) -> list[Child]:
        """Children serving or starting (or waiting to be restarted), not retiring."""
        return [c for c in self.children if c.role == self.role and not c.retiring]

    def retiring(self) -> list[Child]:
        return [c for c in self.children if c.role == self.role and c.retiring]

    def scale_to(self, replicas: int, in_flight: Mapping[int, int]) -> None:
        """Start children, or retire those holding the fewest requests (``in_flight`` by
        pid; the newest first among equals), until ``replicas`` serve."""
        serving = self.serving()
        for _ in range(replicas - len(serving)):
            child = Child(self.role, self._next_index, self.argv)
            self._next_index += 1
            child.start()
            self.children.append(child)
        quiet_first = sorted(serving, key=lambda c: (in_flight.get(c.pid or -1, 0), -c.started_at))
        for child in quiet_first[: max(len(serving) - replicas, 0)]:
            child.retire()


class AutoscaleMetrics(Collector):
    """The last decision of each role as Prometheus families."""

    def __init__(self) -> None:
        self.decisions: dict[str, Decision] = {}
        self.readings: dict[str, PoolReading] = {}
        self.backlog_tokens: dict[str, int] = {}
        self.events = {(role, d): 0 for role in ROLES for d in ("up", "down")}

    def observe(self, decision: Decision, reading: PoolReading, backlog_tokens: int) -> None:
        self.decisions[decision.role] = decision
        self.readings[decision.role] = reading
        self.backlog_tokens[decision.role] = backlog_tokens
        if decision.direction != "hold":
            self.events[(decision.role, decision.direction)] += 1

    def collect(self) -> Iterator[Metric]:
        desired = GaugeMetricFamily(
            "pdserve_desired_replicas", "replicas the autoscaler wants per role", labels=["role"]
        )
        current = GaugeMetricFamily(
            "pdserve_autoscale_replicas", "worker processes serving or starting, not draining", labels=["role"]
        )
        need = GaugeMetricFamily(
            "pdserve_autoscale_need_replicas",
            "replicas each signal asks for (lag, tokens, busy, pages), before limits and windows",
            labels=["role", "signal"],
        )
        tokens = GaugeMetricFamily(
            "pdserve_autoscale_backlog_tokens",
            "work waiting in tokens (prefill: prompt tokens queued or admitted, not computed; decode: KV tokens "
            "of events waiting for a decode worker)",
            labels=["role"],
        )
        events = CounterMetricFamily(
            "pdserve_scale_events", "scaling decisions that changed a pool", labels=["role", "direction"]
        )
        for role, d in self.decisions.items():
            desired.add_metric([role], d.desired)
            current.add_metric([role], d.current)
            for signal_name, value in d.needs.items():
                need.add_metric([role, signal_name], value)
            tokens.add_metric([role], self.backlog_tokens.get(role, 0))
        for (role, direction), n in self.events.items():
            events.add_metric([role, direction], n)
        yield from (desired, current, need, tokens, events)


def _work_tokens(w: WorkerInfo) -> int:
    """The tokens a worker computed: prefill the prompt tokens its cache lacked, decode the
    tokens it generated."""
    if w.role == "prefill":
        return w.stats.prompt_tokens - w.stats.cached_tokens
    return w.stats.generated_tokens


class Autoscale:
    """The loop: read, decide, apply. ``pools`` by role; ``model`` the served model name."""

    def __init__(self, config: ScalingConfig, pools: Mapping[str, Pool], model: str, interval: float = 1.0) -> None:
        if interval <= 0:
            raise ValueError("the scaling interval must be positive")
        self.rule = Autoscaler(config)
        self.rates = ServiceRates(window=max(10.0, 5 * interval))
        self.pools = pools
        self.model = model
        self.interval = interval
        self.metrics = AutoscaleMetrics()
        self.host = socket.gethostname()

    async def run(self, nats_url: str, auth: NatsAuth | None, broker: BrokerConfig) -> None:
        """Until cancelled. A broker that is away holds every pool as it is; anything else
        raised ends the loop (and its supervisor says so)."""
        nc = await connect(nats_url, "pdserve-autoscale", auth)
        try:
            js = nc.jetstream()
            registry = WorkerRegistry(await worker_bucket(js, broker), js)
            while True:
                await self.tick(js, registry)
                await asyncio.sleep(self.interval)
        finally:
            with contextlib.suppress(nats_errors.Error):
                await nc.close()

    async def tick(self, js: JetStreamContext, registry: WorkerRegistry) -> dict[str, Decision]:
        try:
            backlogs = {role: await pool_backlog(js, role, self.model) for role in self.pools}
            workers = [w for w in await registry.list() if w.model == self.model]
        except NotFoundError:  # no worker has made the streams yet
            log.debug("no work queues yet; holding")
            return {}
        except (nats_errors.Error, TimeoutError) as exc:  # the broker is away: hold
            log.warning("cannot read the queues; holding", extra={"error": str(exc) or type(exc).__name__})
            return {}
        return self.apply(backlogs, workers, time.time())

    def apply(self, backlogs: Mapping[str, Backlog], workers: list[WorkerInfo], now: float) -> dict[str, Decision]:
        """Decide from one reading (``now``: wall clock, as the heartbeats) and scale."""
        retiring = {c.pid for pool in self.pools.values() for c in pool.retiring()}
        live = [w for w in workers if not (w.host == self.host and w.pid in retiring)]
        self.rates.add(
            WorkerSample(w.worker_id, w.role, w.updated_at, w.stats.busy_seconds, _work_tokens(w)) for w in live
        )
        rates = self.rates.rates(now)
        readings = {role: self._reading(role, backlogs[role], live, rates.get(role)) for role in self.pools}
        decisions = self.rule.decide(time.monotonic(), readings)
        in_flight = {w.pid: w.requests_in_flight for w in workers if w.host == self.host}
        for role, d in decisions.items():
            r = readings[role]
            backlog_tokens = r.tokens_waiting if role == "prefill" else backlogs[role].pending_tokens
            self.metrics.observe(d, r, backlog_tokens)
            fields = {
                "role": role,
                "replicas": d.current,
                "desired": d.desired,
                "reason": d.reason,
                "need": round(d.need, 2),
                "pending": r.pending,
                "ack_pending": r.ack_pending,
                "tokens_waiting": backlog_tokens,
                "busy": round(r.busy, 2),
                "ready": r.ready,
            }
            if d.desired == d.current:
                log.debug("autoscale reading", extra=fields)
                continue
            log.info(f"scaling {role} {d.current} -> {d.desired}", extra=fields)
            self.pools[role].scale_to(d.desired, in_flight)
        return decisions

    def _reading(self, role: str, backlog: Backlog, workers: list[WorkerInfo], rate: RoleRate | None) -> PoolReading:
        ready = [w for w in workers if w.role == role]
        rate = rate or RoleRate(0.0, None)
        reading = PoolReading(
            replicas=len(self.pools[role].serving()),
            pending=backlog.pending,
            ack_pending=backlog.ack_pending,
            ready=len(ready),
            busy=rate.busy,
            tokens_per_second=rate.tokens_per_second,
        )
        if role == "prefill":
            # Pages are no prefill signal: a prefill pool's pages fill with KV held for a slow
            # decode pool, which more prefill workers would not fix.
            admitted = sum(w.stats.prefill_tokens_waiting for w in ready)
            return dataclasses.replace(reading, tokens_waiting=backlog.pending_tokens + admitted)
        page_size = ready[0].page_size if ready else 16
        return dataclasses.replace(
            reading,
            pages_used=sum(w.pages_used for w in ready),
            pages_total=sum(w.pages_total for w in ready),
            pages_waiting=math.ceil(backlog.pending_tokens / page_size),
        )


def size_for_autoscale(args: argparse.Namespace, config: ScalingConfig) -> int:
    """Size the consumers for the largest pools (a worker fetches only what it has room for,
    so a limit above what runs now costs nothing; one below would starve new replicas) and
    return the torch threads per worker: the cores over the smallest pools (:func:`threads_per_worker`)."""
    per_worker = args.max_running_requests
    if args.prefill_max_ack_pending is None:
        args.prefill_max_ack_pending = per_worker * config.prefill.max_replicas
    if args.decode_max_ack_pending is None:
        args.decode_max_ack_pending = per_worker * config.decode.max_replicas
    smallest = max(config.prefill.min_replicas + config.decode.min_replicas, 1)
    return int(args.num_threads or threads_per_worker(smallest))


def run_autoscale(args: argparse.Namespace) -> int:
    """``pdserve autoscale``: prefill and decode workers on this machine against
    ``--nats-url``, as many as the queues ask for; ``/metrics`` on ``--metrics-port``."""
    config = scaling_config(args)
    threads = size_for_autoscale(args, config)
    choose_transport(args.disaggregation_ib_device, args.allow_tcp_fallback, args.disaggregation_transfer_backend)
    model_path: Path = resolve_model(args, weights=args.load_format != "dummy")
    model = model_name(args, model_path)
    children: list[Child] = []
    pools = {r: Pool(r, worker_argv(args, r, model_path, args.nats_url, threads), children) for r in ROLES}
    scaler = Autoscale(config, pools, model, args.scale_interval)
    registry = CollectorRegistry()
    registry.register(scaler.metrics)
    server, _ = start_http_server(args.metrics_port, args.metrics_host, registry)
    log.info("autoscale metrics", extra={"url": f"http://{args.metrics_host}:{server.server_port}/metrics"})
    try:
        for role, pool in pools.items():
            pool.scale_to(config.policy(role).min_replicas, {})
        return asyncio.run(_serve(scaler, children, args.nats_url, nats_auth(args), broker_config(args)))
    finally:
        stop_children(children)
        server.shutdown()


async def _serve(scaler: Autoscale, children: list[Child], nats_url: str, auth: NatsAuth, broker: BrokerConfig) -> int:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    tasks = {
        asyncio.create_task(keep_children(children), name="children"),
        asyncio.create_task(scaler.run(nats_url, auth, broker), name="autoscale"),
    }
    stop = asyncio.create_task(stopping.wait())
    done, _ = await asyncio.wait({*tasks, stop}, return_when=asyncio.FIRST_COMPLETED)
    for task in {*tasks, stop}:
        task.cancel()
    for task in {*tasks, stop}:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    failed = [t for t in done if t is not stop]
    for task in failed:
        log.critical("supervised task ended; stopping", extra={"task": task.get_name()}, exc_info=task.exception())
    return EXIT_FAILED if failed else 0


async def keep_children(children: list[Child]) -> None:
    """Restart dead children, let retired ones drain and go; until cancelled."""
    while True:
        await asyncio.sleep(0.5)
        tend(children)


def stop_children(children: list[Child], timeout: float = 40.0) -> None:
    """SIGTERM every child (each drains), then wait; kill what outlasts ``timeout``."""
    for child in children:
        child.stop()
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.process.kill()
