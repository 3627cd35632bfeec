"""`pdserve doctor` as a user runs it: against a real nats-server (streams made by
pdserve, then one changed by hand), and on this machine's transport and devices.
The clustered case (R3, leaders and replicas) is in tests/integration/test_cluster.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pdserve.broker import subjects
from pdserve.broker.connection import connect
from pdserve.broker.streams import BrokerConfig, ensure_model, request_stream, worker_bucket
from pdserve.doctor import transport_findings

MODEL = "Qwen/Qwen2.5-7B"


def doctor(*args: str) -> tuple[int, list[dict[str, Any]]]:
    """``pdserve doctor --json ...`` in a process of its own: exit status and findings."""
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "doctor", "--json", *args], capture_output=True, text=True, timeout=120
    )
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def by_check(findings: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f["check"]: f for f in findings}


def test_a_broker_that_is_not_there_fails(tmp_path: Path) -> None:
    code, findings = doctor("--nats-url", "nats://127.0.0.1:9", "--data-dir", str(tmp_path))
    assert code == 1
    assert by_check(findings)["nats"]["status"] == "fail" and "cannot connect" in by_check(findings)["nats"]["detail"]


async def test_streams_and_consumers_are_checked_against_this_deployment(nats_server: Any, tmp_path: Path) -> None:
    code, findings = doctor("--nats-url", nats_server.url, "--served-model-name", MODEL, "--data-dir", str(tmp_path))
    found = by_check(findings)
    assert code == 0 and found["nats"]["status"] == "ok" and "no cluster" in found["nats"]["detail"]
    assert found["jetstream"]["status"] == "ok"
    assert found[f"stream {subjects.REQUEST_STREAM}"]["status"] == "warn"  # not created yet: not a failure
    assert "not created yet" in found[f"stream {subjects.REQUEST_STREAM}"]["detail"]

    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_model(js, MODEL, BrokerConfig())
    await worker_bucket(js, BrokerConfig())
    code, findings = await asyncio.to_thread(
        doctor, "--nats-url", nats_server.url, "--served-model-name", MODEL, "--data-dir", str(tmp_path)
    )
    found = by_check(findings)
    assert code == 0
    for name in (subjects.REQUEST_STREAM, subjects.KV_STREAM, subjects.DEAD_STREAM):
        assert found[f"stream {name}"]["status"] == "ok", found[f"stream {name}"]
        assert "file storage, R1, as configured" in found[f"stream {name}"]["detail"]
    prefill = found[f"consumer {subjects.REQUEST_STREAM}/{subjects.prefill_consumer(MODEL)}"]
    assert prefill["status"] == "ok" and "explicit ack, ack_wait 10s, max_deliver 5" in prefill["detail"]
    assert found["registry"]["status"] == "ok"

    # Someone shrank the request stream's limit by hand; a deployment asking for R3 differs too.
    await js.update_stream(request_stream(BrokerConfig(request_max_msgs=10)))
    await nc.close()
    code, findings = await asyncio.to_thread(
        doctor, "--nats-url", nats_server.url, "--js-replicas", "3", "--data-dir", str(tmp_path)
    )
    detail = by_check(findings)[f"stream {subjects.REQUEST_STREAM}"]["detail"]
    assert "max_msgs 10 (this deployment: 100000)" in detail and "num_replicas 1 (this deployment: 3)" in detail


def test_rdma_asked_for_where_it_cannot_work_is_a_failure_unless_allowed(tmp_path: Path) -> None:
    code, findings = doctor("--skip-nats", "--disaggregation-ib-device", "mlx5_0", "--data-dir", str(tmp_path))
    transport = by_check(findings)["transport"]
    assert code == 1 and transport["status"] == "fail" and "workers would refuse to start" in transport["detail"]
    code, findings = doctor(
        "--skip-nats", "--disaggregation-ib-device", "mlx5_0", "--allow-tcp-fallback", "--data-dir", str(tmp_path)
    )
    transport = by_check(findings)["transport"]
    assert code == 0 and transport["status"] == "warn" and "pdserve_kv_transport_fallbacks_total" in transport["detail"]


def test_the_transport_and_advertised_address_found_on_a_machine_with_rdma(tmp_path: Path) -> None:
    port = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    (tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "device" / "infiniband_verbs" / "uverbs0").mkdir(
        parents=True
    )
    (tmp_path / "dev" / "infiniband").mkdir(parents=True)
    (tmp_path / "dev" / "infiniband" / "uverbs0").write_text("")
    findings = {f.check: f for f in transport_findings("mooncake", "mlx5_0", False, "10.1.2.3", root=tmp_path)}
    assert findings["rdma device"].status == "ok" and "port 1 ACTIVE (Ethernet)" in findings["rdma device"].detail
    assert findings["transport"].status == "ok" and findings["transport"].detail == "rdma on mlx5_0"
    assert findings["transfer endpoint"].detail == "workers here advertise 10.1.2.3"
    local = {f.check: f for f in transport_findings("mooncake", "", False, "127.0.0.1", root=tmp_path)}
    assert local["transport"].detail.startswith("tcp") and local["transfer endpoint"].status == "warn"


def test_gpus_and_nccl_are_reported_for_what_this_machine_has(tmp_path: Path) -> None:
    import torch

    code, findings = doctor("--skip-nats", "--data-dir", str(tmp_path))
    gpu = [f for f in findings if f["check"] == "gpu"]
    if torch.cuda.is_available():
        assert len(gpu) == torch.cuda.device_count() and any(f["check"] == "nccl" for f in findings)
    else:
        assert gpu == [
            {"check": "gpu", "status": "info", "detail": "no CUDA device: CPU pools (mooncake over tcp, or gloo)"}
        ]
        code, findings = doctor("--skip-nats", "--disaggregation-transfer-backend", "nccl", "--data-dir", str(tmp_path))
        assert code == 1 and by_check(findings)["gpu"]["status"] == "fail"


async def test_a_workers_own_nats_user_is_enough_to_check_its_streams(tmp_path: Path) -> None:
    """On Kubernetes `pdserve doctor` runs in a worker pod with that worker's user: it reads
    the streams and its model's consumers by name, which the role may."""
    from pdserve.broker.credentials import ADMIN, EmbeddedCredentials
    from pdserve.broker.server import start_nats_server

    credentials = EmbeddedCredentials.create(tmp_path / "auth", ["api-1"])
    server = start_nats_server(tmp_path / "nats", users=credentials.entries())
    try:
        nc = await connect(server.url, "test", credentials.auth(ADMIN))
        await ensure_model(nc.jetstream(), MODEL, BrokerConfig())
        await worker_bucket(nc.jetstream(), BrokerConfig())
        await nc.close()
        password = EmbeddedCredentials.password_file(credentials.directory, "prefill")
        code, findings = await asyncio.to_thread(
            doctor,
            *("--nats-url", server.url, "--nats-user", "prefill", "--nats-password-file", str(password)),
            *("--served-model-name", MODEL, "--data-dir", str(tmp_path)),
        )
    finally:
        server.stop()
    found = by_check(findings)
    assert code == 0 and found["jetstream"]["status"] == "ok"
    assert all(found[f"stream {name}"]["status"] == "ok" for name in (subjects.REQUEST_STREAM, subjects.KV_STREAM))
    for stream, consumer in (
        (subjects.REQUEST_STREAM, subjects.prefill_consumer),
        (subjects.KV_STREAM, subjects.decode_consumer),
    ):
        assert found[f"consumer {stream}/{consumer(MODEL)}"]["status"] == "ok"
