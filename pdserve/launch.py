"""The single processes that flags start (:mod:`pdserve.configs` makes their configs): one
worker, a co-located pair, a tensor-parallel follower, or the API."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

from pdserve.configs import UsageError, api_config, check_worker_flags, pin_worker, resolve_model, worker_config
from pdserve.telemetry import setup_tracing
from pdserve.workers.config import WorkerConfig

log = logging.getLogger("pdserve")


def exit_with_parent() -> None:
    """Linux: get SIGTERM when the supervising process dies, even by SIGKILL."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


# The exit status of a worker whose loop failed (see workers.lifecycle.WorkerCrashed).
EXIT_CRASHED = 70


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the ``rank``-th GPU from ``device``'s (``cuda`` is GPU 0);
    every rank of a CPU worker is on the CPU."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device
    return f"cuda:{int(index or 0) + rank}"


def check_tp_split(config: WorkerConfig, size: int) -> None:
    """Refuse (before any rank starts) a model whose heads or MLP do not split over ``size``,
    or ranks on GPUs this machine does not have."""
    import torch
    from transformers import AutoConfig

    from pdserve.engine.parallel import TPError, check_divisible

    device = config.engine.device
    if device.startswith("cuda"):
        last = rank_device(device, size - 1)
        if int(last.partition(":")[2]) >= torch.cuda.device_count():
            raise UsageError(
                f"--tensor-parallel-size {size} on --device {device} needs GPUs up to {last}; "
                f"this machine has {torch.cuda.device_count()}"
            )

    model_config = AutoConfig.from_pretrained(config.model_path, trust_remote_code=config.trust_remote_code)
    try:
        check_divisible(model_config.get_text_config(), size)
    except TPError as exc:
        raise UsageError(str(exc)) from None


def start_tensor_parallel(args: argparse.Namespace, role: str) -> tuple[Any, Any]:
    """``(group, followers)`` of a worker of ``--tensor-parallel-size`` > 1, ``(None,
    None)`` otherwise. Rank 0 starts the store and ranks 1.. (this command again, with
    ``--tp-rank`` and ``--tp-store``; each gets SIGTERM if rank 0 dies); a follower joins
    the store it was given. Every rank then joins the group."""
    size = args.tensor_parallel_size
    if size == 1:
        return None, None
    import subprocess
    import sys

    import torch

    from pdserve.engine.parallel import connect_store, join_group, start_store
    from pdserve.workers.tensor_parallel import Followers

    followers = None
    if args.tp_rank == 0:
        store, address = start_store("127.0.0.1")
        argv = [sys.executable, "-m", "pdserve", *sys.argv[1:], "--exit-with-parent", "--tp-store", address]
        processes = [subprocess.Popen([*argv, "--tp-rank", str(r)], stdin=subprocess.DEVNULL) for r in range(1, size)]
        followers = Followers(processes)
        log.info("tensor-parallel ranks started", extra={"size": size, "pids": [p.pid for p in processes]})
    else:
        store = connect_store(args.tp_store)
    device = torch.device(rank_device(args.device, args.tp_rank))
    try:
        group = join_group(args.tp_rank, size, store, device)
    except Exception:
        if followers is not None:
            for proc in followers.processes:
                proc.kill()
        raise
    return group, followers


def take_turns(path: str, engine: Any) -> Any:
    """``--core-turns``: each of the engine's steps runs holding ``path``'s lock."""
    from pdserve.workers.core_share import CoreTurns

    if engine.runner.device.type != "cpu":
        raise UsageError("--core-turns: for CPU workers")
    try:
        turns = CoreTurns(Path(path))
    except OSError as exc:
        raise UsageError(f"--core-turns {path}: cannot open the lock file ({exc.strerror})") from None
    engine.observer = turns
    log.info("taking turns at the cores", extra={"lock": path})
    return turns


def run_worker(args: argparse.Namespace, role: str) -> int:
    """``pdserve prefill|decode|unified``: load the model, serve until SIGTERM. Returns the
    exit status: 0 after a graceful stop, :data:`EXIT_CRASHED` after a failed loop."""
    if args.exit_with_parent:
        exit_with_parent()
    check_worker_flags(args, role)
    if args.cpus is not None:  # before the ranks and the engine's threads start: they inherit it
        pin_worker(args.cpus)
        log.info("worker pinned", extra={"role": role, "cpus": args.cpus})
    if args.disaggregation_bootstrap_port is not None:
        log.info(
            "--disaggregation-bootstrap-port is not needed by pdserve (handles travel over NATS); ignoring its value"
        )
    config = worker_config(args, role, resolve_model(args, weights=args.load_format != "dummy"))
    if args.tensor_parallel_size > 1:
        import dataclasses

        check_tp_split(config, args.tensor_parallel_size)
        engine_cfg = dataclasses.replace(config.engine, device=rank_device(args.device, args.tp_rank))
        if args.num_threads is None and engine_cfg.device == "cpu":  # the ranks share the cores
            engine_cfg = dataclasses.replace(
                engine_cfg, num_threads=max(1, (os.cpu_count() or 1) // args.tensor_parallel_size)
            )
        config = dataclasses.replace(config, engine=engine_cfg)
    tp, followers = start_tensor_parallel(args, role)
    if args.tp_rank > 0:
        return run_follower(config, tp)
    setup_tracing(role, config.worker_id)
    log.info("loading model", extra={"role": role, "path": str(config.model_path)})
    from pdserve.engine.loader import build_engine
    from pdserve.workers.decode import DecodeWorker
    from pdserve.workers.prefill import PrefillWorker
    from pdserve.workers.runtime import engine_thread_pool
    from pdserve.workers.unified import UnifiedWorker

    # Loaded in the thread that will run its steps: one OpenMP pool in the process (runtime.py).
    engine_thread = engine_thread_pool()
    engine = engine_thread.submit(
        build_engine,
        config.model_path,
        config.engine,
        config.dtype,
        config.trust_remote_code,
        config.load_format,
        tp=tp,
    ).result()
    turns = take_turns(args.core_turns, engine) if args.core_turns is not None else None
    cls = {"prefill": PrefillWorker, "decode": DecodeWorker, "unified": UnifiedWorker}[role]
    worker = cls(config, engine, engine_thread)
    if turns is not None:  # each step's wait: on the worker's /metrics and in its registry entry
        histogram = worker.metrics.core_turn_wait()

        def waited(seconds: float) -> None:
            histogram(seconds)
            engine.stats.turn_wait_seconds += seconds

        turns.observe = waited
    worker.followers = followers

    return _serve_process(args, role, worker, worker.serve)


def run_colocated(args: argparse.Namespace) -> int:
    """``pdserve colocated``: a prefill worker and a decode worker in this process, on one
    device, sharing the model's weights, KV handed over in place (:mod:`pdserve.workers.colocated`)."""
    if args.exit_with_parent:
        exit_with_parent()
    check_worker_flags(args, "colocated")
    if args.tensor_parallel_size > 1:
        raise UsageError("`pdserve colocated` runs one rank: --tensor-parallel-size must be 1")
    if args.cpus is not None:
        pin_worker(args.cpus)
    base = worker_config(args, "prefill", resolve_model(args, weights=args.load_format != "dummy"))
    from pdserve.workers.colocated import build_engines, role_configs, serve_together
    from pdserve.workers.decode import DecodeWorker
    from pdserve.workers.prefill import PrefillWorker
    from pdserve.workers.sm_share import PrefillShare

    prefill_cfg, decode_cfg = role_configs(base, args.worker_id or "")
    setup_tracing("colocated", prefill_cfg.worker_id)
    log.info("loading model", extra={"role": "colocated", "path": str(base.model_path)})
    try:
        prefill_engine, prefill_thread, decode_engine, decode_thread = build_engines(
            prefill_cfg,
            decode_cfg,
            args.prefill_sms if args.device.startswith("cuda") else 0,
            args.prefill_wait_target,
        )
    except ValueError as exc:  # --prefill-sms beyond this GPU's SMs, a setting the engine refuses
        raise UsageError(str(exc)) from None
    prefill = PrefillWorker(prefill_cfg, prefill_engine, prefill_thread)
    decode = DecodeWorker(decode_cfg, decode_engine, decode_thread)

    share = prefill_engine.observer if isinstance(prefill_engine.observer, PrefillShare) else None
    if share is not None:  # its steps per level, on prefill's /metrics
        share.count = prefill.metrics.sm_share_steps()

    async def serve() -> None:
        try:
            await serve_together([prefill, decode])
        finally:
            if share is not None:
                log.info("prefill's SM share", extra=share.summary())

    return _serve_process(args, "colocated", [prefill, decode], serve)


def _serve_process(args: argparse.Namespace, role: str, health_of: Any, serve: Callable[[], Awaitable[None]]) -> int:
    """Run ``serve`` (with ``--port``: the health and metrics of ``health_of``, one worker or a
    co-located process's two, beside it) until it returns; the exit status: 0, or
    :data:`EXIT_CRASHED` after a failed loop."""
    import asyncio

    from pdserve.workers.lifecycle import WorkerCrashed

    async def main() -> None:
        health = None
        if args.port is not None:
            from pdserve.health import serve_health

            health = await serve_health(health_of, args.host, args.port)
        try:
            await serve()
        finally:
            if health is not None:
                health.close()

    from pdserve.engine.loader import freeze_heap

    frozen = freeze_heap()  # the model and engine built: out of the collector's full walks
    log.debug("heap frozen", extra={"role": role, "objects": frozen})
    try:
        asyncio.run(main())
    except WorkerCrashed as exc:
        log.error("worker exits after a failure", extra={"role": role, "failure": str(exc)})
        _exit_soon(EXIT_CRASHED)
        return EXIT_CRASHED
    return 0


def run_follower(config: WorkerConfig, tp: Any) -> int:
    """Rank 1.. of a tensor-parallel worker: its shard of the model, then rank 0's steps
    until rank 0 says stop (0) or is gone (1, logged)."""
    from pdserve.engine.loader import quiet_transformers
    from pdserve.engine.model_runner import ModelRunner, ModelSpec
    from pdserve.workers.tensor_parallel import serve_follower

    quiet_transformers()
    spec = ModelSpec(config.model_path, config.dtype, config.trust_remote_code, config.load_format)
    runner = ModelRunner(spec, config.engine, tp=tp)
    try:
        serve_follower(config, runner)
    except RuntimeError:
        # rank 0 is gone: end now, before the process group's threads are torn down under a
        # live interpreter (which can abort the exit, status -6, where 1 is meant)
        _exit_now(1)
    finally:
        tp.close()
    return 0


def _exit_now(status: int) -> NoReturn:
    """End the process with ``status`` at once, its logs and output flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _exit_soon(status: int, seconds: float = 10.0) -> None:
    """End the process with ``status`` after ``seconds`` even if a thread (a forward pass, a
    transfer) would hold up the interpreter's exit."""
    import threading

    timer = threading.Timer(seconds, os._exit, (status,))
    timer.daemon = True
    timer.start()


def run_api(args: argparse.Namespace) -> None:
    """``pdserve api``: the HTTP API under uvicorn (on a port shared with other API
    processes with ``--reuse-port``)."""
    import uvicorn

    from pdserve.api.app import create_app

    if args.exit_with_parent:
        exit_with_parent()
    config = api_config(args, args.nats_url, resolve_model(args, weights=False))
    setup_tracing("api")
    app = create_app(config)
    if not args.reuse_port:
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning")
        return
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    server.run(sockets=[listen_socket(config.host, config.port, reuse_port=True)])


def listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening TCP socket; with ``reuse_port`` other processes may listen on the same
    port and the kernel spreads new connections among them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
