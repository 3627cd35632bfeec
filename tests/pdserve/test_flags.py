"""One config flow: flag defaults are the config dataclasses' defaults, and the command
line `up` builds for a worker parses back into the config `up` means."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from pdserve import flags
from pdserve.api.config import ApiConfig
from pdserve.broker.streams import BrokerConfig
from pdserve.cli import build_parser
from pdserve.configs import api_config, engine_config, worker_config
from pdserve.engine.config import EngineConfig
from pdserve.plan import plan_devices, plan_roles, size_consumers
from pdserve.supervisor import api_argv, worker_argv
from pdserve.workers.config import WorkerConfig

MODEL = Path("/models/m")


def _options(parser: argparse.ArgumentParser, command: str) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {opt for action in sub.choices[command]._actions for opt in action.option_strings}


def test_worker_flags_default_to_the_configs_defaults() -> None:
    args = build_parser().parse_args(["decode", "--model-path", str(MODEL), "--nats-url", "nats://n:1"])
    config = worker_config(args, "decode", MODEL)
    assert config.engine == EngineConfig()
    assert config.broker == BrokerConfig()
    expected = WorkerConfig("decode", MODEL, "m", "nats://n:1", worker_id=config.worker_id)
    assert config == expected


def test_api_flags_default_to_the_configs_defaults() -> None:
    args = build_parser().parse_args(["api", "--nats-url", "nats://n:1"])
    # the served name is decided where the model is resolved: the directory's name here
    assert api_config(args, args.nats_url, MODEL) == ApiConfig("nats://n:1", MODEL, model_name="m")


def test_up_forwards_every_flag_it_shares_with_workers() -> None:
    parser = build_parser()
    shared = _options(parser, "up") & _options(parser, "prefill")
    own_meaning = {"-h", "--help", "--host", "--port"}  # HTTP under `up`, the worker's own under `prefill`
    # `up` hands each role its own size (--prefill-/--decode-tensor-parallel-size override it).
    own_meaning |= {"--tensor-parallel-size", "--tp-size"}
    assert shared - own_meaning <= {name for flag in flags.forwarded() for name in (flag.name, *flag.aliases)}


def test_up_hands_workers_and_apis_the_resolved_directory_without_the_revision() -> None:
    up = build_parser().parse_args(["up", "--model-path", "Qwen/Qwen2.5-0.5B-Instruct", "--revision", "v1"])
    for argv in (worker_argv(up, "decode", MODEL, "nats://n:1", 1), api_argv(up, MODEL, "nats://n:1")):
        assert argv[argv.index("--model-path") + 1] == str(MODEL) and "--revision" not in argv


def test_a_worker_parses_what_up_means() -> None:
    parser = build_parser()
    up = parser.parse_args(
        [
            "up",
            "--prefill-workers",
            "2",
            "--served-model-name",
            "served",
            "--dtype",
            "bfloat16",
            "--trust-remote-code",
            "--context-length",
            "512",
            "--device",
            "cuda:1",
            "--load-format",
            "dummy",
            "--max-total-tokens",
            "8192",
            "--page-size",
            "32",
            "--chunked-prefill-size",
            "1024",
            "--max-running-requests",
            "8",
            "--disable-prefix-cache",
            "--kv-cache-dtype",
            "fp8",
            "--kv-hold-seconds",
            "12.5",
            "--heartbeat-seconds",
            "0.5",
            "--transfer-host",
            "10.0.0.2",
            "--disaggregation-ib-device",
            "mlx5_2",
            "--allow-tcp-fallback",  # no RDMA device on this machine: tcp, said and counted
            "--js-replicas",
            "3",
            "--log-level",
            "debug",
        ]
    )
    size_consumers(up, plan_roles(up))
    argv = worker_argv(up, "prefill", MODEL, "nats://n:1", threads=3)
    worker = parser.parse_args(argv[3:])
    assert worker.exit_with_parent and worker.log_level == "DEBUG" and worker.data_dir == up.data_dir
    config = worker_config(worker, "prefill", MODEL)
    assert config.engine == dataclasses.replace(engine_config(up), num_threads=3)
    assert config.broker == BrokerConfig(prefill_max_ack_pending=16, decode_max_ack_pending=8, replicas=3)
    assert config.transport_fallback.startswith("mlx5_2 not found")
    assert config == WorkerConfig(
        "prefill",
        MODEL,
        "served",
        "nats://n:1",
        engine=config.engine,
        broker=config.broker,
        worker_id=config.worker_id,
        host="10.0.0.2",
        transfer_host="10.0.0.2",
        dtype="bfloat16",
        trust_remote_code=True,
        load_format="dummy",
        transfer_protocol="tcp",
        ib_device="",
        transport_fallback=config.transport_fallback,
        transport_fallback_device="mlx5_2",
        kv_hold_seconds=12.5,
        heartbeat_seconds=0.5,
    )


def test_unset_values_render_as_nothing() -> None:
    page = flags.Flag("--page-size", 16, int)
    switch = flags.Flag("--trust-remote-code", switch=True)
    assert page.render(None) == [] and page.render(32) == ["--page-size", "32"]
    assert switch.render(False) == [] and switch.render(True) == ["--trust-remote-code"]


def test_an_extra_api_process_parses_what_up_means() -> None:
    parser = build_parser()
    up = parser.parse_args(
        ["up", "--api-processes", "3", "--port", "8123", "--host", "0.0.0.0", "--served-model-name", "served"]
        + ["--stall-timeout", "4.5", "--max-migrations", "5", "--log-level", "debug"]
        + ["--served-model-alias", "gpt-x", "--served-model-alias", "org/other"]
    )
    size_consumers(up, plan_roles(up))
    argv = api_argv(up, MODEL, "nats://n:1")
    api = parser.parse_args(argv[3:])
    assert argv[3] == "api" and api.reuse_port and api.exit_with_parent and api.log_level == "DEBUG"
    # The same API config as the process `up` runs itself (whose port it shares).
    assert api_config(api, "nats://n:1", MODEL) == api_config(up, "nats://n:1", MODEL)
    assert api_config(api, "nats://n:1", MODEL).model_aliases == ("gpt-x", "org/other")


def test_up_places_workers_on_the_devices_given_in_turn() -> None:
    parser = build_parser()
    up = parser.parse_args(["up", "--worker-devices", "cuda:0,cuda:1", "--disaggregation-transfer-backend", "nccl"])
    roles = plan_roles(up)
    assert plan_devices(up, roles) == ["cuda:0", "cuda:1"]
    worker = parser.parse_args(worker_argv(up, "decode", MODEL, "nats://n:1", 1, "cuda:1")[3:])
    assert worker.device == "cuda:1" and worker.disaggregation_transfer_backend == "nccl"
    unified = parser.parse_args(
        ["up", "--mode", "unified", "--unified-workers", "3", "--worker-devices", "cuda:0,cuda:1"]
    )
    assert plan_devices(unified, plan_roles(unified)) == ["cuda:0", "cuda:1", "cuda:0"]
    assert plan_devices(parser.parse_args(["up"]), ["prefill", "decode"]) == ["cpu", "cpu"]
    # ipc pairs workers on one GPU as well as on two.
    same = parser.parse_args(["up", "--device", "cuda:0", "--disaggregation-transfer-backend", "ipc"])
    assert plan_devices(same, plan_roles(same)) == ["cuda:0", "cuda:0"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--worker-devices", "cuda:0,cuda:0", "--disaggregation-transfer-backend", "nccl"], "share cuda:0"),
        (["--disaggregation-transfer-backend", "nccl"], "moves cuda pools"),
        (["--worker-devices", "cuda:0,cuda:1", "--disaggregation-transfer-backend", "gloo"], "moves cpu pools"),
        (["--worker-devices", "cuda:0,cpu", "--disaggregation-transfer-backend", "ipc"], "moves cuda pools"),
    ],
)
def test_up_refuses_a_placement_the_transfer_backend_cannot_serve(argv: list[str], message: str) -> None:
    up = build_parser().parse_args(["up", *argv])
    with pytest.raises(SystemExit, match=message):
        plan_devices(up, plan_roles(up))


def test_secrets_reach_child_processes_as_files_never_on_their_command_line(tmp_path: Path) -> None:
    from pdserve.broker.credentials import EmbeddedCredentials

    parser = build_parser()
    up = parser.parse_args(
        ["up", "--api-processes", "2", "--port", "8123", "--api-key", "secret-key-1", "--max-output-tokens", "64"]
        + ["--max-concurrent-requests", "4", "--data-dir", str(tmp_path)]
    )
    size_consumers(up, plan_roles(up))
    credentials = EmbeddedCredentials.create(tmp_path / "auth", ["api-x-0", "api-x-1"])
    key_file = tmp_path / "keys"
    key_file.write_text("secret-key-1\n")
    api = api_argv(up, MODEL, "nats://n:1", "api-x-1", credentials, key_file)
    worker = worker_argv(up, "decode", MODEL, "nats://n:1", 1, credentials=credentials)
    secrets = ["secret-key-1", *(user.password for user in credentials.users)]
    assert not any(secret in arg for secret in secrets for arg in api + worker)
    parsed_api = parser.parse_args(api[3:])
    assert parsed_api.nats_user == "api-x-1" and parsed_api.api_id == "api-x-1"
    config = api_config(parsed_api, "nats://n:1", MODEL)
    assert config.api_keys == ("secret-key-1",) and config.nats_auth == credentials.auth("api-x-1")
    assert config.max_output_tokens == 64 and config.max_concurrent_requests == 4
    parsed_worker = parser.parse_args(worker[3:])
    assert worker_config(parsed_worker, "decode", MODEL).nats_auth == credentials.auth("decode")


def test_the_api_listens_on_loopback_unless_told_otherwise() -> None:
    for command in ("up", "api"):
        args = build_parser().parse_args([command])
        assert args.host == "127.0.0.1"


def test_kv_tier_flags_reach_the_engine_and_a_store_needs_its_metadata_server() -> None:
    from pdserve.configs import UsageError
    from pdserve.engine.config import KVTierConfig

    base = ["prefill", "--model-path", str(MODEL), "--nats-url", "nats://n:1"]
    tiers = ["--kv-host-bytes", "1024", "--kv-disk-dir", "/kv", "--kv-group-pages", "4"]
    args = build_parser().parse_args([*base, *tiers, "--kv-store-master", "h:1", "--kv-store-metadata", "http://h:2/m"])
    assert engine_config(args).kv_tiers == KVTierConfig(
        host_bytes=1024, disk_dir="/kv", group_pages=4, store_master="h:1", store_metadata="http://h:2/m"
    )
    with pytest.raises(UsageError, match="metadata"):
        engine_config(build_parser().parse_args([*base, "--kv-store-master", "h:1"]))
