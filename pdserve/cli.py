"""The ``pdserve`` command: ``up``, ``api``, ``prefill``, ``decode``, ``unified``, ``colocated``, ``autoscale``,
``bench``, ``schemas``, ``doctor``.

Flags come from :mod:`pdserve.flags`; :mod:`pdserve.configs` turns them into configs, :mod:`pdserve.launch`
runs the process. Worker commands take the SGLang flags users already type
(``--model-path``, ``--disaggregation-mode`` ...); a value pdserve cannot honour stops
the worker at start with a clear message instead of being ignored.
"""

from __future__ import annotations

import argparse
import sys

from pdserve import doctor, flags, schema_files
from pdserve.bench.cli import add_parser as add_bench_parser
from pdserve.configs import UsageError

ROLES = ("prefill", "decode", "unified", "colocated")
ROLE_HELP = {
    "colocated": "run a prefill worker and a decode worker in one process on one device (KV handed over in place)"
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode-disaggregated LLM serving over NATS JetStream."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run everything: broker, workers and the HTTP API")
    flags.add_flags(up, flags.common())
    flags.add_flags(up, flags.MODEL, "model")
    flags.add_flags(up, flags.ENGINE, "engine")
    flags.add_flags(
        up,
        (
            *flags.HTTP,
            flags.SERVED_MODEL_ALIAS,
            flags.GENERATION_CONFIG,
            flags.TOOL_CALL_PARSER,
            flags.REASONING_PARSER,
        ),
    )
    flags.add_flags(up, flags.GUARD, "access and limits")
    flags.add_flags(up, flags.RECOVERY, "recovery")
    flags.add_flags(up, flags.PLACEMENT, "placement")
    flags.add_flags(up, flags.UP)
    # Not given: `up` chooses (plan.choose_backend: shm on one CPU host, ipc on GPUs of one host, else mooncake).
    up.set_defaults(disaggregation_transfer_backend=None)
    flags.nats_url().add_to(up, default=None, help="use this NATS server instead of starting one")
    flags.add_flags(up, flags.NATS_AUTH, "an external NATS server's credentials (the embedded one makes its own)")
    for flag in flags.BROKER:
        if flag.name in flags.UP_BROKER_HELP:
            flag.add_to(up, default=None, help=flags.UP_BROKER_HELP[flag.name])
        else:
            flag.add_to(up)
    flags.add_flags(up, (flags.AUTOSCALE_SWITCH, *flags.AUTOSCALE), "autoscaling (with --autoscale)")

    scale = sub.add_parser(
        "autoscale", help="run prefill and decode workers on this machine, as many as their queues ask for"
    )
    flags.add_flags(scale, flags.common())
    flags.add_flags(scale, flags.MODEL, "model")
    flags.add_flags(scale, flags.ENGINE, "engine")
    flags.add_flags(scale, flags.AUTOSCALE, "autoscaling")
    flags.add_flags(scale, flags.AUTOSCALE_METRICS)
    flags.add_flags(
        scale,
        (
            flags.nats_url(),
            *(f for f in flags.UP if f.name in ("--transfer-host", "--disaggregation-transfer-backend")),
            flags.IB_DEVICE,
            flags.ALLOW_TCP_FALLBACK,
            flags.PREFIX_PLACEMENT,
        ),
    )
    flags.add_flags(scale, flags.NATS_AUTH, "NATS credentials (the autoscaler's and its workers')")
    for flag in flags.BROKER:
        if flag.name in flags.AUTOSCALE_BROKER_HELP:
            flag.add_to(scale, default=None, help=flags.AUTOSCALE_BROKER_HELP[flag.name])
        else:
            flag.add_to(scale)

    api = sub.add_parser("api", help="run the HTTP API only")
    flags.add_flags(api, flags.common())
    flags.add_flags(api, flags.MODEL, "model")
    flags.add_flags(
        api,
        (
            *flags.HTTP,
            flags.nats_url(),
            *flags.API,
            flags.SERVED_MODEL_ALIAS,
            flags.GENERATION_CONFIG,
            flags.TOOL_CALL_PARSER,
            flags.REASONING_PARSER,
            flags.API_ID,
            flags.REUSE_PORT,
            flags.EXIT_WITH_PARENT,
        ),
    )
    flags.add_flags(api, flags.GUARD, "access and limits")
    flags.add_flags(api, flags.PLACEMENT, "placement")
    flags.add_flags(api, flags.NATS_AUTH, "NATS credentials")
    flags.add_flags(api, flags.BROKER, "broker")

    for role in ROLES:
        worker = sub.add_parser(role, help=ROLE_HELP.get(role, f"run one {role} worker"))
        flags.add_flags(worker, flags.common())
        flags.add_flags(worker, flags.MODEL, "model")
        flags.add_flags(worker, flags.ENGINE, "engine")
        flags.add_flags(worker, flags.SGLANG, "SGLang-compatible flags")
        flags.add_flags(worker, flags.BROKER, "broker")
        flags.add_flags(worker, (flags.nats_url(), flags.WORKER_ID, flags.EXIT_WITH_PARENT, *flags.TP_RANK))
        flags.add_flags(worker, (flags.PREFIX_PLACEMENT,), "placement")
        flags.add_flags(worker, flags.NATS_AUTH, "NATS credentials")

    add_bench_parser(sub)
    schema_files.add_parser(sub)
    doctor.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pdserve.logs import setup_logging

    args = build_parser().parse_args(argv)
    if args.command == "schemas":
        return schema_files.run(args)
    setup_logging(args.log_level, args.command)
    try:
        if args.command == "up":
            from pdserve.supervisor import run_up

            return run_up(args)
        if args.command == "autoscale":
            from pdserve.autoscale import run_autoscale

            return run_autoscale(args)
        if args.command == "doctor":
            return doctor.run(args)
        if args.command == "bench":
            from pdserve.bench.cli import run as run_bench

            return run_bench(args)
        from pdserve.launch import run_api, run_colocated, run_worker

        if args.command == "colocated":
            return run_colocated(args)
        if args.command == "api":
            run_api(args)
        else:
            return run_worker(args, args.command)
    except UsageError as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
