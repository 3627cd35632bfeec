"""Supervised worker tasks: a loop that fails ends the worker, and its process exits
non-zero with its registry entry gone (no zombie that heartbeats with a dead loop)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.broker.connection import connect
from pdserve.broker.registry import WorkerRegistry
from pdserve.broker.streams import BrokerConfig, worker_bucket
from pdserve.launch import EXIT_CRASHED
from pdserve.schemas import WorkerInfo
from pdserve.workers.config import WorkerConfig
from pdserve.workers.lifecycle import Lifecycle


def _lifecycle(tmp_path: Path) -> Lifecycle:
    config = WorkerConfig(role="unified", model_path=tmp_path, model_name="m", nats_url="nats://127.0.0.1:1")

    def info() -> WorkerInfo:
        raise AssertionError("not called")

    return Lifecycle(config, info)


async def test_a_failing_task_stops_the_worker(tmp_path: Path) -> None:
    life = _lifecycle(tmp_path)

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("boom")

    life.supervise(fails())
    await asyncio.wait_for(life.stopping.wait(), 2)
    assert life.crashed is not None and "boom" in life.crashed


async def test_a_loop_that_returns_early_is_a_failure_but_not_after_stop(tmp_path: Path) -> None:
    life = _lifecycle(tmp_path)

    async def returns() -> None:
        return None

    await life.supervise(returns(), loop=True)
    await asyncio.sleep(0)
    assert life.crashed is not None and "returned" in life.crashed

    calm = _lifecycle(tmp_path)
    calm.stopping.set()
    await calm.supervise(returns(), loop=True)
    await asyncio.sleep(0)
    assert calm.crashed is None


FAILING_WORKER = """
import asyncio, sys
from pdserve.workers.intake import Intake

async def failing_run(self, stopping):
    await asyncio.sleep(1.0)
    raise RuntimeError("injected intake failure")

Intake.run = failing_run
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(180)
async def test_a_failing_loop_ends_the_worker_process(nats_server, tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-c",
        FAILING_WORKER,
        "unified",
        "--model-path",
        str(tiny_model_dir),
        "--nats-url",
        nats_server.url,  # type: ignore[attr-defined]
        "--data-dir",
        str(tmp_path),
        "--max-total-tokens",
        "2048",
        "--heartbeat-seconds",
        "0.2",
        "--worker-id",
        "doomed-worker",
    ]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 150)
    text = out.decode(errors="replace")
    assert proc.returncode == EXIT_CRASHED, text
    assert "worker ready" in text and "injected intake failure" in text
    nc = await connect(nats_server.url, "lifecycle-test")  # type: ignore[attr-defined]
    try:
        js = nc.jetstream()
        registry = WorkerRegistry(await worker_bucket(js, BrokerConfig()), js)
        assert [w.worker_id for w in await registry.list()] == []
    finally:
        await nc.close()
