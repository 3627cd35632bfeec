"""From parsed flags to configs: the one place where flag values become
:class:`EngineConfig`, :class:`BrokerConfig`, :class:`WorkerConfig` and :class:`ApiConfig`
(and the checks that refuse a combination pdserve cannot honour, :class:`UsageError`)."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve import settings
from pdserve.api.config import ApiConfig
from pdserve.api.model_info import sampling_defaults
from pdserve.api.placement import PlacementConfig
from pdserve.api.reasoning import resolve_reasoning
from pdserve.api.tools import resolve_format, template_in
from pdserve.broker.auth import NatsAuth, read_password
from pdserve.broker.streams import BrokerConfig
from pdserve.engine.config import EngineConfig, KVTierConfig
from pdserve.scaling import RolePolicy, ScalingConfig
from pdserve.workers.config import WorkerConfig

log = logging.getLogger("pdserve")


class UsageError(Exception):
    """A flag value pdserve cannot honour: the command stops with this message (exit 2)."""


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
    if getattr(args, "quantization", None) == "fp8":
        if args.model_impl == "transformers":
            raise UsageError(
                "--quantization fp8 with --model-impl transformers: FP8 weights run on pdserve's own forward pass; "
                "the stock transformers code has no FP8 matmuls"
            )
        if args.device.split(":")[0] != "cuda":
            raise UsageError(
                f"--quantization fp8 with --device {args.device}: FP8 weights run on pdserve's GPU pass (compute "
                "capability 8.9 or above); its CPU pass has no FP8 matmuls"
            )
    if kv_cache_dtype(args) == "bf16" and args.dtype in ("float32", "float16", "half"):
        raise UsageError(
            f"--kv-cache-dtype bf16 with --dtype {args.dtype}: the KV pool is in the model's dtype or FP8; "
            "use --dtype bfloat16, or --kv-cache-dtype auto or fp8_e4m3"
        )
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
            load=args.kv_tier_load,
            prefetch_bytes=args.kv_tier_prefetch_bytes,
            overlap=args.kv_tier_overlap,
            cut_runs=args.kv_tier_cut_runs,
        )
    except ValueError as exc:
        raise UsageError(f"--kv-*: {exc}") from None


SHM_DIR = "/dev/shm"  # the shm backend's pools


def speculative_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``speculative_*`` fields of the engine's config: the ``--speculative-*`` flags, or
    vLLM's ``--speculative-config`` JSON over them."""
    out: dict[str, Any] = {
        "speculative_algorithm": getattr(args, "speculative_algorithm", None) or "",
        "speculative_num_draft_tokens": getattr(args, "speculative_num_draft_tokens", 4),
        "speculative_ngram_min": getattr(args, "speculative_ngram_min", 1),
        "speculative_ngram_max": getattr(args, "speculative_ngram_max", 4),
        "speculative_cost_ratio": getattr(args, "speculative_cost_ratio", None),
    }
    raw = getattr(args, "speculative_config", None)
    if not raw:
        return out
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--speculative-config: not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise UsageError('--speculative-config: a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4}')
    keys = {
        "method": "speculative_algorithm",
        "num_speculative_tokens": "speculative_num_draft_tokens",
        "prompt_lookup_min": "speculative_ngram_min",
        "prompt_lookup_max": "speculative_ngram_max",
    }
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise UsageError(f"--speculative-config: pdserve knows {sorted(keys)}, not {unknown}")
    if spec.get("method", "ngram") != "ngram":
        raise UsageError(f"--speculative-config: method {spec['method']!r}: only ngram is served")
    out.update({keys[k]: v for k, v in spec.items()})
    out["speculative_algorithm"] = "ngram"
    return out


def kv_cache_dtype(args: argparse.Namespace) -> str:
    """``--kv-cache-dtype``, its alias ``fp8`` spelled ``fp8_e4m3`` (vLLM's and SGLang's meaning)."""
    value: str = getattr(args, "kv_cache_dtype", "auto")
    return "fp8_e4m3" if value == "fp8" else value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    try:
        speculative = speculative_settings(args)
        EngineConfig(**speculative)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--speculative-*: {exc}") from None
    return EngineConfig(
        **speculative,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        max_num_seqs=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_prefix_cache=not args.disable_prefix_cache,
        device=args.device,
        num_threads=args.num_threads,
        max_model_len=args.context_length,
        model_impl=args.model_impl,
        cpu_attention=args.cpu_attention,
        quantization=args.quantization,
        kv_cache_dtype=kv_cache_dtype(args),
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
        prefix_placement=args.prefix_aware_placement != "off",
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
    "tool_call_parser",
    "reasoning_parser",
    "api_id",
)


def check_generation_config(args: argparse.Namespace, model_path: Path) -> None:
    """Refuse a generation config the API could not read now, rather than in its start-up;
    likewise a tool-call or reasoning parser the model's chat template cannot serve."""
    try:
        sampling_defaults(model_path, getattr(args, "generation_config", ApiConfig.generation_config))
    except ValueError as exc:
        raise UsageError(f"--generation-config: {exc}") from None
    if not (Path(model_path) / "config.json").exists():
        return  # not a model directory yet (a dummy load): the API checks at its start
    template = template_in(model_path)
    try:
        resolve_format(template, getattr(args, "tool_call_parser", ApiConfig.tool_call_parser))
        resolve_reasoning(template, getattr(args, "reasoning_parser", ApiConfig.reasoning_parser))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def placement_config(args: argparse.Namespace) -> PlacementConfig:
    """Where requests go (``--conditional-disagg`` and its limits)."""
    return PlacementConfig(
        conditional_disagg=args.conditional_disagg,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        local_prefill_max_tokens_busy=args.local_prefill_max_tokens_busy,
        prefix_aware=args.prefix_aware_placement != "off",
        prefix_min_workers=1 if args.prefix_aware_placement == "on" else PlacementConfig.prefix_min_workers,
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
        model_aliases=tuple(getattr(args, "served_model_alias", None) or ()),
        host=args.host,
        port=args.port,
        trust_remote_code=args.trust_remote_code,
        context_length=args.context_length,
        broker=broker_config(args),
        placement=placement_config(args),
        **{**api_only, **overrides},
    )
