"""From parsed flags to configs, and the single processes they start: one worker, or
the API. The one place where flag values become :class:`EngineConfig`,
:class:`BrokerConfig`, :class:`WorkerConfig` and :class:`ApiConfig`."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve import settings
from pdserve.api.config import ApiConfig
from pdserve.api.model_info import sampling_defaults
from pdserve.api.placement import PlacementConfig
from pdserve.broker.auth import NatsAuth, read_password
from pdserve.broker.streams import BrokerConfig
from pdserve.engine.config import EngineConfig, KVTierConfig
from pdserve.scaling import RolePolicy, ScalingConfig
from pdserve.telemetry import setup_tracing
from pdserve.workers.config import WorkerConfig

log = logging.getLogger("pdserve")


class UsageError(Exception):
    """A flag value pdserve cannot honour: the command stops with this message (exit 2)."""


# ---- configs ------------------------------------------------------------------------
def resolve_model(args: argparse.Namespace, weights: bool = True) -> Path:
    """``--model-path`` as a local directory: itself, a GGUF file's dequantized copy in the
    data dir (made once, :mod:`pdserve.gguf`), or a hub id's snapshot in the Hugging Face
    cache (fetched when missing, only configs and tokenizer unless ``weights``; see
    :mod:`pdserve.checkpoint`); without it (or ``builtin:smollm2``) SmolLM2-135M-Instruct,
    fetched and converted on first use; ``builtin:tiny`` the random-weight test model."""
    from pdserve import default_model

    model = args.model_path or default_model.BUILTIN_PREFIX + default_model.BUILTINS[0]
    if model.startswith(default_model.BUILTIN_PREFIX):
        return builtin_model(args, model.removeprefix(default_model.BUILTIN_PREFIX))
    from pdserve.gguf import GGUFError, ensure_converted, gguf_path

    try:
        gguf = gguf_path(model, getattr(args, "gguf_file", None))
        if gguf is not None:
            return ensure_converted(gguf, Path(args.data_dir), args.dtype, progress=lambda line: log.info(line))
    except GGUFError as exc:
        raise UsageError(f"--model-path {exc}") from None
    from pdserve.checkpoint import CheckpointError, resolve

    try:
        return resolve(model, args.revision, weights)
    except CheckpointError as exc:
        raise UsageError(f"--model-path {exc}") from None


def builtin_model(args: argparse.Namespace, name: str) -> Path:
    """``builtin:NAME``'s directory in the data dir, made on first use."""
    from pdserve import default_model

    progress = lambda line: log.info(line)  # noqa: E731
    if name == "tiny":
        from pdserve.engine.tiny_model import ensure_default_model

        path = ensure_default_model(Path(args.data_dir), progress=progress)
        log.warning(
            "serving the random-weight test model: its output is not meaningful text", extra={"path": str(path)}
        )
        return path
    if name != "smollm2":
        choices = ", ".join(default_model.BUILTIN_PREFIX + b for b in default_model.BUILTINS)
        raise UsageError(f"--model-path {default_model.BUILTIN_PREFIX}{name}: no such built-in model ({choices})")
    try:
        return default_model.ensure_default_model(Path(args.data_dir), progress=progress)
    except default_model.FetchError as exc:
        raise UsageError(f"the default model ({default_model.NAME}): {exc}") from None


def model_name(args: argparse.Namespace, model_path: Path) -> str:
    """``--served-model-name``, else the hub id or the directory's name."""
    from pdserve.checkpoint import served_name

    return str(args.served_model_name or served_name(model_path))


def check_worker_flags(args: argparse.Namespace, role: str) -> None:
    """Refuse what a worker cannot honour, before anything loads."""
    size = args.tensor_parallel_size
    if size < 1:
        raise UsageError(f"--tensor-parallel-size {size}: must be at least 1")
    if size > 1 and role != "unified" and args.disaggregation_transfer_backend != "mooncake":
        raise UsageError(
            f"--tensor-parallel-size {size} with --disaggregation-transfer-backend "
            f"{args.disaggregation_transfer_backend}: a tensor-parallel worker moves KV over mooncake (each rank "
            "reads its own KV heads); the nccl and gloo links pair workers of one rank each"
        )
    tiers = [
        f
        for f, on in (
            ("--kv-host-bytes", args.kv_host_bytes),
            ("--kv-disk-dir", args.kv_disk_dir),
            ("--kv-store-master", args.kv_store_master),
        )
        if on
    ]
    if size > 1 and tiers:
        raise UsageError(
            f"--tensor-parallel-size {size} with {', '.join(tiers)}: the KV tiers copy a whole page pool, and a "
            "tensor-parallel worker's pool is split over its ranks; use the tiers with one rank per worker"
        )
    if not 0 <= args.tp_rank < size:
        raise UsageError(f"--tp-rank {args.tp_rank}: outside --tensor-parallel-size {size}")
    mode = args.disaggregation_mode
    if mode is not None and not (mode == role or (mode == "null" and role == "unified")):
        raise UsageError(f"--disaggregation-mode {mode} does not match `pdserve {role}`")
    from pdserve.workers.transfer import available_backends
    from pdserve.workers.transfer.base import backend_device_error

    backend = args.disaggregation_transfer_backend
    if role == "colocated" and backend not in ("local", "mooncake"):  # mooncake: the flag's default
        raise UsageError(
            f"--disaggregation-transfer-backend {backend}: `pdserve colocated` hands KV over inside the process "
            "(the local backend)"
        )
    if role != "colocated" and backend == "local":
        raise UsageError(
            "--disaggregation-transfer-backend local: for the two workers of one `pdserve colocated` process; "
            "separate prefill and decode processes move KV over mooncake, nccl or gloo"
        )
    if role == "colocated":
        backend = "local"
    if backend not in available_backends():
        raise UsageError(f"--disaggregation-transfer-backend {backend}: available: {', '.join(available_backends())}")
    wrong_device = backend_device_error(backend, args.device.split(":")[0])
    if role != "unified" and wrong_device is not None:
        raise UsageError(f"--disaggregation-transfer-backend {backend} with --device {args.device}: {wrong_device}")
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        raise UsageError("--page-size must be a power of two")
    if args.cpus is not None:
        from pdserve.cores import parse_cpus

        try:
            parse_cpus(args.cpus)
        except ValueError as exc:
            raise UsageError(f"--cpus: {exc}") from None


def pin_worker(text: str) -> None:
    """``--cpus``: every thread of this process onto those cores, all of them or an error
    (not the part of them a cpuset allows). The process may start on fewer: under ``up
    --pin-cores`` it inherits the API's."""
    from pdserve.cores import available, parse_cpus, pin

    cores = parse_cpus(text)
    try:
        pin(cores)
    except OSError as exc:
        raise UsageError(f"--cpus {text}: cannot run there: {exc.strerror}") from None
    missing = sorted(set(cores) - set(available()))
    if missing:
        raise UsageError(f"--cpus {text}: cores {missing} are not this process's to run on (a cpuset?)")


@dataclass(frozen=True)
class Transport:
    """Mooncake's transport as it will really be used: ``protocol`` and ``ib_device`` for
    the engine; ``fallback`` says why rdma was asked for and tcp is used (allowed)."""

    protocol: str
    ib_device: str
    fallback: str = ""


def choose_transport(
    ib_device: str, allow_tcp_fallback: bool, backend: str = "mooncake", root: Path = Path("/")
) -> Transport:
    """rdma on ``ib_device`` when every device named has an active port and its verbs
    device here; tcp when none is named. Asked for rdma where it cannot work, refuse
    (:class:`UsageError`) unless ``allow_tcp_fallback``: never a silent fallback."""
    if not ib_device or backend != "mooncake":
        return Transport("tcp", "")
    from pdserve.workers.transfer.rdma import rdma_devices, rdma_problem

    problem = rdma_problem(ib_device, rdma_devices(root))
    if problem is None:
        return Transport("rdma", ib_device)
    if not allow_tcp_fallback:
        raise UsageError(
            f"--disaggregation-ib-device {ib_device}: RDMA cannot work here: {problem}. Fix the device (or its "
            "mount into the container), or pass --allow-tcp-fallback to move KV over tcp instead (`pdserve doctor` "
            "lists what it finds)"
        )
    return Transport("tcp", "", fallback=problem)


def tier_config(args: argparse.Namespace) -> KVTierConfig:
    """The KV tiers below the prefix cache (``--kv-*``)."""
    try:
        return KVTierConfig(
            host_bytes=args.kv_host_bytes,
            disk_dir=args.kv_disk_dir or "",
            disk_bytes=args.kv_disk_bytes,
            store_master=args.kv_store_master or "",
            store_metadata=args.kv_store_metadata or "",
            store_host=args.transfer_host or args.host,
            store_bytes=args.kv_store_bytes,
            group_pages=args.kv_group_pages,
        )
    except ValueError as exc:
        raise UsageError(f"--kv-*: {exc}") from None


SHM_DIR = "/dev/shm"  # the shm backend's pools


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        max_num_seqs=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_prefix_cache=not args.disable_prefix_cache,
        device=args.device,
        num_threads=args.num_threads,
        max_model_len=args.context_length,
        model_impl=args.model_impl,
        cuda_graph_max_batch=0 if args.disable_cuda_graph else args.cuda_graph_max_bs,
        overlap_schedule=not args.disable_overlap_schedule,
        kv_tiers=tier_config(args),
        grammar_threads=args.grammar_threads,
        kv_shared_dir=SHM_DIR if getattr(args, "disaggregation_transfer_backend", "") == "shm" else "",
    )


def broker_config(args: argparse.Namespace) -> BrokerConfig:
    try:
        return BrokerConfig(
            prefill_max_ack_pending=args.prefill_max_ack_pending,
            decode_max_ack_pending=args.decode_max_ack_pending,
            replicas=args.js_replicas,
        )
    except ValueError as exc:
        raise UsageError(f"--js-replicas/--*-max-ack-pending: {exc}") from None


def scaling_config(args: argparse.Namespace) -> ScalingConfig:
    """The autoscaling rule's limits and targets (``--min-prefill`` ... ``--scale-*``)."""
    decode_lag = args.decode_lag_threshold or max(1, args.max_running_requests * 3 // 4)
    pools = {
        "prefill": dict(
            min_replicas=args.min_prefill,
            max_replicas=args.max_prefill,
            lag_per_replica=args.prefill_lag_threshold,
            backlog_seconds=args.prefill_backlog_seconds,
        ),
        "decode": dict(min_replicas=args.min_decode, max_replicas=args.max_decode, lag_per_replica=decode_lag),
    }
    policies = {}
    for role, values in pools.items():
        try:
            policies[role] = RolePolicy(**values)
        except ValueError as exc:
            raise UsageError(f"--min-{role}/--max-{role}/--{role}-*: {exc}") from None
    try:
        return ScalingConfig(
            prefill=policies["prefill"],
            decode=policies["decode"],
            scale_up_cooldown=args.scale_up_cooldown,
            scale_down_window=args.scale_down_window,
        )
    except ValueError as exc:
        raise UsageError(f"--scale-*: {exc}") from None


def nats_auth(args: argparse.Namespace) -> NatsAuth:
    """The NATS credentials the flags name: the password from ``--nats-password-file`` or
    ``PDSERVE_NATS_PASSWORD``, read now."""
    password = None
    if args.nats_user is not None:
        try:
            password = read_password(args.nats_password_file) if args.nats_password_file else settings.nats_password()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if password is None:
            raise UsageError("--nats-user needs --nats-password-file or $PDSERVE_NATS_PASSWORD")
    elif args.nats_password_file is not None:
        raise UsageError("--nats-password-file needs --nats-user")
    try:
        return NatsAuth(
            user=args.nats_user,
            password=password,
            creds_file=args.nats_creds,
            tls_ca=args.nats_tls_ca,
            tls_cert=args.nats_tls_cert,
            tls_key=args.nats_tls_key,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Every API key given: ``--api-key``, the lines of ``--api-key-file`` (blank lines
    and ``#`` comments skipped) and ``PDSERVE_API_KEYS``."""
    keys = [*(args.api_key or ()), *settings.api_keys()]
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as exc:
            raise UsageError(f"--api-key-file {args.api_key_file}: {exc.strerror}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return tuple(dict.fromkeys(keys))


def worker_config(args: argparse.Namespace, role: str, model_path: Path) -> WorkerConfig:
    transport = choose_transport(
        args.disaggregation_ib_device, args.allow_tcp_fallback, args.disaggregation_transfer_backend
    )
    return WorkerConfig(
        role=role,
        model_path=model_path,
        model_name=model_name(args, model_path),
        nats_url=args.nats_url,
        nats_auth=nats_auth(args),
        engine=engine_config(args),
        broker=broker_config(args),
        worker_id=args.worker_id,
        host=args.host,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        load_format=args.load_format,
        transfer_backend=args.disaggregation_transfer_backend,
        transfer_protocol=transport.protocol,
        ib_device=transport.ib_device,
        transfer_host=args.transfer_host or settings.default_transfer_host(),
        transport_fallback=transport.fallback,
        transport_fallback_device=args.disaggregation_ib_device if transport.fallback else "",
        kv_hold_seconds=args.kv_hold_seconds,
        heartbeat_seconds=args.heartbeat_seconds,
        prefix_placement=args.prefix_aware_placement,
    )


API_ONLY = (
    "default_max_tokens",
    "request_timeout",
    "stall_timeout",
    "max_migrations",
    "max_body_bytes",
    "max_prompt_tokens",
    "max_output_tokens",
    "max_batch_prompts",
    "max_concurrent_requests",
    "enable_flush_cache",
    "generation_config",
    "api_id",
)


def check_generation_config(args: argparse.Namespace, model_path: Path) -> None:
    """Refuse a generation config the API could not read now, rather than in its start-up."""
    try:
        sampling_defaults(model_path, getattr(args, "generation_config", ApiConfig.generation_config))
    except ValueError as exc:
        raise UsageError(f"--generation-config: {exc}") from None


def placement_config(args: argparse.Namespace) -> PlacementConfig:
    """Where requests go (``--conditional-disagg`` and its limits)."""
    return PlacementConfig(
        conditional_disagg=args.conditional_disagg,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        local_prefill_max_tokens_busy=args.local_prefill_max_tokens_busy,
        prefix_aware=args.prefix_aware_placement,
        prefix_min_tokens=args.prefix_min_tokens,
        placed_deadline=args.placement_deadline,
    )


def api_config(
    args: argparse.Namespace, nats_url: str, model_path: Path, auth: NatsAuth | None = None, **overrides: Any
) -> ApiConfig:
    """The API's config from ``pdserve api`` or ``pdserve up`` flags (``up`` leaves the
    API-only ones at their defaults); ``auth`` replaces the NATS credentials the flags
    name, ``overrides`` any field."""
    api_only: dict[str, Any] = {name: getattr(args, name) for name in API_ONLY if hasattr(args, name)}
    check_generation_config(args, model_path)
    return ApiConfig(
        nats_url=nats_url,
        nats_auth=auth if auth is not None else nats_auth(args),
        api_keys=api_keys(args),
        model_path=model_path,
        model_name=model_name(args, model_path),
        host=args.host,
        port=args.port,
        trust_remote_code=args.trust_remote_code,
        context_length=args.context_length,
        broker=broker_config(args),
        placement=placement_config(args),
        **{**api_only, **overrides},
    )


# ---- processes ----------------------------------------------------------------------
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
    cls = {"prefill": PrefillWorker, "decode": DecodeWorker, "unified": UnifiedWorker}[role]
    worker = cls(config, engine, engine_thread)
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

    prefill_cfg, decode_cfg = role_configs(base, args.worker_id or "")
    setup_tracing("colocated", prefill_cfg.worker_id)
    log.info("loading model", extra={"role": "colocated", "path": str(base.model_path)})
    try:
        prefill_engine, prefill_thread, decode_engine, decode_thread = build_engines(
            prefill_cfg, decode_cfg, args.prefill_sms if args.device.startswith("cuda") else 0
        )
    except ValueError as exc:  # --prefill-sms beyond this GPU's SMs, a setting the engine refuses
        raise UsageError(str(exc)) from None
    prefill = PrefillWorker(prefill_cfg, prefill_engine, prefill_thread)
    decode = DecodeWorker(decode_cfg, decode_engine, decode_thread)

    return _serve_process(args, "colocated", [prefill, decode], lambda: serve_together([prefill, decode]))


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
        return 1
    finally:
        tp.close()
    return 0


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
