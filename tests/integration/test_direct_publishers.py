"""Direct NATS publishers (docs/protocol.md) against the whole system as `pdserve up` runs it,
with its embedded broker's users on: a plain nats-py script with no pdserve code, the
`nats` command-line tool where it is installed, and the client library (`pdserve.client`),
each connected as a user made with `--nats-client`."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.client import Client, RequestTimeout, generate

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAW, LIB = "raw-publisher", "lib-client"


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, system_control: Any) -> Iterator[Any]:
    start, stop = system_control
    home = tmp_path_factory.mktemp("direct")
    system = start(home, tiny_model_dir, None, "--nats-client", RAW, "--nats-client", LIB)
    system.auth_dir = home / "data" / "nats" / "auth"
    yield system
    stop(system)


def password(system: Any, user: str) -> str:
    return (system.auth_dir / f"{user}.password").read_text().strip()


def reference(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


async def connect_raw(system: Any) -> Any:
    """nats-py as the raw publisher's user, nothing of pdserve."""
    return await nats.connect(system.nats_url, user=RAW, password=password(system, RAW), inbox_prefix=f"_INBOX.{RAW}")


async def client(system: Any, **options: Any) -> Client:
    return await Client.connect(
        system.nats_url,
        system.model_name,
        user=LIB,
        password=password(system, LIB),
        tokenizer=system.model_dir,
        **options,
    )


async def settled(url: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The workers once none holds a request or a page (or as they are after ``timeout``)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        deadline = time.monotonic() + timeout
        while True:
            workers = (await http.get("/workers")).json()
            idle = all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in workers)
            if idle or time.monotonic() > deadline:
                return list(workers)
            await asyncio.sleep(0.2)


# ---- no pdserve code: the example script and raw JSON --------------------------------
def test_the_plain_nats_py_example_gets_the_greedy_answer(system: Any) -> None:
    prompt = [17, 256, 999, 42, 7, 3000, 12]
    argv = [
        sys.executable,
        str(ROOT / "examples" / "nats_request.py"),
        "--nats-url", system.nats_url,
        "--model", system.model_name,
        "--prompt-ids", ",".join(map(str, prompt)),
        "--max-new-tokens", "20",
        "--ignore-eos",
        "--user", RAW,
        "--password-file", str(system.auth_dir / f"{RAW}.password"),
    ]  # fmt: skip
    # The example must run with nats-py alone: prove it imports nothing of pdserve.
    code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    check = "import sys; assert not [m for m in sys.modules if m.startswith('pdserve')], 'imports pdserve'"
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\n{check}", *argv[1:]], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 20 and result["usage"]["prompt_tokens"] == len(prompt)
    assert result["output_ids"] == reference(system.model_dir, prompt, 20)
    assert "seq 0:" in done.stderr  # it streamed: the first token came on its own chunk


async def _raw_request(system: Any, payload: dict[str, Any], timeout: float = 60) -> list[dict[str, Any]]:
    """Publish ``payload`` (raw JSON) to the request subject and collect its chunks up to the last."""
    nc = await connect_raw(system)
    chunks: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_chunk(msg: Any) -> None:
        await chunks.put(json.loads(msg.data))

    try:
        await nc.subscribe(payload["reply_to"], cb=on_chunk)
        ack = await nc.jetstream().publish(
            f"pd.req.{system.model_name}", json.dumps(payload).encode(), headers={"Nats-Msg-Id": payload["rid"]}
        )
        assert ack.stream == "PD_REQUESTS" and not ack.duplicate
        got = []
        while not (got and got[-1].get("finish_reason")):
            got.append(await asyncio.wait_for(chunks.get(), timeout))
        return got
    finally:
        await nc.close()


async def test_an_old_minor_message_and_a_newer_minor_one_are_both_served(system: Any) -> None:
    """The required fields alone (a publisher of an older minor version), and the same with
    a field no receiver knows yet (a newer one): both answered in full."""
    prompt = [5, 6, 7, 8]
    want = reference(system.model_dir, prompt, 6)
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    for newer in ({}, {"priority": "high", "sampling": {**sampling, "speculate": 4}}):
        rid = uuid.uuid4().hex
        payload = {
            "v": 1,
            "rid": rid,
            "model": system.model_name,
            "prompt_ids": prompt,
            "reply_to": f"pd.tokens.{RAW}.{rid}",
        }
        chunks = await _raw_request(system, {**payload, "sampling": sampling, **newer})
        with_tokens = [c for c in chunks if c.get("token_ids")]
        assert [t for c in with_tokens for t in c["token_ids"]] == want, newer
        assert [c["seq"] for c in with_tokens] == sorted(c["seq"] for c in with_tokens)
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_an_unknown_major_version_gets_an_error_reply_and_is_not_kept(system: Any) -> None:
    rid = uuid.uuid4().hex
    payload = {
        "v": 2,
        "rid": rid,
        "model": system.model_name,
        "prompt_ids": [1, 2],
        "reply_to": f"pd.tokens.{RAW}.{rid}",
    }
    (chunk,) = await _raw_request(system, payload, timeout=30)
    assert chunk["rid"] == rid and chunk["finish_reason"] == "error"
    assert chunk["error"]["code"] == "unsupported_version"
    assert chunk["error"]["type"] == "invalid_request_error"
    assert "unsupported version 2 (expected 1)" in chunk["error"]["message"]
    # terminated, not left to be redelivered: gone well within the consumer's ack wait (10 s)
    # (the error reply may reach us a moment before the server has taken the worker's term)
    assert await _stream_is_empty(system, within=3.0)


async def test_a_token_outside_the_vocabulary_fails_that_request_alone(system: Any) -> None:
    """The API checks token ids; a direct publisher's reach the engine as sent. One bad id
    must be that request's error, not a failed forward pass for everything batched with it."""
    rids = [uuid.uuid4().hex for _ in range(3)]
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    prompts = [[1, 2, 3], [1, 10**9, 3], [4, 5, 6]]
    results = await asyncio.gather(
        *(
            _raw_request(
                system,
                {
                    "v": 1,
                    "rid": r,
                    "model": system.model_name,
                    "prompt_ids": p,
                    "reply_to": f"pd.tokens.{RAW}.{r}",
                    "sampling": sampling,
                },
            )
            for r, p in zip(rids, prompts, strict=True)
        )
    )
    bad = results[1][-1]
    assert bad["finish_reason"] == "error" and bad["error"]["type"] == "invalid_request_error"
    assert f"token id {10**9} is outside the model's vocabulary" in bad["error"]["message"]
    for chunks, prompt in ((results[0], prompts[0]), (results[2], prompts[2])):
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["attempt"] == 0
        assert [t for c in chunks for t in c.get("token_ids", [])] == reference(system.model_dir, prompt, 8)


async def _stream_is_empty(system: Any, within: float = 0.0) -> bool:
    """Whether the request stream holds no message, now or at some moment ``within`` seconds."""
    admin = (system.auth_dir / "admin.password").read_text().strip()
    nc = await nats.connect(system.nats_url, user="admin", password=admin)
    try:
        deadline = time.monotonic() + within
        while True:
            info = await nc.jetstream().stream_info("PD_REQUESTS")
            if info.state.messages == 0 or time.monotonic() >= deadline:
                return info.state.messages == 0
            await asyncio.sleep(0.05)
    finally:
        await nc.close()


@pytest.mark.skipif(shutil.which("nats") is None, reason="the nats command-line tool is not installed")
def test_the_nats_cli_example_from_the_docs(system: Any) -> None:
    """docs/protocol.md's `nats` commands: subscribe to the reply subject, publish the request."""
    rid = uuid.uuid4().hex
    auth = [
        "--server",
        system.nats_url,
        "--user",
        RAW,
        "--password",
        password(system, RAW),
        "--inbox-prefix",
        f"_INBOX.{RAW}",
    ]
    sub = subprocess.Popen(
        ["nats", *auth, "sub", f"pd.tokens.{RAW}.{rid}", "--count", "64", "--raw"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(1.0)
    request = {"v": 1, "rid": rid, "model": system.model_name, "prompt_ids": [1, 2, 3], "reply_to": f"pd.tokens.{RAW}.{rid}",
               "sampling": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    pub = subprocess.run(
        ["nats", *auth, "request", f"pd.req.{system.model_name}", json.dumps(request), "-H", f"Nats-Msg-Id:{rid}", "--raw"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert pub.returncode == 0 and "PD_REQUESTS" in pub.stdout, pub.stderr
    lines: list[dict[str, Any]] = []
    assert sub.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (lines and lines[-1].get("finish_reason")):
        line = sub.stdout.readline().strip()
        if line.startswith("{"):
            lines.append(json.loads(line))
    sub.kill()
    assert lines[-1]["finish_reason"] == "length"
    assert [t for c in lines for t in c.get("token_ids", [])] == reference(system.model_dir, [1, 2, 3], 4)


# ---- the client library -------------------------------------------------------------
async def test_the_client_streams_token_ids_and_text_equal_to_transformers(system: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(system.model_dir)
    prompts = [[11, 12, 13, 14, 15], tokenizer.encode("Serving systems split the work")]
    async with await client(system) as c:
        ids_pieces = [p async for p in c.stream(prompts[0], max_new_tokens=24, temperature=0, ignore_eos=True)]
        by_text = await c.generate("Serving systems split the work", max_new_tokens=24, temperature=0, ignore_eos=True)
        both = await asyncio.gather(
            *(
                c.generate(p, max_new_tokens=n, temperature=0, ignore_eos=True)
                for p, n in zip(prompts, (9, 31), strict=True)
            )
        )
    assert len(ids_pieces) > 1 and all(p.finish_reason is None for p in ids_pieces[:-1])  # streamed
    assert ids_pieces[-1].finish_reason == "length" and ids_pieces[-1].usage is not None
    got = [t for p in ids_pieces for t in p.token_ids]
    assert got == reference(system.model_dir, prompts[0], 24)
    assert list(by_text.token_ids) == reference(system.model_dir, prompts[1], 24)
    assert by_text.text == tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    assert by_text.usage is not None and by_text.usage.prompt_tokens == len(prompts[1])
    assert [list(b.token_ids) for b in both] == [
        reference(system.model_dir, p, n) for p, n in zip(prompts, (9, 31), strict=True)
    ]


async def test_the_synchronous_call(system: Any) -> None:
    done = await asyncio.to_thread(
        generate,
        [21, 22, 23],
        nats_url=system.nats_url,
        model=system.model_name,
        user=LIB,
        password=password(system, LIB),
        max_new_tokens=5,
        temperature=0,
        ignore_eos=True,
    )
    assert list(done.token_ids) == reference(system.model_dir, [21, 22, 23], 5)
    assert done.finish_reason == "length" and done.attempts == 1


async def test_leaving_a_stream_cancels_it_and_frees_both_workers(system: Any) -> None:
    rid = uuid.uuid4().hex
    async with await client(system) as c:
        seen = 0
        async for piece in c.stream([3, 4, 5], rid=rid, max_new_tokens=3000, ignore_eos=True):
            seen += len(piece.token_ids)
            if seen >= 5:
                break
        # The workers' cancel line first: a heartbeat sent before the request reached a
        # worker also reads idle, so settled() alone could return before the cancel arrived.
        cancelled = f'request cancelled rid={rid} reason="client stopped reading"'
        deadline = time.monotonic() + 30
        while cancelled not in system.log() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert cancelled in system.log()
        workers = await settled(system.url)
    assert all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in workers), workers


async def test_cancel_by_request_id_ends_the_stream_with_abort(system: Any) -> None:
    async with await client(system) as c:
        pieces = []
        async for piece in c.stream([8, 9], rid="cancel-me", max_new_tokens=3000, ignore_eos=True):
            pieces.append(piece)
            if len(pieces) == 3:
                await c.cancel("cancel-me")
        workers = await settled(system.url)
    assert pieces[-1].finish_reason == "abort" and len(pieces) == 4
    assert all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in workers), workers
    assert 'request cancelled rid=cancel-me reason="cancelled by the client"' in system.log()


async def test_a_timeout_raises_cancels_and_frees_the_workers(system: Any) -> None:
    rid = uuid.uuid4().hex
    async with await client(system) as c:
        started = time.monotonic()
        tokens = 0
        with pytest.raises(RequestTimeout):
            async for piece in c.stream([9, 10, 11], rid=rid, max_new_tokens=3000, ignore_eos=True, timeout=1.5):
                tokens += len(piece.token_ids)
        elapsed = time.monotonic() - started
        workers = await settled(system.url)
    assert tokens > 0 and 1.4 < elapsed < 5.0, (tokens, elapsed)
    assert all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in workers), workers
    assert f"request cancelled rid={rid}" in system.log()
