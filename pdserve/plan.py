"""``pdserve up``'s plan before it starts anything: which roles and how many, the KV
transfer backend on this host (and why), each worker's device, threads and cores, the
consumers' sizes. Plain functions of the flags (and the model's config), unit-tested."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from pdserve.configs import (
    SHM_DIR,
    UsageError,
    scaling_config,
)
from pdserve.cores import available, core_plan, format_cpus, pin
from pdserve.engine.config import EngineConfig
from pdserve.scaling import ScalingConfig
from pdserve.workers.transfer.base import backend_device_error

log = logging.getLogger("pdserve.up")


def plan_roles(args: argparse.Namespace) -> list[str]:
    if args.colocate and args.mode != "pd":
        raise UsageError("--colocate pairs prefill and decode workers: use --mode pd")
    if args.mode == "unified":
        counts = {"unified": args.unified_workers}
    elif args.colocate:
        if args.prefill_workers != args.decode_workers:
            raise UsageError(
                f"--colocate pairs each prefill worker with a decode worker: --prefill-workers {args.prefill_workers} "
                f"and --decode-workers {args.decode_workers} must be equal"
            )
        counts = {"colocated": args.prefill_workers}
    else:
        counts = {"prefill": args.prefill_workers, "decode": args.decode_workers}
    for role, n in counts.items():
        if n < 1:
            raise SystemExit(f"pdserve up: error: --{role}-workers must be at least 1")
    return [role for role, n in counts.items() for _ in range(n)]


def kv_bytes_per_token(
    model_path: Path | None, dtype: str, kv_cache_dtype: str = "auto", page_size: int = 16
) -> int | None:
    """What one token's KV takes in a worker's pool, from the model's config, rounded up (FP8 KV:
    a byte a value and a 4-byte scale per ``page_size`` tokens of a head); ``None`` when the
    config cannot be read."""
    import json

    try:
        config = json.loads((Path(model_path or "") / "config.json").read_text())
        config = config.get("text_config", config)
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads") or heads
        size = {"float32": 4}.get(dtype if dtype != "auto" else str(config.get("torch_dtype") or "float32"), 2)
        # engine.kv_pool.page_bytes's sum, without importing torch into `up`'s process
        per_block = page_size * int(head_dim) * size
        if kv_cache_dtype in ("fp8", "fp8_e4m3"):
            per_block = page_size * int(head_dim) + 4
        elif kv_cache_dtype == "bf16":
            per_block = page_size * int(head_dim) * 2
        return -(-int(config["num_hidden_layers"]) * 2 * int(kv_heads) * per_block // page_size)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def choose_backend(args: argparse.Namespace, shm_dir: str = SHM_DIR, model_path: Path | None = None) -> tuple[str, str]:
    """``up``'s KV transfer backend and why, when ``--disaggregation-transfer-backend`` is not
    given. With the embedded broker (no worker of another host can join), one rank per worker
    and no RDMA device named, KV moves without a port (nothing but loopback listens): ``ipc``
    (CUDA IPC) when every worker is on a GPU of this host, ``shm`` when every worker is on its
    CPU and ``shm_dir`` has room for the pools. Else ``mooncake``."""
    if args.disaggregation_transfer_backend:
        return args.disaggregation_transfer_backend, "given"
    if args.colocate:
        return "local", "--colocate: inside each process"
    if args.mode != "pd":
        return "mooncake", "unified workers move no KV"
    devices = [d.strip() for d in (args.worker_devices or args.device).split(",") if d.strip()]
    gpus = sum(1 for d in devices if not d.startswith("cpu"))
    reasons = [
        (bool(args.nats_url), "--nats-url: workers of other hosts may join"),
        (0 < gpus < len(devices), "CPU and GPU pools side by side"),
        (
            max(
                args.tensor_parallel_size, args.prefill_tensor_parallel_size or 1, args.decode_tensor_parallel_size or 1
            )
            > 1,
            "tensor-parallel workers read their shards over mooncake",
        ),
        (bool(args.disaggregation_ib_device), "--disaggregation-ib-device names RDMA"),
    ]
    for applies, why in reasons:
        if applies:
            return "mooncake", why
    if gpus:
        return "ipc", "GPUs of one host (CUDA IPC)"
    workers = args.prefill_workers + args.decode_workers if args.mode == "pd" else 0
    if args.autoscale:
        workers = args.max_prefill + args.max_decode
    per_pool = EngineConfig.cpu_kv_bytes
    per_token = kv_bytes_per_token(
        model_path, args.dtype, getattr(args, "kv_cache_dtype", "auto"), getattr(args, "page_size", 16)
    )
    if args.max_total_tokens is not None and per_token is not None:
        per_pool = (args.max_total_tokens + args.page_size) * per_token
    need = workers * per_pool
    try:
        free = os.statvfs(shm_dir)
    except OSError:
        return "mooncake", f"{shm_dir} is missing"
    if free.f_bavail * free.f_frsize < need:
        return "mooncake", f"{shm_dir} has {free.f_bavail * free.f_frsize >> 20} MiB free, the pools need {need >> 20}"
    return "shm", "one CPU host"


def plan_devices(args: argparse.Namespace, roles: list[str]) -> list[str]:
    """Each worker's device: ``--worker-devices`` in turn (again from the first when there
    are more workers than devices), else ``--device`` for all. Refuses a placement the
    transfer backend cannot serve (nccl: CUDA pools, prefill and decode on different GPUs)."""
    if args.worker_devices:
        given = [d.strip() for d in args.worker_devices.split(",") if d.strip()]
        devices = [given[i % len(given)] for i in range(len(roles))]
    else:
        devices = [args.device] * len(roles)
    backend = args.disaggregation_transfer_backend
    for role, device in zip(roles, devices, strict=True):
        wrong = backend_device_error(backend, device.split(":")[0]) if role in ("prefill", "decode") else None
        if wrong is not None:
            raise SystemExit(f"pdserve up: error: {role} worker on {device}: {wrong}")
    if backend == "nccl":
        shared = {d for r, d in zip(roles, devices, strict=True) if r == "prefill"} & {
            d for r, d in zip(roles, devices, strict=True) if r == "decode"
        }
        if shared:
            raise SystemExit(
                f"pdserve up: error: prefill and decode workers share {', '.join(sorted(shared))}: NCCL pairs two "
                "GPUs; give them different devices with --worker-devices (or use mooncake)"
            )
    return devices


def size_consumers(args: argparse.Namespace, roles: list[str]) -> None:
    """``max_ack_pending`` of each consumer = what its pool can hold in hand at once."""
    per_worker = args.max_running_requests
    if args.prefill_max_ack_pending is None:
        args.prefill_max_ack_pending = per_worker * sum(1 for r in roles if r in ("prefill", "unified", "colocated"))
    if args.decode_max_ack_pending is None:
        args.decode_max_ack_pending = per_worker * max(sum(1 for r in roles if r in ("decode", "colocated")), 1)


def plan_autoscale(args: argparse.Namespace) -> tuple[ScalingConfig, list[str]]:
    """``up --autoscale``: the rule's config and the workers to start with (each pool's
    minimum); the consumers are sized for the largest pools."""
    if args.mode != "pd":
        raise UsageError("--autoscale grows and shrinks the prefill and decode pools: use --mode pd")
    if args.colocate:
        raise UsageError("--autoscale grows each pool on its own; --colocate pairs them in fixed processes")
    if args.worker_devices:
        raise UsageError("--autoscale puts every worker on --device; --worker-devices is for fixed pools")
    config = scaling_config(args)
    return config, ["prefill"] * config.prefill.min_replicas + ["decode"] * config.decode.min_replicas


def role_threads(args: argparse.Namespace, roles: list[str], threads: int) -> list[int]:
    """Each worker's torch threads: ``--prefill-/--decode-num-threads``, else ``threads``."""
    return [getattr(args, f"{role}_num_threads", None) or threads for role in roles]


def plan_core_turns(args: argparse.Namespace) -> Path | None:
    """``--core-sharing``: the file whose lock the CPU workers of --mode pd take turns at
    (:mod:`pdserve.workers.core_share`), in the data directory; ``None`` for a split. Turns
    by default where they apply: CPU workers of fixed pools, none pinned or co-located."""
    chosen = getattr(args, "core_sharing", None)
    if chosen == "split":
        return None
    why_not = None
    if args.device != "cpu" or args.worker_devices:
        why_not = "for CPU workers (--device cpu)"
    elif args.mode != "pd" or args.colocate:
        why_not = "for the separate prefill and decode workers of --mode pd"
    elif args.pin_cores:
        why_not = "--pin-cores gives each worker cores of its own"
    elif args.autoscale:
        why_not = "for fixed pools (--autoscale's workers come and go)"
    if why_not is not None:
        if chosen == "turns":
            raise UsageError(f"--core-sharing turns: {why_not}")
        return None
    path = Path(args.data_dir) / "core-turns"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def plan_cores(args: argparse.Namespace, threads: list[int]) -> list[list[int]] | None:
    """``--pin-cores``: pin this process (the API, and what it starts but the workers: the
    broker, extra API processes) to the spare cores; returns each worker's own cores, as
    many as its ``threads``."""
    if not args.pin_cores:
        return None
    if args.autoscale:
        raise UsageError("--pin-cores: for fixed pools; --autoscale's pools change size")
    try:
        spare, own = core_plan(threads, available())
    except ValueError as exc:
        raise UsageError(f"--pin-cores: {exc}") from None
    pin(spare)
    log.info("cores pinned", extra={"api_and_broker": format_cpus(spare), "workers": [format_cpus(c) for c in own]})
    return own
