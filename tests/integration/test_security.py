"""Security of the whole system as `pdserve up` runs it with its own broker (users and
permissions on), API keys and limits: 401 everywhere but /health, 413 at once for a 30 MB
body, 429 past a key's concurrency, the HTTP API fuzzed against its own OpenAPI description,
1,000 malformed messages on the request subject while valid requests complete, and no
permission violation on the broker from pdserve's own processes."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import nats
import orjson
import pytest

from pdserve.broker import subjects
from pdserve.broker.credentials import embedded_auth

pytestmark = pytest.mark.slow

KEYS = [f"test-key-{i}-c4f1e0" for i in range(8)]
MAX_OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, system_control: Any) -> Iterator[Any]:
    start_system, stop_system = system_control
    home = tmp_path_factory.mktemp("secured")
    key_file = home / "keys"
    key_file.write_text("# one key a line\n" + "\n".join(KEYS) + "\n")
    key_file.chmod(0o600)
    limits = ("--max-output-tokens", str(MAX_OUTPUT_TOKENS), "--max-concurrent-requests", "1")
    system = start_system(home, tiny_model_dir, None, "--api-key-file", str(key_file), *limits)
    system.home = home
    yield system
    stop_system(system)


def _auth(i: int = 0) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[i]}"}


def _operations(system: Any) -> list[tuple[str, str]]:
    document = httpx.get(system.url + "/openapi.json", headers=_auth(), timeout=10).json()
    return [(method.upper(), path) for path, item in document["paths"].items() for method in item]


def test_every_route_but_health_needs_a_key(secured: Any) -> None:
    operations = _operations(secured)
    assert {path for _, path in operations} >= {"/generate", "/v1/completions", "/workers", "/metrics", "/dashboard"}
    for method, path in [*operations, ("GET", "/no-such-route")]:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {KEYS[0]}"},
            {"x-api-key": "wrong"},
            {"x-api-key": f"Bearer {KEYS[0]}"},
        ):
            response = httpx.request(method, secured.url + path, headers=headers, json={}, timeout=10)
            if path == "/health":
                assert response.status_code == 200
                continue
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
    # Anthropic's clients send the key as x-api-key
    assert httpx.get(secured.url + "/workers", headers={"x-api-key": KEYS[2]}, timeout=10).status_code == 200
    listing = httpx.get(secured.url + "/workers", headers=_auth(3), timeout=10).json()
    assert listing and all(w["transfer_endpoint"] for w in listing)


def _content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_a_30_mb_body_gets_413_at_once(secured: Any) -> None:
    url = urlsplit(secured.url)
    size = 30 << 20
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {KEYS[1]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
    started = time.monotonic()
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(head)
        sent, piece = 0, b"x" * (1 << 20)
        while sent < size and not select.select([s], [], [], 0)[0]:
            try:
                s.sendall(piece)
            except OSError:
                break
            sent += len(piece)
        answer = s.recv(4096)
        while b"\r\n\r\n" in answer and len(answer.partition(b"\r\n\r\n")[2]) < _content_length(answer):
            more = s.recv(4096)  # the body may come in a segment of its own
            if not more:
                break
            answer += more
    seconds = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
    assert b"body_too_large" in answer
    assert seconds < 2.0
    assert sent < size  # refused before the body was all sent


async def test_a_key_past_its_concurrency_gets_429(secured: Any) -> None:
    body = {"model": secured.model_name, "prompt": "hello", "max_tokens": MAX_OUTPUT_TOKENS, "stream": True}
    body["ignore_eos"] = True
    async with httpx.AsyncClient(base_url=secured.url, timeout=30) as client:
        async with client.stream("POST", "/v1/completions", json=body, headers=_auth(2)) as first:
            assert first.status_code == 200
            lines = first.aiter_lines()
            await anext(lines)  # the first event: the request is in flight
            # several at once with the same key: past its one slot whether or not the first has
            # finished meanwhile (its 8 tokens can all be sent before the next request arrives)
            agains = await asyncio.gather(
                *(client.post("/v1/completions", json=body, headers=_auth(2)) for _ in range(4))
            )
            other = await client.post("/v1/completions", json={**body, "stream": False}, headers=_auth(4))
            rest = [line async for line in lines]
    assert "data: [DONE]" in rest
    limited = [r for r in agains if r.status_code == 429]
    assert len(limited) >= 3 and all(r.status_code == 200 for r in agains if r not in limited)
    for again in limited:
        assert again.headers["retry-after"] == "1" and again.json()["error"]["type"] == "rate_limit_error"
    assert other.status_code == 200
    over = {**body, "max_tokens": MAX_OUTPUT_TOKENS + 1, "stream": False}
    refused = httpx.post(secured.url + "/v1/completions", json=over, headers=_auth(2), timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "max_tokens_too_large"


def test_the_api_survives_a_fuzz_run_against_its_openapi_description(secured: Any, tmp_path: Path) -> None:
    """Schemathesis, a bounded run (well under a minute here): no 5xx, everything the
    description calls invalid answered with a 4xx, responses as documented."""
    st = Path(sys.executable).parent / "st"
    checks = "not_a_server_error,negative_data_rejection,status_code_conformance,content_type_conformance"
    argv = [
        str(st),
        "run",
        secured.url + "/openapi.json",
        "-H",
        f"Authorization: Bearer {KEYS[5]}",
        "--checks",
        checks + ",response_schema_conformance,unsupported_method",
        "--phases",
        "coverage,fuzzing",
        "--max-examples",
        "8",
        "--suppress-health-check",
        "all",
        "--no-color",
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "failure" not in result.stdout.splitlines()[-1], result.stdout[-6000:]


async def test_malformed_messages_on_the_request_subject_leave_workers_serving(secured: Any) -> None:
    """1,000 malformed messages published straight to the request stream (with the API's own
    broker credentials) while 16 valid requests run: every valid one completes, no worker
    restarts, and the malformed ones are all taken off the stream."""
    workers_before = {w["id"] for w in httpx.get(secured.url + "/workers", headers=_auth(), timeout=10).json()}
    api_user = next(p.stem for p in (secured.home / "data" / "nats" / "auth").glob("api-*.password"))
    auth = embedded_auth(secured.home / "data" / "nats" / "auth", api_user)
    nc = await nats.connect(secured.nats_url, **auth.options())
    subject = subjects.requests(secured.model_name)
    shapes = [
        b"",
        b"\x00\xff garbage",
        b"[1, 2, 3]",
        b'{"v": 1}',
        b'{"v": 99, "rid": "x", "reply_to": "pd.tokens.nobody.x"}',
        orjson.dumps({"v": 1, "rid": "bad", "model": 5, "prompt_ids": "no", "reply_to": "pd.tokens.nobody.bad"}),
        b'{"rid": ' + b"[" * 500 + b"]" * 500 + b"}",
        json.dumps({"v": 1, "rid": "big", "prompt_ids": list(range(5000))}).encode(),
    ]

    async def flood() -> None:
        for i in range(1000):
            await nc.publish(subject, shapes[i % len(shapes)])
            if i % 100 == 99:
                await nc.flush()
        await nc.flush()

    async def valid(i: int, client: httpx.AsyncClient) -> dict[str, Any]:
        body = {"text": f"request {i}", "max_new_tokens": MAX_OUTPUT_TOKENS, "ignore_eos": True}
        response = await client.post("/generate", json=body, headers=_auth(i % len(KEYS)))
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    async with httpx.AsyncClient(base_url=secured.url, timeout=120) as client:

        async def per_key(k: int) -> list[dict[str, Any]]:
            return [await valid(k + n * len(KEYS), client) for n in range(2)]  # one at a time per key

        results, _ = await asyncio.gather(asyncio.gather(*(per_key(k) for k in range(len(KEYS)))), flood())
    done = [r for group in results for r in group]
    assert len(done) == 16 and all(len(r["output_ids"]) == MAX_OUTPUT_TOKENS for r in done)
    js = nc.jetstream()
    deadline = time.monotonic() + 60
    while (await js.consumer_info(subjects.REQUEST_STREAM, subjects.prefill_consumer(secured.model_name))).num_pending:
        assert time.monotonic() < deadline, "malformed messages still waiting"
        await asyncio.sleep(0.2)
    await nc.close()
    workers_after = {w["id"] for w in httpx.get(secured.url + "/workers", headers=_auth(), timeout=10).json()}
    assert workers_after == workers_before
    assert "child process exited" not in secured.log()


def test_pdserve_itself_stays_within_its_broker_permissions(secured: Any) -> None:
    """After everything above, the broker logged no permission violation by any process."""
    log = (secured.home / "data" / "nats" / "nats-server.log").read_text(errors="replace")
    assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line][:5]
