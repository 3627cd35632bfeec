"""``pdserve up``: the broker, the worker processes and the API on one machine.

Workers run as child processes (``python -m pdserve <role>``); one that dies is
restarted with a back-off. The embedded ``nats-server`` is supervised too: if it dies it
is started again on the same port over the same file store (every accepted message is
there), and workers and the API reconnect. The API runs in this process under uvicorn.
SIGINT or SIGTERM stops the API, then the workers (each drains), then the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from pdserve import flags
from pdserve.api.config import ApiConfig
from pdserve.autoscale import EXIT_FAILED, Autoscale, Pool, size_for_autoscale, stop_children
from pdserve.broker.auth import NatsAuth
from pdserve.broker.credentials import ADMIN, EmbeddedCredentials
from pdserve.broker.server import NatsServer, NatsServerError, start_nats_server, write_private
from pdserve.children import Child, nats_user, tend, threads_per_worker, worker_argv
from pdserve.configs import (
    UsageError,
    api_config,
    api_keys,
    check_generation_config,
    choose_transport,
    model_name,
    nats_auth,
    resolve_model,
)
from pdserve.launch import listen_socket
from pdserve.plan import (
    choose_backend,
    plan_autoscale,
    plan_core_turns,
    plan_cores,
    plan_devices,
    plan_roles,
    role_threads,
    size_consumers,
)
from pdserve.scaling import ROLES
from pdserve.telemetry import setup_tracing

log = logging.getLogger("pdserve.up")
KV_STORE = "kv-store"  # the role of the Mooncake Store processes of --kv-store


@dataclass
class Broker:
    """The embedded ``nats-server``; :meth:`restart` starts it again where it was."""

    data_dir: Path
    server: NatsServer
    users: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0

    @property
    def url(self) -> str:
        return self.server.url

    def is_alive(self) -> bool:
        return self.server.process.poll() is None

    def restart(self) -> None:
        """Start the server again on its port, monitor port and store; blocks until it
        listens (a fraction of a second). Raises ``NatsServerError`` if it cannot."""
        port = int(self.server.url.rsplit(":", 1)[1])
        monitor = int(self.server.monitor_url.rsplit(":", 1)[1]) if self.server.monitor_url else -1
        self.server = start_nats_server(self.data_dir, port=port, monitor_port=monitor, users=self.users)
        self.restarts += 1

    def stop(self) -> None:
        self.server.stop()


def api_argv(
    args: argparse.Namespace,
    model_path: Path,
    nats_url: str,
    api_id: str | None = None,
    credentials: EmbeddedCredentials | None = None,
    key_file: Path | None = None,
) -> list[str]:
    """``python -m pdserve api`` on ``up``'s port (shared), with ``up``'s API flags, the
    API keys as ``key_file`` and, with the embedded broker, ``api_id``'s user."""
    table = flags.api_forwarded()
    values = {flag.dest: flag.default for flag in table}
    values.update({k: v for k, v in vars(args).items() if k in values})
    values.update(
        model_path=model_path, revision=None, gguf_file=None, nats_url=nats_url, reuse_port=True, exit_with_parent=True
    )
    values.update(api_id=api_id)
    values.update(api_key_file=key_file or values["api_key_file"], **nats_user(credentials, api_id))
    return [sys.executable, "-m", "pdserve", "api", *flags.render(table, values)]


def _embedded_broker(data_dir: Path, api_ids: list[str], client_ids: list[str]) -> tuple[Broker, EmbeddedCredentials]:
    """The embedded ``nats-server`` with a user per role, per API process and per direct publisher."""
    try:
        credentials = EmbeddedCredentials.create(data_dir / "auth", api_ids, client_ids)
    except ValueError as exc:
        raise UsageError(f"--nats-client: {exc}") from None
    users = credentials.entries()
    broker = Broker(data_dir, start_nats_server(data_dir, users=users), users)
    log.info(
        "nats-server started",
        extra={"url": broker.url, "monitor": broker.server.monitor_url, "credentials": str(credentials.directory)},
    )
    return broker, credentials


def _key_file(args: argparse.Namespace) -> Path | None:
    """The API keys, for the extra API processes, in a file only this user can read."""
    keys = api_keys(args)
    if not keys or args.api_processes < 2:
        return None
    path = Path(args.data_dir) / "api-keys"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, "".join(key + "\n" for key in keys))
    return path


def _store(args: argparse.Namespace, children: list[Child]) -> None:
    """``--kv-store``: Mooncake Store's master and a store server on ``--transfer-host``,
    started now (the workers need them at start-up), added to ``children`` (restarted like
    workers); the workers' flags name the master."""
    from pdserve.kv_store import StoreMasterError, plan_master, plan_server, wait_until_listening

    if args.kv_store_master:
        raise UsageError("--kv-store starts a store; --kv-store-master names one already running: give one of them")
    master = plan_master(args.transfer_host)
    for part in (master, plan_server(master, args.kv_store_server_bytes)):
        child = Child(KV_STORE, len(children), part.argv())
        children.append(child)
        child.start()
        assert child.process is not None
        try:
            wait_until_listening(part, child.process)
        except StoreMasterError as exc:
            stop_children(children)
            raise UsageError(f"--kv-store: {exc}") from None
    args.kv_store_master, args.kv_store_metadata = master.address, master.metadata_url
    os.environ.setdefault("GLOG_minloglevel", "2")  # the workers' store clients: glog INFO lines are noise
    log.info(
        "mooncake store started",
        extra={"master": master.address, "metadata": master.metadata_url, "bytes": args.kv_store_server_bytes},
    )


def run_up(args: argparse.Namespace) -> int:
    scaling = None
    if args.autoscale:
        scaling, roles = plan_autoscale(args)
        threads = size_for_autoscale(args, scaling)
    else:
        roles = plan_roles(args)
        size_consumers(args, roles)
        threads = args.num_threads or threads_per_worker(len(roles))
    devices = plan_devices(args, roles)
    turns = plan_core_turns(args)
    if turns is not None:
        if not args.num_threads:
            threads = threads_per_worker(1)  # each steps on all the cores, one at a time
        log.info("CPU workers take turns at the cores", extra={"lock": str(turns), "threads_each": threads})
    worker_threads = role_threads(args, roles, threads)
    planned = plan_cores(args, worker_threads)
    own_cores: list[list[int] | None] = [*planned] if planned is not None else [None for _ in roles]
    if args.api_processes < 1 or (args.api_processes > 1 and args.port == 0):
        raise SystemExit("pdserve up: error: --api-processes must be at least 1 (and more than 1 needs a fixed --port)")
    own_credentials = [f.name for f in flags.NATS_AUTH if getattr(args, f.dest) is not None]
    if own_credentials and not args.nats_url:
        raise UsageError(f"{', '.join(own_credentials)}: for --nats-url; the embedded broker makes its own users")
    if args.nats_client and args.nats_url:
        raise UsageError("--nats-client: for the embedded broker; an external server's operator makes its users")
    if args.js_replicas > 1 and not args.nats_url:
        raise UsageError(
            f"--js-replicas {args.js_replicas}: the embedded broker is one server; give a clustered one with --nats-url"
        )
    transport = choose_transport(
        args.disaggregation_ib_device, args.allow_tcp_fallback, args.disaggregation_transfer_backend
    )
    if transport.fallback:
        log.warning("RDMA cannot work here: workers will move KV over tcp", extra={"why": transport.fallback})
    model_path = resolve_model(args, weights=args.load_format != "dummy")
    args.disaggregation_transfer_backend, why = choose_backend(args, model_path=model_path)
    if args.mode == "pd" and not args.colocate:
        log.info("KV transfer backend", extra={"backend": args.disaggregation_transfer_backend, "why": why})
    check_generation_config(args, model_path)
    key_file = _key_file(args)
    prefix = f"api-{uuid.uuid4().hex[:8]}"
    api_ids = [f"{prefix}-{i}" for i in range(args.api_processes)]
    broker = credentials = None
    if args.nats_url:
        nats_url = args.nats_url
    else:
        broker, credentials = _embedded_broker(Path(args.data_dir) / "nats", api_ids, args.nats_client or [])
        nats_url = broker.url
    children: list[Child] = []
    if args.kv_store:
        _store(args, children)
    scaling_run: tuple[Autoscale, NatsAuth | None] | None = None
    if scaling is not None:
        argv = {
            r: worker_argv(args, r, model_path, nats_url, role_threads(args, [r], threads)[0], None, credentials)
            for r in ROLES
        }
        pools = {r: Pool(r, argv[r], children) for r in ROLES}
        scaler = Autoscale(scaling, pools, model_name(args, model_path), args.scale_interval)
        scaling_run = (scaler, credentials.auth(ADMIN) if credentials is not None else nats_auth(args))
    else:
        children += [
            Child(
                role,
                i,
                worker_argv(
                    args,
                    role,
                    model_path,
                    nats_url,
                    n,
                    device,
                    credentials,
                    cores,
                    turns,
                ),
            )
            for i, (role, n, device, cores) in enumerate(zip(roles, worker_threads, devices, own_cores, strict=True))
        ]
    children += [
        Child("api", i, api_argv(args, model_path, nats_url, api_ids[i], credentials, key_file))
        for i in range(1, args.api_processes)
    ]
    auth = credentials.auth(api_ids[0]) if credentials is not None else None
    config = api_config(args, nats_url, model_path, auth, api_id=api_ids[0])
    try:
        for child in children:
            if child.process is None:  # the store master is already up
                child.start()
        if scaling_run is not None:
            for role, pool in scaling_run[0].pools.items():
                pool.scale_to(scaling_run[0].rule.config.policy(role).min_replicas, {})
        return asyncio.run(_serve(args, config, children, broker, scaling_run))
    finally:
        # The workers first: at teardown they finish their KV tier writes into the store.
        stop_children([c for c in children if c.role != KV_STORE])
        for child in reversed([c for c in children if c.role == KV_STORE]):  # the server, then the master
            stop_children([child])
        if broker is not None:
            broker.stop()
        log.info("pdserve stopped")


async def _serve(
    args: argparse.Namespace,
    config: ApiConfig,
    children: list[Child],
    broker: Broker | None = None,
    scaling: tuple[Autoscale, NatsAuth | None] | None = None,
) -> int:
    """The API until SIGTERM/SIGINT, beside the tasks that keep the broker and the workers
    running (and the autoscaler): if one of those ends, the API stops and so does ``up``
    (status 70), loudly."""
    from pdserve.api.app import create_app

    setup_tracing("api")
    app = create_app(config, collectors=[scaling[0].metrics] if scaling else [])
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="on"))
    # With several API processes this one listens on the shared port like the others.
    sockets = [listen_socket(args.host, args.port, reuse_port=True)] if args.api_processes > 1 else None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_exit)
    failed: list[asyncio.Task[None]] = []

    def supervise(task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        log.critical("supervised task ended; stopping", extra={"task": task.get_name()}, exc_info=task.exception())
        failed.append(task)
        server.request_exit()

    supervised = [asyncio.create_task(_watch(children, broker), name="watch")]
    if scaling is not None:
        scaler, admin = scaling
        supervised.append(asyncio.create_task(scaler.run(config.nats_url, admin, config.broker), name="autoscale"))
    for task in supervised:
        task.add_done_callback(supervise)
    ready = asyncio.create_task(_announce(app, args, children))
    try:
        await server.serve(sockets=sockets)
    finally:
        for task in (*supervised, ready):
            task.cancel()
        for task in (*supervised, ready):
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return EXIT_FAILED if failed else 0


class _Server(uvicorn.Server):
    """uvicorn's server without its signal capture: uvicorn re-raises a captured SIGTERM
    after ``serve()`` returns, which would kill this process before it stops the workers
    and the broker. Here SIGTERM/SIGINT just ask the server to exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def request_exit(self) -> None:
        self.should_exit = True


async def _watch(children: list[Child], broker: Broker | None) -> None:
    """Restart the broker and the workers when they die, workers with a growing back-off;
    let retired workers drain and go."""
    while True:
        await asyncio.sleep(0.5)
        if broker is not None and not broker.is_alive():
            await _restart_broker(broker)
        tend(children)


async def _restart_broker(broker: Broker) -> None:
    """Start the dead broker again on its port and store, trying until it listens."""
    code = broker.server.process.returncode
    log.error("nats-server exited; restarting it over its store", extra={"code": code, "url": broker.url})
    for attempt in range(1, 61):
        try:
            # In this (the main) thread: the server dies with the thread that started it
            # (PR_SET_PDEATHSIG), and a pool thread may end before the ordered stop.
            broker.restart()
        except NatsServerError as exc:
            log.error("nats-server did not restart; trying again", extra={"attempt": attempt, "error": str(exc)})
            await asyncio.sleep(1.0)
            continue
        log.info("nats-server restarted", extra={"url": broker.url, "restarts": broker.restarts})
        return


async def _announce(app: object, args: argparse.Namespace, children: list[Child]) -> None:
    """Log one line when every worker has registered."""
    workers = [c for c in children if c.role not in ("api", KV_STORE)]
    # A co-located process registers a prefill and a decode worker.
    roles = [r for c in workers for r in (("prefill", "decode") if c.role == "colocated" else (c.role,))]
    want = {role: roles.count(role) for role in set(roles)}
    started = time.monotonic()
    while True:
        await asyncio.sleep(0.5)
        state = getattr(getattr(app, "state", None), "pd", None)
        if state is None:
            continue
        try:
            workers = await state.gateway.workers()
        except Exception:
            continue
        have = {role: sum(1 for w in workers if w.role == role) for role in want}
        if all(have[r] >= n for r, n in want.items()):
            host = "localhost" if args.host in ("0.0.0.0", "::") else args.host
            summary = ", ".join(f"{n} {r}" for r, n in want.items())
            if args.api_processes > 1:
                summary += f", {args.api_processes} API processes"
            log.info(f"pdserve is up at http://{host}:{args.port} ({summary}) after {time.monotonic() - started:.1f}s")
            return
