"""``pdserve doctor``: what a deployment depends on, checked where it will run, said plainly.

- NATS: reachable with these credentials, JetStream on, clustered or not; pdserve's
  streams, registry bucket and consumers against the settings this deployment asks for
  (``--js-replicas`` ...), with each one's leader and replicas (``broker/survey.py``);
- the KV transport Mooncake will really use: the RDMA devices ``ibv_devices`` /
  ``ibdev2netdev`` would list (``/sys/class/infiniband``) with their ports, and whether
  ``--disaggregation-ib-device`` can work, else tcp; the address workers advertise;
- GPUs, NCCL and peer access between each pair of GPUs.

Exit status 1 when anything failed (a worker started here with these flags would not
work), else 0. ``--json`` prints the findings as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterable
from pathlib import Path

import orjson

from pdserve import flags, settings
from pdserve.broker.survey import FAIL, INFO, OK, WARN, Finding, survey
from pdserve.configs import UsageError, broker_config, nats_auth

MARK = {OK: "ok  ", WARN: "warn", FAIL: "FAIL", INFO: "    "}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    doctor = sub.add_parser("doctor", help="check NATS, JetStream, the KV transport, GPUs and NCCL where pdserve runs")
    flags.add_flags(doctor, flags.common())
    served_name = next(f for f in flags.MODEL if f.name == "--served-model-name")
    flags.add_flags(doctor, (flags.nats_url(), served_name))
    flags.add_flags(doctor, flags.NATS_AUTH, "NATS credentials")
    flags.add_flags(doctor, flags.BROKER, "what the streams should be")
    flags.add_flags(
        doctor,
        (flags.WORKER_HOST, flags.ADVERTISED_HOST, flags.TRANSFER_BACKEND, flags.IB_DEVICE, flags.ALLOW_TCP_FALLBACK),
        "the KV transport workers here would use",
    )
    doctor.add_argument("--skip-nats", action="store_true", help="check this machine only")
    doctor.add_argument("--json", action="store_true", help="one JSON object per finding")


def transport_findings(
    backend: str, ib_device: str, allow_tcp_fallback: bool, host: str, root: Path = Path("/")
) -> list[Finding]:
    """The transport a worker started here would really use, and what it advertises."""
    from pdserve.configs import choose_transport
    from pdserve.workers.transfer import available_backends
    from pdserve.workers.transfer.base import advertised_host
    from pdserve.workers.transfer.rdma import rdma_devices

    found = []
    devices = rdma_devices(root)
    for device in devices:
        found.append(Finding("rdma device", OK if device.usable else WARN, device.describe()))
    if not devices:
        found.append(Finding("rdma device", INFO, "none (/sys/class/infiniband is empty or absent)"))
    if backend not in available_backends():
        return [*found, Finding("transport", FAIL, f"unknown backend {backend}; available: {available_backends()}")]
    if backend != "mooncake":
        found.append(Finding("transport", INFO, f"{backend}: KV moves point to point (torch.distributed)"))
    else:
        found.append(_mooncake_import())
        try:
            transport = choose_transport(ib_device, allow_tcp_fallback, backend, root)
        except UsageError as exc:
            found.append(Finding("transport", FAIL, f"workers would refuse to start: {exc}"))
        else:
            if transport.fallback:
                why = f"rdma on {ib_device} cannot work ({transport.fallback}): tcp, as --allow-tcp-fallback allows"
                found.append(Finding("transport", WARN, why + "; counted in pdserve_kv_transport_fallbacks_total"))
            elif transport.protocol == "rdma":
                found.append(Finding("transport", OK, f"rdma on {transport.ib_device}"))
            else:
                found.append(Finding("transport", OK, "tcp (no --disaggregation-ib-device)"))
    address = advertised_host(host)
    where = "" if address == host else f" (--host/--transfer-host {host or '(unset)'})"
    status = WARN if address.startswith("127.") else OK
    note = "; only this machine's workers can reach it" if status == WARN else ""
    found.append(Finding("transfer endpoint", status, f"workers here advertise {address}{where}{note}"))
    return found


def _mooncake_import() -> Finding:
    try:
        import mooncake.engine  # noqa: F401
    except Exception as exc:
        return Finding("mooncake", FAIL, f"does not load: {type(exc).__name__}: {exc}")
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13"):
        try:
            return Finding("mooncake", OK, f"{dist} {version(dist)} loads")
        except PackageNotFoundError:
            continue
    return Finding("mooncake", OK, "loads")


def gpu_findings(backend: str) -> list[Finding]:
    """GPUs, NCCL and peer access between every pair, as torch sees them."""
    import torch

    if not torch.cuda.is_available():
        status = FAIL if backend == "nccl" else INFO
        return [Finding("gpu", status, "no CUDA device: CPU pools (mooncake over tcp, or gloo)")]
    count = torch.cuda.device_count()
    found = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        found.append(Finding("gpu", OK, f"cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB"))
    import torch.distributed as dist

    if dist.is_available() and dist.is_nccl_available():
        version = ".".join(str(v) for v in torch.cuda.nccl.version())
        found.append(Finding("nccl", OK, f"NCCL {version}"))
    else:
        found.append(Finding("nccl", FAIL if backend == "nccl" else WARN, "torch has no NCCL"))
    pairs = [(a, b) for a in range(count) for b in range(count) if a != b]
    missing = [f"{a}->{b}" for a, b in pairs if not torch.cuda.can_device_access_peer(a, b)]
    if pairs:
        detail = f"every pair of {count} GPUs" if not missing else f"none between {', '.join(missing)}"
        found.append(Finding("peer access", WARN if missing else OK, detail))
    return found


def report(findings: Iterable[Finding], as_json: bool) -> str:
    if as_json:
        return "\n".join(orjson.dumps(f.__dict__).decode() for f in findings)
    return "\n".join(f"{MARK[f.status]}  {f.check}: {f.detail}" for f in findings)


def run(args: argparse.Namespace) -> int:
    findings: list[Finding] = []
    if not args.skip_nats:
        model = args.served_model_name
        findings += asyncio.run(survey(args.nats_url, nats_auth(args), broker_config(args), model))
    host = args.transfer_host or settings.default_transfer_host() or args.host
    findings += transport_findings(
        args.disaggregation_transfer_backend, args.disaggregation_ib_device, args.allow_tcp_fallback, host
    )
    findings += gpu_findings(args.disaggregation_transfer_backend)
    print(report(findings, args.json))
    failed = [f for f in findings if f.status == FAIL]
    if not args.json:
        print(f"\n{len(failed)} problem(s)" if failed else "\nnothing failed", file=sys.stderr)
    return 1 if failed else 0
