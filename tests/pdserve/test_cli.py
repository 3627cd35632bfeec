"""The command line: SGLang's worker flags parse, values pdserve cannot honour fail
at start with a clear message, and `up` hands workers the right arguments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.launch import UsageError, check_worker_flags, engine_config
from pdserve.supervisor import plan_roles, size_consumers, worker_argv

SGLANG_PREFILL = (
    "prefill --model-path /data/model --port 7000 --host 0.0.0.0 --tensor-parallel-size 1 "
    "--disaggregation-mode prefill --disaggregation-bootstrap-port 8998 --disaggregation-transfer-backend mooncake "
    "--disaggregation-ib-device mlx5_2 --max-total-tokens 4096 --dtype float16 --trust-remote-code"
).split()


def test_an_sglang_prefill_command_parses_and_passes_the_checks() -> None:
    args = build_parser().parse_args(SGLANG_PREFILL)
    check_worker_flags(args, "prefill")
    assert args.port == 7000 and args.disaggregation_bootstrap_port == 8998
    assert args.disaggregation_ib_device == "mlx5_2" and args.trust_remote_code
    config = engine_config(args)
    assert config.max_total_tokens == 4096


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tensor-parallel-size", "2"], "tensor-parallel-size 2"),
        (["--disaggregation-mode", "decode"], "does not match"),
        (["--disaggregation-transfer-backend", "nixl"], "available: gloo, mooncake, nccl"),
        (["--disaggregation-transfer-backend", "nccl"], "moves cuda pools, not cpu ones .a cpu pool moves over gloo"),
        (["--disaggregation-transfer-backend", "gloo", "--device", "cuda:1"], "moves cpu pools, not cuda ones"),
        (["--page-size", "12"], "power of two"),
    ],
)
def test_values_pdserve_cannot_honour_are_errors(flags: list[str], message: str) -> None:
    args = build_parser().parse_args(["prefill", "--model-path", "/m", *flags])
    with pytest.raises(UsageError, match=message):
        check_worker_flags(args, "prefill")


def test_worker_exits_with_a_clear_message_before_loading_anything(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "decode", "--model-path", str(tmp_path), "--tensor-parallel-size", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--tensor-parallel-size 4" in proc.stderr


def test_a_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "prefill", "--model-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no config.json" in proc.stderr


def test_up_plans_roles_and_forwards_engine_flags() -> None:
    args = build_parser().parse_args(
        ["up", "--prefill-workers", "2", "--decode-workers", "3", "--max-total-tokens", "8192"]
    )
    assert plan_roles(args) == ["prefill", "prefill", "decode", "decode", "decode"]
    size_consumers(args, plan_roles(args))
    argv = worker_argv(args, "decode", Path("/m"), "nats://127.0.0.1:1", 1)
    assert argv[argv.index("--prefill-max-ack-pending") + 1] == str(2 * args.max_running_requests)
    assert argv[argv.index("--decode-max-ack-pending") + 1] == str(3 * args.max_running_requests)
    assert argv[3] == "decode" and "--exit-with-parent" in argv
    assert argv[argv.index("--max-total-tokens") + 1] == "8192"
    assert argv[argv.index("--nats-url") + 1] == "nats://127.0.0.1:1"
    unified = build_parser().parse_args(["up", "--mode", "unified", "--unified-workers", "2"])
    assert plan_roles(unified) == ["unified", "unified"]
    with pytest.raises(SystemExit):
        plan_roles(build_parser().parse_args(["up", "--prefill-workers", "0"]))
