"""The command line: SGLang's worker flags parse, values pdserve cannot honour fail
at start with a clear message, and `up` hands workers the right arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.cli import build_parser
from pdserve.configs import (
    UsageError,
    api_config,
    check_generation_config,
    check_worker_flags,
    engine_config,
    resolve_model,
)
from pdserve.plan import plan_cores, plan_roles, role_threads, size_consumers
from pdserve.supervisor import worker_argv

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
    assert config.max_total_tokens == 4096 and config.quantization is None
    fp8 = build_parser().parse_args([*SGLANG_PREFILL, "--device", "cuda", "--quantization", "fp8"])
    check_worker_flags(fp8, "prefill")
    assert engine_config(fp8).quantization == "fp8"
    for value, meant in (("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("auto", "auto")):
        kv = build_parser().parse_args([*SGLANG_PREFILL, "--kv-cache-dtype", value])
        check_worker_flags(kv, "prefill")
        assert engine_config(kv).kv_cache_dtype == meant
    assert engine_config(args).kv_cache_dtype == "auto"


def test_the_kv_tier_switches_reach_the_tiers_and_up_forwards_them() -> None:
    args = build_parser().parse_args(["prefill", "--model-path", "/m", "--kv-disk-dir", "/kv"])
    tiers = engine_config(args).kv_tiers
    assert tiers.disk_dir == "/kv" and not tiers.cut_runs and not tiers.overlap and tiers.load == "cost"
    both = ["--kv-disk-dir", "/kv", "--kv-tier-cut-runs", "--kv-tier-overlap"]
    tiers = engine_config(build_parser().parse_args(["decode", "--model-path", "/m", *both])).kv_tiers
    assert tiers.cut_runs and tiers.overlap
    up = build_parser().parse_args(["up", *both])
    argv = worker_argv(up, "prefill", Path("/m"), "nats://127.0.0.1:1", 1)
    assert "--kv-tier-cut-runs" in argv and "--kv-tier-overlap" in argv


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tensor-parallel-size", "0"], "at least 1"),
        (["--tensor-parallel-size", "2", "--disaggregation-transfer-backend", "gloo"], "moves KV over mooncake"),
        (["--tensor-parallel-size", "2", "--tp-rank", "2"], "outside --tensor-parallel-size 2"),
        (["--tensor-parallel-size", "2", "--kv-host-bytes", "1000000"], "tiers copy a whole page pool"),
        (["--disaggregation-mode", "decode"], "does not match"),
        (["--disaggregation-transfer-backend", "nixl"], "available: gloo, ipc, local, mooncake, nccl, shm"),
        (["--disaggregation-transfer-backend", "nccl"], "moves cuda pools, not cpu ones .a cpu pool moves over gloo"),
        (["--disaggregation-transfer-backend", "gloo", "--device", "cuda:1"], "moves cpu pools, not cuda ones"),
        (["--page-size", "12"], "power of two"),
        (["--cpus", "3-1"], "--cpus: not a list of CPU cores"),
        (
            ["--quantization", "fp8", "--device", "cuda", "--model-impl", "transformers"],
            "stock transformers code has no FP8",
        ),
        (["--quantization", "fp8"], "--device cpu: FP8 weights run on pdserve's GPU pass"),
        (["--kv-cache-dtype", "bf16", "--dtype", "float32"], "--kv-cache-dtype bf16 with --dtype float32"),
    ],
)
def test_values_pdserve_cannot_honour_are_errors(flags: list[str], message: str) -> None:
    args = build_parser().parse_args(["prefill", "--model-path", "/m", *flags])
    with pytest.raises(UsageError, match=message):
        check_worker_flags(args, "prefill")


def test_worker_exits_with_a_clear_message_before_loading_anything(tmp_path: Path) -> None:
    argv = ["decode", "--model-path", str(tmp_path), "--tensor-parallel-size", "4"]
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", *argv, "--disaggregation-transfer-backend", "gloo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--tensor-parallel-size 4" in proc.stderr


def test_a_model_that_does_not_split_evenly_is_refused_before_any_rank_starts(tiny_model_dir: Path) -> None:
    """The built-in model has 2 KV heads: 4 ranks cannot share them."""
    argv = ["unified", "--model-path", str(tiny_model_dir), "--tensor-parallel-size", "4"]
    proc = subprocess.run([sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--tensor-parallel-size 4 does not divide the model's KV heads 2" in proc.stderr
    assert "tensor-parallel ranks started" not in proc.stderr
    if not torch.cuda.is_available():
        argv = ["unified", "--model-path", str(tiny_model_dir), "--tp-size", "2", "--device", "cuda"]
        proc = subprocess.run([sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert "needs GPUs up to cuda:1; this machine has 0" in proc.stderr


def test_a_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "prefill", "--model-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no config.json" in proc.stderr


def test_a_generation_config_the_api_cannot_use_is_refused_before_start(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text('{"temperature": 7}')
    for command in ("api", "up"):
        args = build_parser().parse_args([command, "--model-path", str(tmp_path)])
        with pytest.raises(UsageError, match=r"--generation-config: .*temperature 7 .*--generation-config none"):
            check_generation_config(args, resolve_model(args))
    args = build_parser().parse_args(["api", "--model-path", str(tmp_path), "--generation-config", "none"])
    assert api_config(args, args.nats_url, resolve_model(args)).generation_config == "none"


def test_a_parser_the_chat_template_cannot_serve_is_refused_before_start(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")  # takes no tools
    for command in ("api", "up"):
        args = build_parser().parse_args([command, "--model-path", str(tmp_path), "--tool-call-parser", "llama3_json"])
        with pytest.raises(UsageError, match="llama3_json needs a chat template that takes tools"):
            check_generation_config(args, resolve_model(args))
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{% if tools %}{{ tools }}{% endif %}"}')
    args = build_parser().parse_args(["api", "--model-path", str(tmp_path), "--tool-call-parser", "llama3_json"])
    check_generation_config(args, resolve_model(args))  # a template that takes tools: served
    assert api_config(args, args.nats_url, resolve_model(args)).tool_call_parser == "llama3_json"
    args = build_parser().parse_args(["api", "--model-path", str(tmp_path), "--reasoning-parser", "none"])
    assert api_config(args, args.nats_url, resolve_model(args)).reasoning_parser == "none"


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
    assert "--tensor-parallel-size" not in argv and "--cpus" not in argv
    argv = worker_argv(args, "decode", Path("/m"), "nats://127.0.0.1:1", 7, cores=[9, 10, 11, 12, 13, 14, 15])
    assert argv[argv.index("--cpus") + 1] == "9-15", "up --pin-cores: the worker's own cores"
    split = build_parser().parse_args(["up", "--prefill-num-threads", "4", "--decode-num-threads", "10"])
    assert role_threads(split, plan_roles(split), 7) == [4, 10]
    assert role_threads(args, ["prefill", "decode"], 7) == [7, 7], "else the threads up shares out"
    tp = build_parser().parse_args(["up", "--tp-size", "2", "--decode-tensor-parallel-size", "4"])
    for role, size in (("prefill", "2"), ("decode", "4")):
        argv = worker_argv(tp, role, Path("/m"), "nats://127.0.0.1:1", 8)
        assert argv[argv.index("--tensor-parallel-size") + 1] == size
        assert argv[argv.index("--num-threads") + 1] == str(8 // int(size)), "the ranks share the worker's threads"
    unified = build_parser().parse_args(["up", "--mode", "unified", "--unified-workers", "2"])
    assert plan_roles(unified) == ["unified", "unified"]
    with pytest.raises(SystemExit):
        plan_roles(build_parser().parse_args(["up", "--prefill-workers", "0"]))


def test_up_pin_cores_refuses_what_it_cannot_do() -> None:
    with pytest.raises(UsageError, match="--pin-cores: for fixed pools"):
        plan_cores(build_parser().parse_args(["up", "--pin-cores", "--autoscale"]), [1, 1])
    if len(os.sched_getaffinity(0)) < 8:
        with pytest.raises(UsageError, match=r"--pin-cores: .* cores cannot give workers of 1[+]1 threads"):
            plan_cores(build_parser().parse_args(["up", "--pin-cores"]), [1, 1])
    assert plan_cores(build_parser().parse_args(["up"]), [1, 1]) is None


def test_up_autoscale_starts_each_pool_at_its_minimum_and_sizes_the_consumers_for_the_maximum() -> None:
    from pdserve.autoscale import size_for_autoscale
    from pdserve.plan import plan_autoscale

    args = build_parser().parse_args(
        [
            "up",
            "--autoscale",
            "--min-prefill",
            "2",
            "--max-prefill",
            "5",
            "--max-decode",
            "3",
            "--max-running-requests",
            "16",
        ]
    )
    config, roles = plan_autoscale(args)
    assert roles == ["prefill", "prefill", "decode"]
    assert (config.prefill.min_replicas, config.prefill.max_replicas) == (2, 5)
    assert (config.decode.min_replicas, config.decode.max_replicas) == (1, 3)
    assert config.decode.lag_per_replica == 12, "3/4 of --max-running-requests"
    assert size_for_autoscale(args, config) >= 1
    assert (args.prefill_max_ack_pending, args.decode_max_ack_pending) == (5 * 16, 3 * 16)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mode", "unified"], "use --mode pd"),
        (["--worker-devices", "cuda:0,cuda:1"], "--worker-devices is for fixed pools"),
        (["--min-prefill", "3", "--max-prefill", "2"], "min <= max"),
        (["--max-decode", "0", "--min-decode", "0"], "max >= 1"),
    ],
)
def test_up_autoscale_refuses_what_it_cannot_do(flags: list[str], message: str) -> None:
    from pdserve.plan import plan_autoscale

    args = build_parser().parse_args(["up", "--autoscale", *flags])
    with pytest.raises(UsageError, match=message):
        plan_autoscale(args)


def test_autoscale_takes_the_worker_flags_up_hands_on() -> None:
    from pdserve import flags

    args = build_parser().parse_args(["autoscale", "--nats-url", "nats://b:4222", "--max-prefill", "3"])
    argv = worker_argv(args, "prefill", Path("/m"), args.nats_url, 2)
    assert argv[3] == "prefill" and "--nats-url" in argv and "nats://b:4222" in argv
    assert {f.dest for f in flags.forwarded()} <= set(vars(args)) | {"host", "exit_with_parent"}
    assert args.metrics_port == 9464


def test_up_colocate_pairs_the_roles_in_processes_of_their_own() -> None:
    args = build_parser().parse_args(["up", "--colocate", "--prefill-workers", "2", "--decode-workers", "2"])
    roles = plan_roles(args)
    assert roles == ["colocated", "colocated"]
    size_consumers(args, roles)
    assert args.prefill_max_ack_pending == args.decode_max_ack_pending == 2 * args.max_running_requests
    argv = worker_argv(args, "colocated", Path("/m"), "nats://127.0.0.1:1", 2)
    assert argv[3] == "colocated"
    for bad, why in (
        (["--prefill-workers", "1", "--decode-workers", "2"], "must be equal"),
        (["--mode", "unified"], "use --mode pd"),
    ):
        with pytest.raises(UsageError, match=why):
            plan_roles(build_parser().parse_args(["up", "--colocate", *bad]))


def test_the_local_backend_belongs_to_colocated_processes_only() -> None:
    from pdserve.configs import check_worker_flags

    with pytest.raises(UsageError, match="for the two workers of one `pdserve colocated` process"):
        check_worker_flags(
            build_parser().parse_args(["decode", "--disaggregation-transfer-backend", "local"]), "decode"
        )
    with pytest.raises(UsageError, match="hands KV over inside the process"):
        check_worker_flags(
            build_parser().parse_args(["colocated", "--disaggregation-transfer-backend", "nccl"]), "colocated"
        )
    check_worker_flags(build_parser().parse_args(["colocated"]), "colocated")  # the default: local


def test_up_moves_kv_without_a_port_on_one_host_unless_told_otherwise(tmp_path: Path) -> None:
    from pdserve.plan import choose_backend

    parser = build_parser()
    assert choose_backend(parser.parse_args(["up"]), str(tmp_path)) == ("shm", "one CPU host")
    for argv, why in (
        (["--nats-url", "nats://n:1"], "other hosts"),
        (["--device", "cuda", "--nats-url", "nats://n:1"], "other hosts"),
        (["--worker-devices", "cuda:0,cpu"], "CPU and GPU pools side by side"),
        (["--tp-size", "2"], "tensor-parallel"),
        (["--device", "cuda", "--tp-size", "2"], "tensor-parallel"),
        (["--disaggregation-ib-device", "mlx5_0"], "RDMA"),
        (["--device", "cuda", "--disaggregation-ib-device", "mlx5_0"], "RDMA"),
    ):
        backend, reason = choose_backend(parser.parse_args(["up", *argv]), str(tmp_path))
        assert backend == "mooncake" and why in reason
    # GPUs of one host, the embedded broker, one rank each: CUDA IPC (one GPU or several).
    for argv in (["--device", "cuda"], ["--device", "cuda:1"], ["--worker-devices", "cuda:0,cuda:1"]):
        assert choose_backend(parser.parse_args(["up", *argv])) == ("ipc", "GPUs of one host (CUDA IPC)")
    assert choose_backend(parser.parse_args(["up", "--device", "cuda", "--colocate"]))[0] == "local"
    assert choose_backend(parser.parse_args(["up", "--device", "cuda", "--mode", "unified"]))[0] == "mooncake"
    assert choose_backend(parser.parse_args(["up", "--disaggregation-transfer-backend", "gloo"])) == ("gloo", "given")
    assert choose_backend(parser.parse_args(["up"]), str(tmp_path / "missing"))[0] == "mooncake"
    assert choose_backend(parser.parse_args(["up", "--colocate"]))[0] == "local"
    # Pools that /dev/shm cannot hold: mooncake, saying why (a worker would fail to start).
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        '{"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 4, "num_key_value_heads": 2}'
    )
    huge = parser.parse_args(["up", "--max-total-tokens", str(1 << 40)])
    backend, why = choose_backend(huge, str(tmp_path), model_path=model)
    assert backend == "mooncake" and "the pools need" in why
    from pdserve.plan import kv_bytes_per_token

    # 4 layers, 2 KV heads of 64: float32 4 bytes a value; FP8 one, and a float32 scale per block of
    # a page's tokens (16: a quarter byte a token, 8 pages: half a byte, rounded up)
    assert kv_bytes_per_token(model, "float32") == 4 * 2 * 2 * 64 * 4
    assert (
        kv_bytes_per_token(model, "float32", "fp8_e4m3")
        == kv_bytes_per_token(model, "auto", "fp8")
        == 4 * 2 * 2 * 64 + 4
    )
    assert kv_bytes_per_token(model, "auto", "fp8", page_size=8) == 4 * 2 * 2 * 64 + 8
    assert kv_bytes_per_token(model, "bfloat16", "bf16") == 4 * 2 * 2 * 128
    assert choose_backend(parser.parse_args(["up", "--mode", "unified"]))[0] == "mooncake"
