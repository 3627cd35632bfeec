"""The ``pdserve`` command: ``up``, ``api``, ``prefill``, ``decode``, ``unified``.

Worker commands take the SGLang flags users already type (``--model-path``,
``--disaggregation-mode`` ...); a value pdserve cannot honour stops it at start with a
clear message instead of being ignored.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve import settings

if TYPE_CHECKING:
    from pdserve.api.config import ApiConfig
    from pdserve.broker.streams import BrokerConfig

log = logging.getLogger("pdserve")


class UsageError(Exception):
    pass


# ---- flags -------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        default=settings.default_data_dir(),
        help="where the default model and the embedded broker's store live (default: %(default)s)",
    )
    p.add_argument(
        "--log-level",
        default=settings.default_log_level(),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
    )


def _broker(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("broker")
    g.add_argument(
        "--prefill-max-ack-pending",
        type=int,
        default=256,
        help="requests the prefill (and unified) pool may hold unacked: its total capacity (default: %(default)s)",
    )
    g.add_argument(
        "--decode-max-ack-pending",
        type=int,
        default=256,
        help="KV-ready events the decode pool may hold unacked (default: %(default)s)",
    )


def broker_config(args: argparse.Namespace) -> BrokerConfig:
    from pdserve.broker.streams import BrokerConfig

    return BrokerConfig(
        prefill_max_ack_pending=args.prefill_max_ack_pending, decode_max_ack_pending=args.decode_max_ack_pending
    )


def _model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model-path",
        type=Path,
        help="local Hugging Face model directory (default: a small random model created in the data dir)",
    )
    g.add_argument("--served-model-name", help="name clients use (default: the directory name)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "half", "bfloat16"])
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--context-length", type=int, help="override the model's context length")


def _engine(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    g.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights from the model's config"
    )
    g.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (default: from memory)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--chunked-prefill-size", type=int, default=2048)
    g.add_argument("--max-running-requests", type=int, default=128, help="largest running batch")
    g.add_argument("--disable-prefix-cache", action="store_true")
    g.add_argument("--num-threads", type=int, help="torch CPU threads (default: cores / workers under `up`)")
    g.add_argument("--kv-hold-seconds", type=float, default=30.0, help="how long prefill keeps unclaimed KV")
    g.add_argument("--heartbeat-seconds", type=float, default=2.0, help="worker registry refresh interval")


def _sglang(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SGLang-compatible flags")
    g.add_argument("--host", default="127.0.0.1", help="address of this worker's transfer endpoint and health port")
    g.add_argument("--port", type=int, help="serve GET /health on this port")
    g.add_argument("--tensor-parallel-size", "--tp-size", type=int, default=1)
    g.add_argument("--disaggregation-mode", choices=["prefill", "decode", "null"])
    g.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        help="accepted for SGLang compatibility; pdserve needs no bootstrap server (handles travel over NATS)",
    )
    g.add_argument("--disaggregation-transfer-backend", default="mooncake")
    g.add_argument(
        "--disaggregation-ib-device", default="", help="RDMA device (e.g. mlx5_2): Mooncake uses rdma instead of tcp"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode-disaggregated LLM serving over NATS JetStream."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run everything: broker, workers and the HTTP API")
    _common(up)
    _model(up)
    _engine(up)
    up.add_argument("--host", default="0.0.0.0", help="HTTP bind address (default: %(default)s)")
    up.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    up.add_argument("--mode", choices=["pd", "unified"], default="pd")
    up.add_argument("--prefill-workers", type=int, default=1)
    up.add_argument("--decode-workers", type=int, default=1)
    up.add_argument("--unified-workers", type=int, default=1, help="workers in unified mode")
    up.add_argument("--nats-url", help="use this NATS server instead of starting one")
    up.add_argument("--transfer-host", default="127.0.0.1", help="address workers' transfer engines listen on")
    up.add_argument("--disaggregation-ib-device", default="")
    up.add_argument(
        "--prefill-max-ack-pending", type=int, help="default: workers on the request queue x --max-running-requests"
    )
    up.add_argument("--decode-max-ack-pending", type=int, help="default: decode workers x --max-running-requests")

    api = sub.add_parser("api", help="run the HTTP API only")
    _common(api)
    _model(api)
    api.add_argument("--host", default="0.0.0.0")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--nats-url", default=settings.default_nats_url())
    api.add_argument("--default-max-tokens", type=int, default=1024)
    api.add_argument("--request-timeout", type=float, default=600.0)
    _broker(api)

    for role in ("prefill", "decode", "unified"):
        w = sub.add_parser(role, help=f"run one {role} worker")
        _common(w)
        _model(w)
        _engine(w)
        _sglang(w)
        _broker(w)
        w.add_argument("--nats-url", default=settings.default_nats_url())
        w.add_argument("--worker-id", default="")
        w.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)

    from pdserve.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


# ---- commands ----------------------------------------------------------------------
def resolve_model(args: argparse.Namespace) -> Path:
    if args.model_path is not None:
        path = Path(args.model_path)
        if not (path / "config.json").exists():
            raise UsageError(
                f"--model-path {path}: no config.json there (a local Hugging Face model directory is needed)"
            )
        return path
    from pdserve.engine.tiny_model import ensure_default_model

    path = ensure_default_model(Path(args.data_dir), progress=lambda line: log.info(line))
    log.warning(
        "serving the built-in random-weight model: its output is not meaningful text", extra={"path": str(path)}
    )
    return path


def check_worker_flags(args: argparse.Namespace, role: str) -> None:
    if args.tensor_parallel_size != 1:
        raise UsageError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: pdserve runs one device per worker for now; use 1"
        )
    mode = args.disaggregation_mode
    if mode is not None and not (mode == role or (mode == "null" and role == "unified")):
        raise UsageError(f"--disaggregation-mode {mode} does not match `pdserve {role}`")
    from pdserve.workers.transfer import available_backends

    if args.disaggregation_transfer_backend not in available_backends():
        raise UsageError(
            f"--disaggregation-transfer-backend {args.disaggregation_transfer_backend}: available: {', '.join(available_backends())}"
        )
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        raise UsageError("--page-size must be a power of two")


def engine_config(args: argparse.Namespace) -> object:
    from pdserve.engine.config import EngineConfig

    return EngineConfig(
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        max_num_seqs=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_prefix_cache=not args.disable_prefix_cache,
        device=args.device,
        num_threads=args.num_threads,
        max_model_len=args.context_length,
    )


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


def run_worker(args: argparse.Namespace, role: str) -> None:
    import asyncio

    if args.exit_with_parent:
        exit_with_parent()

    from pdserve.engine.loader import build_engine
    from pdserve.workers.config import WorkerConfig

    check_worker_flags(args, role)
    if args.disaggregation_bootstrap_port is not None:
        log.info(
            "--disaggregation-bootstrap-port is not needed by pdserve (handles travel over NATS); ignoring its value"
        )
    model_path = resolve_model(args)
    econf = engine_config(args)
    config = WorkerConfig(
        role=role,
        model_path=model_path,
        model_name=args.served_model_name or model_path.name,
        nats_url=args.nats_url,
        engine=econf,  # type: ignore[arg-type]
        worker_id=args.worker_id,
        host=args.host,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        load_format=args.load_format,
        transfer_backend=args.disaggregation_transfer_backend,
        transfer_protocol="rdma" if args.disaggregation_ib_device else "tcp",
        ib_device=args.disaggregation_ib_device,
        kv_hold_seconds=args.kv_hold_seconds,
        heartbeat_seconds=args.heartbeat_seconds,
        broker=broker_config(args),
    )
    log.info("loading model", extra={"role": role, "path": str(model_path)})
    engine = build_engine(model_path, config.engine, args.dtype, args.trust_remote_code, args.load_format)
    from pdserve.workers.decode import DecodeWorker
    from pdserve.workers.prefill import PrefillWorker
    from pdserve.workers.unified import UnifiedWorker

    cls = {"prefill": PrefillWorker, "decode": DecodeWorker, "unified": UnifiedWorker}[role]
    worker = cls(config, engine)

    async def main() -> None:
        health = None
        if args.port is not None:
            from pdserve.health import serve_health

            health = await serve_health(worker, args.host, args.port)
        try:
            await worker.serve()
        finally:
            if health is not None:
                health.close()

    asyncio.run(main())


def run_api(args: argparse.Namespace) -> None:
    import uvicorn

    from pdserve.api.app import create_app

    config = api_config(args, args.nats_url, resolve_model(args))
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning")


def api_config(args: argparse.Namespace, nats_url: str, model_path: Path) -> ApiConfig:
    from pdserve.api.config import ApiConfig

    return ApiConfig(
        nats_url=nats_url,
        model_path=model_path,
        model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        default_max_tokens=getattr(args, "default_max_tokens", 1024),
        request_timeout=getattr(args, "request_timeout", 600.0),
        trust_remote_code=args.trust_remote_code,
        context_length=args.context_length,
        broker=broker_config(args),
    )


def main(argv: list[str] | None = None) -> int:
    from pdserve.logs import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.command)
    try:
        if args.command == "up":
            from pdserve.supervisor import run_up

            return run_up(args)
        if args.command == "bench":
            from pdserve.bench.cli import run as run_bench

            return run_bench(args)
        if args.command == "api":
            run_api(args)
        else:
            run_worker(args, args.command)
    except UsageError as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
