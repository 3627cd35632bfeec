"""End to end: HTTP → NATS JetStream → prefill → Mooncake → decode → SSE, all real."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import orjson
import pytest
import regex
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.broker import subjects
from pdserve.schemas import GenerateRequest, TokenChunk

pytestmark = pytest.mark.slow


def sse_events(lines: list[str]) -> list[Any]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append("[DONE]" if data == "[DONE]" else orjson.loads(data))
    return events


async def stream_post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events([line async for line in r.aiter_lines()])


def test_seed_curl_answers_with_32_tokens(pd_system) -> None:
    body = {"text": "請介紹一下你自己", "max_new_tokens": 32, "temperature": 0.7}
    r = httpx.post(pd_system.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["output_ids"]) == 32
    assert out["meta_info"]["completion_tokens"] == 32
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["prompt_tokens"] == len(
        AutoTokenizer.from_pretrained(pd_system.model_dir).encode("請介紹一下你自己")
    )
    assert isinstance(out["text"], str) and out["text"]


async def test_greedy_output_equals_transformers_for_concurrent_requests(pd_system) -> None:
    rng = random.Random(7)
    lengths = [5, 17, 40, 64, 100, 160, 255, 300, 420, 600]
    prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in lengths]
    max_new = [8, 40, 12, 33, 20, 16, 25, 9, 30, 14]
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=120) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    "/generate",
                    json={
                        "input_ids": p,
                        "sampling_params": {"max_new_tokens": m, "temperature": 0, "ignore_eos": True},
                    },
                )
                for p, m in zip(prompts, max_new, strict=True)
            )
        )
    got = [r.json()["output_ids"] for r in replies]
    model = AutoModelForCausalLM.from_pretrained(pd_system.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for p, m, ids in zip(prompts, max_new, got, strict=True):
            ref = model.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False)[
                0, len(p) :
            ].tolist()
            assert ids == ref


async def test_generate_streams_sse(pd_system) -> None:
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=60) as client:
        plain = (
            await client.post(
                "/generate", json={"text": "hello there", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
            )
        ).json()
        events = await stream_post(
            client,
            "/generate",
            {"text": "hello there", "stream": True, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
        )
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert len(events) >= 3  # streamed in pieces, not one blob
    assert last["output_ids"] == plain["output_ids"]
    assert last["text"] == plain["text"]
    assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]


async def test_the_benchmarks_lean_client_reads_the_api_like_httpx(pd_system) -> None:
    """bench/sse_client.py (what the e2e benchmarks drive the pipeline with) against the
    real API's chunked SSE: the events counted, the last one whole, keep-alive reused. The
    number of events is the server's choice (tokens that reach the API in one message go out
    as one event), so it is bounded by the tokens, not compared between two requests."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from sse_client import Connection, split_url

    body = {"text": "hello there", "stream": True, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=60) as client:
        events = await stream_post(client, "/generate", body)
    conn = Connection(*split_url(pd_system.url))
    try:
        first = await conn.stream("/generate", body)
        writer = conn.writer
        second = await conn.stream("/generate", body)
        assert conn.writer is writer
    finally:
        await conn.close()
    for got in (first, second):
        assert 1 <= got.events <= 12  # at most one event a token, [DONE] not counted
        assert got.last is not None
        for key in ("text", "output_ids"):
            assert got.last[key] == events[-2][key]
        assert got.last["meta_info"]["completion_tokens"] == 12
        assert got.sent < got.first <= got.ended


async def test_completions_stream_matches_non_stream_and_reports_usage(pd_system) -> None:
    body = {"model": pd_system.model_name, "prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0}
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=60) as client:
        plain = (await client.post("/v1/completions", json=body)).json()
        events = await stream_post(
            client, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
        )
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"] == plain["usage"]
    assert plain["usage"]["completion_tokens"] == 10


async def test_chat_applies_the_template_and_streams(pd_system) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "請介紹一下你自己"}]
    tok = AutoTokenizer.from_pretrained(pd_system.model_dir)
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert templated.endswith("<|im_start|>assistant\n")
    expected_prompt = len(tok.encode(templated, add_special_tokens=False))
    body = {"model": pd_system.model_name, "messages": messages, "max_tokens": 6, "temperature": 0}
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=60) as client:
        plain = (await client.post("/v1/chat/completions", json=body)).json()
        events = await stream_post(client, "/v1/chat/completions", {**body, "stream": True})
    assert plain["object"] == "chat.completion"
    assert plain["usage"]["prompt_tokens"] == expected_prompt
    assert plain["choices"][0]["message"]["role"] == "assistant"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == plain["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_stop_string_cuts_text_exactly(pd_system) -> None:
    body = {"model": pd_system.model_name, "prompt": "Serving systems", "max_tokens": 24, "temperature": 0}
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=60) as client:
        free = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        stop = next(
            free[i : i + 2]
            for i in range(4, len(free) - 2)
            if free[i : i + 2].strip() and "\ufffd" not in free[i : i + 2]
        )
        cut = (await client.post("/v1/completions", json={**body, "stop": [stop]})).json()
        events = await stream_post(client, "/v1/completions", {**body, "stop": stop, "stream": True})
    assert cut["choices"][0]["text"] == free[: free.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == free[: free.index(stop)]


async def test_a_stop_regex_cuts_the_text_before_its_match_through_the_pipeline(pd_system) -> None:
    """SGLang's ``stop_regex`` on /generate, whole and streamed: the text cut before the first
    match, the pattern named in ``finish_reason``; ``no_stop_trim`` keeps the match."""
    body = {"text": "Serving systems", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=60) as client:
        free = (await client.post("/generate", json=body)).json()["text"]
        stop = next(
            free[i : i + 2]
            for i in range(4, len(free) - 2)
            if free[i : i + 2].strip() and "\ufffd" not in free[i : i + 2]
        )
        pattern = f"{regex.escape(stop[0])}[{regex.escape(stop[1])}]+"
        params = {**body["sampling_params"], "stop_regex": [pattern]}
        cut = (await client.post("/generate", json={**body, "sampling_params": params})).json()
        kept = (
            await client.post("/generate", json={**body, "sampling_params": {**params, "no_stop_trim": True}})
        ).json()
        events = await stream_post(client, "/generate", {**body, "sampling_params": params, "stream": True})
    want = free[: free.index(stop)]
    assert cut["text"] == want
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert kept["text"].startswith(want + stop) and regex.fullmatch(pattern, kept["text"][len(want) :])
    assert events[-2]["text"] == want and events[-2]["meta_info"]["finish_reason"]["matched"] == pattern


async def _pages_settle(url: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        deadline = time.monotonic() + timeout
        while True:
            workers = (await client.get("/workers")).json()
            if (
                all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in workers)
                or time.monotonic() > deadline
            ):
                return workers


async def test_cancelled_stream_frees_pages_on_both_workers(pd_system) -> None:
    body = {
        "text": "a long answer please",
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    seen = 0
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=60) as client:
        async with client.stream("POST", "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 5:
                        break  # leaving the block closes the connection mid-stream
        busy = (await client.get("/workers")).json()
    assert any(w["role"] == "decode" for w in busy)
    workers = await _pages_settle(pd_system.url)
    assert {w["role"] for w in workers} == {"prefill", "decode"}
    assert all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in workers), workers
    assert "request cancelled" in pd_system.log()


async def test_health_models_and_workers(pd_system) -> None:
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=10) as client:
        health = await client.get("/health")
        models = (await client.get("/v1/models")).json()
        one = await client.get(f"/v1/models/{pd_system.model_name}")
        other = await client.get("/v1/models/no-such-model")
        workers = (await client.get("/workers")).json()
    assert health.status_code == 200 and health.json()["workers"] == {"prefill": 1, "decode": 1, "unified": 0}
    assert models["data"][0]["id"] == pd_system.model_name
    assert one.status_code == 200 and one.json() == models["data"][0]  # OpenAI's models.retrieve
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert pd_system.model_name in other.json()["error"]["message"]
    assert Path(models["data"][0]["root"]) == pd_system.model_dir.resolve()
    for w in workers:
        assert {"id", "role", "host", "pid", "capacity", "pages_total", "pages_used", "requests_in_flight"} <= set(w)
        assert w["pages_total"] > 0 and w["capacity"] > 0


async def _request_count(nats_url: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().stream_info(subjects.REQUEST_STREAM)
        return int(info.state.last_seq)
    finally:
        await nc.close()


BAD_BODIES = [
    ("/v1/completions", b"{not json", "invalid_json"),
    ("/v1/completions", b"[1, 2]", "invalid_json"),
    ("/v1/completions", {"model": "M", "prompt": 42}, None),
    ("/v1/completions", {"model": "M", "prompt": ""}, None),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 0}, None),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": "ten"}, None),
    ("/v1/completions", {"model": "M", "prompt": "hi", "temperature": "hot"}, None),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 10_000}, "context_length_exceeded"),
    ("/v1/completions", {"model": "M", "prompt": [5] * 5000}, "context_length_exceeded"),
    ("/v1/completions", {"model": "not-a-model", "prompt": "hi"}, "model_not_found"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, None),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, None),
    ("/generate", {"text": ""}, None),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, None),
    ("/generate", {"text": "hi", "max_new_tokens": 4096}, "context_length_exceeded"),
    ("/generate", {"input_ids": ["a"]}, None),
]


@pytest.mark.parametrize(("path", "body", "code"), BAD_BODIES)
async def test_bad_input_is_a_400_and_publishes_nothing(pd_system, path: str, body: Any, code: str | None) -> None:
    before = await _request_count(pd_system.nats_url)
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": pd_system.model_name}
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=10) as client:
        r = await client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    assert await _request_count(pd_system.nats_url) == before


async def test_malformed_nats_messages_get_an_error_reply_and_are_not_redelivered(pd_system) -> None:
    nc = await nats.connect(pd_system.nats_url)
    js = nc.jetstream()
    subject = subjects.requests(pd_system.model_name)
    replies: asyncio.Queue[TokenChunk] = asyncio.Queue()
    inbox = "pd.tokens.test.malformed"

    async def on_reply(msg: Any) -> None:
        await replies.put(TokenChunk.decode(msg.data))

    await nc.subscribe(inbox, cb=on_reply)
    try:
        await js.publish(subject, b"\x00garbage")
        await js.publish(
            subject,
            orjson.dumps(
                {"v": 1, "rid": "bad-types", "model": pd_system.model_name, "prompt_ids": "abc", "reply_to": inbox}
            ),
        )
        await js.publish(
            subject,
            orjson.dumps(
                {"v": 9, "rid": "bad-version", "model": pd_system.model_name, "prompt_ids": [1], "reply_to": inbox}
            ),
        )
        ok = GenerateRequest(rid="good-after-bad", model=pd_system.model_name, prompt_ids=(5, 6, 7), reply_to=inbox)
        await js.publish(subject, ok.encode())
        got: dict[str, list[TokenChunk]] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(c.finish_reason for c in got.get("good-after-bad", [])):
            chunk = await asyncio.wait_for(replies.get(), timeout=30)
            got.setdefault(chunk.rid, []).append(chunk)
        for rid in ("bad-types", "bad-version"):
            assert got[rid][0].finish_reason == "error" and got[rid][0].error is not None
            assert "malformed" in got[rid][0].error.message
        assert got["good-after-bad"][-1].finish_reason in ("length", "stop")
        info = await js.consumer_info(subjects.REQUEST_STREAM, subjects.prefill_consumer(pd_system.model_name))
        assert info.num_ack_pending == 0 and info.num_pending == 0
        await asyncio.sleep(1.0)
        assert replies.empty()  # nothing came back a second time
    finally:
        await nc.close()


async def test_a_body_over_the_limit_is_refused_at_once(pd_system) -> None:
    huge = b'{"text": "' + b"x" * (9 << 20) + b'"}'

    async def chunks() -> Any:
        for i in range(0, len(huge), 1 << 20):
            yield huge[i : i + (1 << 20)]

    async with httpx.AsyncClient(base_url=pd_system.url, timeout=30) as client:
        started = time.monotonic()
        r = await client.post("/generate", content=huge, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = await client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413  # no Content-Length: counted while reading
        assert time.monotonic() - started < 5


async def test_a_prompt_far_beyond_the_context_is_refused_without_tokenizing_it(pd_system) -> None:
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=30) as client:
        started = time.monotonic()
        r = await client.post("/generate", json={"text": "lorem ipsum " * 400_000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert time.monotonic() - started < 2


async def test_a_batch_of_too_many_prompts_is_refused(pd_system) -> None:
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=30) as client:
        r = await client.post("/generate", json={"input_ids": [[5, 6]] * 257})
    assert r.status_code == 400 and "at most 256" in r.json()["error"]["message"]


async def test_a_duplicate_request_id_is_a_409(pd_system) -> None:
    body = {"rid": "same-rid", "text": "hi", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=60) as client:
        first = asyncio.create_task(client.post("/generate", json=body))
        await asyncio.sleep(0.3)
        clash = await client.post("/generate", json=body)  # while the first runs
        assert (await first).status_code == 200
        again = await client.post("/generate", json=body)  # within the dedup window
    for r in (clash, again):
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "duplicate_request_id" and "same-rid" in r.json()["error"]["message"]


async def test_one_failing_prompt_does_not_fail_its_batch(pd_system) -> None:
    long = {"rid": "batchy-1", "text": "hold", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    rids = ["batchy-0", "batchy-1", "batchy-2"]
    batch = {"rid": rids, "text": ["one", "two", "three"], "sampling_params": {"max_new_tokens": 4}}
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=60) as client:
        holder = asyncio.create_task(client.post("/generate", json=long))
        await asyncio.sleep(0.3)
        r = await client.post("/generate", json=batch)  # its second prompt's id is taken
        await holder
    assert r.status_code == 200, r.text
    out = r.json()
    assert [len(o["output_ids"]) for o in out] == [4, 0, 4]
    assert [o["meta_info"]["id"] for o in out] == rids
    assert out[1]["error"]["code"] == "duplicate_request_id"
    assert out[1]["meta_info"]["finish_reason"]["type"] == "abort"


async def test_the_normal_path_pulls_every_prompt_and_recomputes_none(pd_system) -> None:
    """Runs after the tests above: every decoded request arrived by a KV pull. A pull that
    silently fell back to computing the prompt would show here."""
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=30) as client:
        r = await client.post("/generate", json={"text": "count the pulls", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200
        await asyncio.sleep(1.2)  # two heartbeats
        workers = (await client.get("/workers")).json()
    (decode,) = [w for w in workers if w["role"] == "decode"]
    (prefill,) = [w for w in workers if w["role"] == "prefill"]
    counters = decode["counters"]
    assert counters["kv_pulls"] >= 10 and counters["kv_pull_bytes"] > 0
    assert counters["recomputes"] == 0 and counters["kv_pull_failures"] == 0
    assert counters["kv_leases_refused"] == 0 and counters["migrations"] == 0
    assert decode["kv_layout"] == prefill["kv_layout"] and decode["transfer_protocol"] == "tcp"
    async with httpx.AsyncClient(base_url=pd_system.url, timeout=30) as client:
        stats = (await client.get("/health")).json()["requests"]
    assert stats["requests"] > 0 and stats["migrations"] == 0 and stats["migration_failures"] == 0
    # Decode's tokens came one message per step, not per request: the concurrent requests
    # above shared steps, so some batch carried several requests' chunks.
    assert stats["batches"] > 0 and stats["batched_chunks"] > stats["batches"]


async def test_several_api_processes_share_the_port(up: Any) -> None:
    """`--api-processes 2`: both listen on the one port, each with its own API id (fresh
    connections reach both), and requests through either complete."""
    system = up("--mode", "unified", "--api-processes", "2")
    ids = set()
    deadline = time.monotonic() + 30  # the second process may come up a little later
    while len(ids) < 2 and time.monotonic() < deadline:
        async with httpx.AsyncClient(base_url=system.url, timeout=10) as client:  # a fresh connection
            r = await client.get("/health")
            if r.status_code == 200:
                ids.add(r.json()["api_id"])
    assert len(ids) == 2, system.log()

    async def one(i: int) -> list[int]:
        async with httpx.AsyncClient(base_url=system.url, timeout=60) as client:
            body = {"input_ids": [5 + i, 6, 7], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
            r = await client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return list(r.json()["output_ids"])

    outputs = await asyncio.gather(*(one(i) for i in range(8)))
    assert all(len(out) == 6 for out in outputs)
