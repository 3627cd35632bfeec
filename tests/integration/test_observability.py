"""Observability end to end against a real ``pdserve up``: one trace per request across
the API, prefill and decode processes (spans exported over OTLP/HTTP to a receiver in
this test), ``/metrics`` that parses and moves, and the ``/dashboard`` page in headless
Chromium."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families

from pdserve.broker import tracing

pytestmark = pytest.mark.slow


@dataclass
class Span:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    start_ns: int
    end_ns: int


@dataclass
class Receiver:
    """An OTLP/HTTP trace receiver: every span POSTed to ``url/v1/traces``."""

    url: str = ""
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attributes = {a.key: _value(a.value) for a in s.attributes}
                    span = Span(
                        s.name,
                        resource.get("service.name", ""),
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        attributes,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                    )
                    with self.lock:
                        self.spans.append(span)

    def of_request(self, rid: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.attributes.get("pdserve.rid") == rid]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    received = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces":
                received.take(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    received.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield received
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def traced_system(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, nats_for_module, receiver: Receiver, system_control
) -> Iterator[Any]:
    """``pdserve up`` (1 prefill + 1 decode) exporting spans to :func:`receiver`."""
    start, stop = system_control
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    system = start(tmp_path_factory.mktemp("traced"), tiny_model_dir, nats_for_module.url, env=env)
    yield system
    stop(system)


def _generate(system: Any, rid: str, prompt: list[int], max_new_tokens: int = 8) -> dict[str, Any]:
    body = {
        "rid": rid,
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(system.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_one_trace_holds_every_stage_of_each_request(traced_system: Any, receiver: Receiver) -> None:
    prompts = {f"traced-{i}": [5 + i, *range(100, 140 + 7 * i)] for i in range(4)}
    for rid, prompt in prompts.items():
        _generate(traced_system, rid, prompt)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all({s.name for s in receiver.of_request(rid)} >= set(tracing.STAGES) for rid in prompts):
            break
        time.sleep(0.2)
    for rid, prompt in prompts.items():
        spans = {s.name: s for s in receiver.of_request(rid)}
        assert set(spans) >= set(tracing.STAGES), f"{rid}: only {sorted(spans)}"
        root = spans[tracing.HTTP_REQUEST]
        assert {s.trace_id for s in spans.values()} == {root.trace_id}
        for name in tracing.STAGES[1:]:
            assert spans[name].parent_id == root.span_id, name
            assert root.start_ns <= spans[name].start_ns <= spans[name].end_ns <= root.end_ns, name
        assert root.service == "pdserve-api"
        assert spans[tracing.PREFILL].service == "pdserve-prefill"
        assert spans[tracing.DECODE].service == "pdserve-decode"
        assert spans[tracing.PREFILL].attributes["pdserve.tokens_in"] == len(prompt)
        assert spans[tracing.KV_TRANSFER].attributes["pdserve.bytes"] > 0
        assert spans[tracing.KV_TRANSFER].attributes["pdserve.ok"] is True
        assert spans[tracing.DECODE].attributes["pdserve.tokens_out"] == 8
        assert root.attributes["pdserve.tokens_out"] == 8
        assert root.attributes["http.response.status_code"] == 200
    # The stages follow one another: prefill's queue, prefill, decode's queue, the pull, decode.
    order = [spans[name].start_ns for name in tracing.STAGES[1:]]
    assert order == sorted(order)


def _scrape(system: Any) -> dict[str, list[Any]]:
    r = httpx.get(system.url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    families: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(r.text):
        families[family.name] = family.samples
    return families


def _value_of(families: dict[str, list[Any]], sample: str, **labels: str) -> float:
    name = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    return sum(
        s.value
        for s in families.get(name, [])
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_parse_and_move_as_requests_run(traced_system: Any) -> None:
    time.sleep(1.2)  # two heartbeats: the workers' counters of earlier requests reach the registry
    before = _scrape(traced_system)
    for family in ("pdserve_worker_info", "pdserve_kv_pages_total", "pdserve_queue_pending", "pdserve_ttft_seconds"):
        assert family in before, family
    roles = {s.labels["role"] for s in before["pdserve_worker_info"]}
    assert roles == {"prefill", "decode"}
    assert all(s.value > 0 for s in before["pdserve_kv_pages_total"])
    stages = {s.labels["stage"] for s in before["pdserve_queue_oldest_age_seconds"]}
    assert stages == {"prefill", "urgent", "decode", "urgent_decode"}
    for i in range(3):
        _generate(traced_system, f"metered-{i}", [7, *range(200, 264)], max_new_tokens=16)
    time.sleep(1.2)
    after = _scrape(traced_system)

    def moved(sample: str, **labels: str) -> float:
        return _value_of(after, sample, **labels) - _value_of(before, sample, **labels)

    assert moved("pdserve_requests_finished_total", outcome="length") == 3
    assert moved("pdserve_output_tokens_total") == 48
    assert moved("pdserve_ttft_seconds_count") == 3
    assert moved("pdserve_itl_seconds_count") == 45
    assert moved("pdserve_e2e_seconds_count") == 3
    assert moved("pdserve_prompt_tokens_total", role="prefill") == 3 * 65
    assert moved("pdserve_prefix_cache_hit_tokens_total", role="prefill") > 0  # the same prompt, three times
    assert moved("pdserve_kv_pulls_total", role="decode") == 3
    assert moved("pdserve_kv_transfer_bytes_total", role="decode") > 0
    assert moved("pdserve_generated_tokens_total", role="decode") == 3 * 15
    assert moved("pdserve_engine_steps_total", role="decode") > 0
    assert _value_of(after, "pdserve_requests_in_flight") == 0


def test_dashboard_shows_workers_queues_and_latency_in_chromium(traced_system: Any, tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    assert chromium is not None, "Debian's chromium is needed (`make install` installs it)"
    for i in range(2):
        _generate(traced_system, f"dashboard-{i}", [9, *range(300, 340)], max_new_tokens=12)
    argv = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        traced_system.url + "/dashboard",
    ]
    dom = subprocess.run(argv, capture_output=True, text=True, timeout=90, check=True).stdout
    assert 'id="status" class="">updated' in dom, dom[-2000:]
    assert dom.count('data-role="prefill"') == 1 and dom.count('data-role="decode"') == 1
    assert 'data-stage="prefill"' in dom and 'data-stage="decode"' in dom
    row = dom.split('data-kind="ttft"', 1)[1].split("</tr>", 1)[0]
    assert "–" not in row, row  # every TTFT percentile has a value
    assert 'data-kind="itl"' in dom and "<rect" in dom


async def test_a_worker_serves_its_own_metrics_on_its_port(workers) -> None:
    from pdserve.health import serve_health

    worker = await workers("prefill")
    server = await serve_health(worker, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            r = await client.get("/metrics")
            health = await client.get("/health")
    finally:
        server.close()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f.samples for f in text_string_to_metric_families(r.text)}
    (info,) = families["pdserve_worker_info"]
    assert info.labels["worker"] == worker.worker_id and info.labels["role"] == "prefill"
    (pages,) = families["pdserve_kv_pages_total"]
    assert pages.value == worker.engine.pages.num_pages
    assert "pdserve_batch_size" in families and "pdserve_kv_transfer_duration_seconds" in families
    assert health.json()["worker_id"] == worker.worker_id


async def test_a_colocated_process_serves_both_workers_health_and_metrics_on_one_port(workers) -> None:
    from pdserve.health import serve_health

    prefill, decode = await workers("prefill"), await workers("decode")
    server = await serve_health([prefill, decode], "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            r = await client.get("/metrics")
            health = await client.get("/health")
            decode.stopping.set()  # one of the pair stopping: the process is not healthy
            stopping = await client.get("/health")
    finally:
        server.close()
    families = {f.name: f.samples for f in text_string_to_metric_families(r.text)}  # parses: one family a name
    info = {s.labels["role"]: s.labels["worker"] for s in families["pdserve_worker_info"]}
    assert info == {"prefill": prefill.worker_id, "decode": decode.worker_id}
    pages = {s.labels["role"]: s.value for s in families["pdserve_kv_pages_total"]}
    assert pages == {"prefill": prefill.engine.pages.num_pages, "decode": decode.engine.pages.num_pages}
    counts = {s.labels["role"] for s in families["pdserve_batch_size"] if s.name == "pdserve_batch_size_count"}
    assert counts == {"prefill", "decode"}
    assert health.status_code == 200
    assert [w["role"] for w in health.json()["workers"]] == ["prefill", "decode"]
    assert stopping.status_code == 503 and stopping.json()["status"] == "stopping"


def test_a_colocated_pair_traces_its_hand_off_and_serves_a_prefix_from_its_disk_tier(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, receiver: Receiver, system_control: Any
) -> None:
    """``up --colocate``: the in-process KV hand-off is a span of the request's one trace, and
    the KV tiers work in the pair (a prompt computed, the cache flushed, the same prompt served
    from the prefill worker's disk tier with the same tokens)."""
    start, stop = system_control
    home = tmp_path_factory.mktemp("colocated-traced")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    tiers = ["--kv-disk-dir", str(home / "kv"), "--kv-group-pages", "2", "--kv-tier-load", "always"]
    system = start(home, tiny_model_dir, None, "--colocate", "--enable-flush-cache", *tiers, env=env)
    try:
        prompt = [5, *range(100, 180)]  # five full pages: two groups of two
        first = _generate(system, "colocated-traced-0", prompt)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            names = {s.name for s in receiver.of_request("colocated-traced-0")}
            stored = _value_of(_scrape(system), "pdserve_kv_tier_stored_pages_total", role="prefill", tier="disk")
            if names >= set(tracing.STAGES) and stored >= 4:
                break
            time.sleep(0.2)
        spans = {s.name: s for s in receiver.of_request("colocated-traced-0")}
        assert set(spans) >= set(tracing.STAGES), sorted(spans)
        root = spans[tracing.HTTP_REQUEST]
        hand_off = spans[tracing.KV_TRANSFER]
        assert hand_off.trace_id == root.trace_id and hand_off.parent_id == root.span_id
        assert hand_off.attributes["pdserve.ok"] is True and hand_off.attributes["pdserve.bytes"] > 0
        assert stored >= 4  # the prompt's two groups written to the disk tier
        assert httpx.post(system.url + "/flush_cache", timeout=10).status_code == 200
        second = _generate(system, "colocated-traced-1", prompt)
        assert second["output_ids"] == first["output_ids"]
        time.sleep(1.2)  # two heartbeats: the hits reach the registry
        hits = _value_of(_scrape(system), "pdserve_kv_tier_hit_pages_total", role="prefill", tier="disk")
        assert hits >= 4
    finally:
        stop(system)
