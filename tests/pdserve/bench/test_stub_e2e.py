"""End to end against the stub server over real loopback HTTP (no timing thresholds)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from pdserve.bench.cli import main
from pdserve.bench.config import BenchConfig
from pdserve.bench.runner import run_benchmark
from pdserve.bench.stub import StubServer


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "generate"])
async def test_in_process_run_against_stub(backend: str, tokenizer_dir: Path) -> None:
    async with StubServer(itl_ms=1.0) as stub:
        cfg = BenchConfig(
            base_url=f"http://127.0.0.1:{stub.port}",
            backend=backend,
            num_prompts=12,
            request_rate=200.0,
            input_len=16,
            output_len=5,
            quiet=True,
            save_requests=True,
            warmup=2,
            slo_ttft=60_000,
            slo_itl=60_000,
            tokenizer=str(tokenizer_dir) if backend == "generate" else None,
        )
        result = await run_benchmark(cfg)
        assert stub.served >= 12 + 2  # measured + warm-up (+ GET /v1/models)
    assert result["model"] == "stub-model"
    [point] = result["points"]
    m = point["metrics"]
    assert m["completed"] == 12 and m["failed"] == 0
    assert m["total_output_tokens"] == 12 * 5
    assert m["goodput_fraction"] == 1.0
    rows = point["requests"]
    assert len(rows) == 12
    for r in rows:
        assert r["ok"] and r["error"] is None
        assert 0 < r["ttft"] <= r["latency"]
        assert len(r["itl"]) == 4 and all(g >= 0 for g in r["itl"])  # one gap per later token event
        assert r["tpot"] is not None and r["tpot"] >= 0
        assert r["token_source"] == "server" and r["prompt_source"] == "server"
        assert r["start"] >= r["scheduled"] >= 0
    assert m["ttft_ms"]["p50"] <= m["e2e_latency_ms"]["p50"]
    assert m["send_lag_ms"]["count"] == 12
    if backend == "generate":
        assert rows[0]["prompt_tokens"] == 16  # exact token-id prompts
        assert set(m["server_timings_ms"]) == {"request_queue", "kv_queue"}


async def test_closed_loop_concurrency_and_errors() -> None:
    async with StubServer(tokens=3) as stub:
        url = f"http://127.0.0.1:{stub.port}"
        ok = await run_benchmark(
            BenchConfig(base_url=url, num_prompts=10, max_concurrency=2, input_len=8, output_len=3, quiet=True)
        )
        bad = await run_benchmark(
            BenchConfig(base_url=url, endpoint="/nope", num_prompts=3, input_len=8, output_len=3, quiet=True)
        )
    m = ok["metrics"]
    assert m["completed"] == 10 and "send_lag_ms" not in m  # lag is only meaningful open-loop
    b = bad["metrics"]
    assert b["completed"] == 0 and b["failed"] == 3
    assert list(b["errors"]) == ["HTTP 404: no route /nope"]


async def test_unreachable_server_records_errors() -> None:
    async with StubServer() as stub:
        port = stub.port
    cfg = BenchConfig(
        base_url=f"http://127.0.0.1:{port}", model="m", num_prompts=2, input_len=4, output_len=2, quiet=True
    )
    m = (await run_benchmark(cfg))["metrics"]
    assert m["failed"] == 2 and "ConnectError" in next(iter(m["errors"]))


def test_cli_sweep_json_and_plots(stub_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep.json"
    png = tmp_path / "sweep.png"
    rc = main(
        [
            "--base-url",
            stub_url,
            "--num-prompts",
            "8",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--sweep",
            "100,inf",
            "--output-json",
            str(out),
            "--save-requests",
            "--plot",
            str(png),
            "--slo-ttft",
            "100000",
            "--dataset",
            "prefix-chat",
            "--prefix-len",
            "32",
            "--turn-len",
            "8",
            "--num-groups",
            "2",
            "--num-turns",
            "2",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "sweep summary" in text
    data = json.loads(out.read_text())
    assert data["sweep"] == "request_rate"
    assert data["config"]["sweep"] == [100.0, "inf"]
    rates = [p["request_rate"] for p in data["points"]]
    assert rates == [100.0, "inf"]
    first = data["config"]["seed"]  # drawn for this run (no --seed given)
    assert [p["seed"] for p in data["points"]] == [first, first + 1]  # fresh prompts per point
    for p in data["points"]:
        assert p["metrics"]["completed"] == 8 and len(p["requests"]) == 8
        assert p["metrics"]["goodput"] > 0
        assert not math.isnan(p["metrics"]["ttft_ms"]["p99"])
    assert png.stat().st_size > 1000

    single = tmp_path / "single.json"
    assert (
        main(
            [
                "--base-url",
                stub_url,
                "--num-prompts",
                "4",
                "--input-len",
                "8",
                "--output-len",
                "2",
                "--quiet",
                "--backend",
                "openai-chat",
                "--output-json",
                str(single),
            ]
        )
        == 0
    )
    one = json.loads(single.read_text())
    assert one["metrics"]["completed"] == 4 and "requests" not in one["points"][0]
    assert capsys.readouterr().out == ""

    fig = tmp_path / "overlay.png"
    assert main(["plot", "--inputs", str(out), str(single), "--labels", "A", "B", "--out", str(fig)]) == 0
    assert fig.stat().st_size > 1000


def test_cli_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dataset", "sharegpt", "--quiet"]) == 2
    assert "--dataset-path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--request-rate", "0"])


async def test_request_timeout_is_applied() -> None:
    async with StubServer(ttft_ms=3000) as stub:
        cfg = BenchConfig(
            base_url=f"http://127.0.0.1:{stub.port}",
            num_prompts=2,
            input_len=4,
            output_len=2,
            request_timeout=0.2,
            quiet=True,
        )
        m = (await run_benchmark(cfg))["metrics"]
    assert m["failed"] == 2 and "ReadTimeout" in next(iter(m["errors"]))


async def test_runs_without_a_seed_draw_fresh_prompts_and_record_the_seed() -> None:
    """Two runs of the same command must not meet a warm prefix cache: each draws its own
    seed and records it; giving the recorded seed runs that workload again."""
    async with StubServer(tokens=2) as stub:
        cfg = BenchConfig(
            base_url=f"http://127.0.0.1:{stub.port}",
            backend="generate",
            num_prompts=3,
            input_len=16,
            output_len=2,
            quiet=True,
        )
        first, second = await run_benchmark(cfg), await run_benchmark(cfg)
        again = await run_benchmark(dataclasses.replace(cfg, seed=first["config"]["seed"]))
    seeds = [r["config"]["seed"] for r in (first, second, again)]
    assert isinstance(seeds[0], int) and seeds[0] != seeds[1] and seeds[2] == seeds[0]
    assert [p["seed"] for p in (first["points"][0], again["points"][0])] == [seeds[0], seeds[0]]
