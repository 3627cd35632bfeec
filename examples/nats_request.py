#!/usr/bin/env python3
"""One generation request to pdserve over NATS, with nats-py alone (no pdserve import).

Everything here follows docs/protocol.md; the JSON is the GenerateRequest of
schemas/json/GenerateRequest.json and the replies are TokenChunks (schemas/json/TokenChunk.json).

    python examples/nats_request.py --nats-url nats://127.0.0.1:4222 --model tiny-qwen2 \\
        --prompt-ids 1,2,3 --max-new-tokens 16 --temperature 0

With `pdserve up`'s embedded broker, connect as a user made with `--nats-client NAME`:

    --user NAME --password-file <data-dir>/nats/auth/NAME.password

Prints each chunk's tokens to stderr as they arrive and, at the end, one JSON line on stdout:
{"rid", "output_ids", "finish_reason", "stop_reason", "usage"}. Exits 1 on an error reply,
2 when the request stream stayed full, 3 on a timeout (the request is cancelled first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
import uuid

import nats
from nats.js.errors import APIError

STREAM_FULL = {10077, 10047, 10027, 10028}  # JetStream's "maximum messages/bytes exceeded" and kin


def subject_token(name: str) -> str:
    """A model name or id as one NATS subject token, as pdserve makes it."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


async def publish_request(js, subject: str, payload: bytes, rid: str, full_wait: float) -> None:
    """Publish into the PD_REQUESTS stream and wait for its ack; retry while the stream is full."""
    delay, give_up = 0.1, time.monotonic() + full_wait
    while True:
        try:
            ack = await js.publish(subject, payload, headers={"Nats-Msg-Id": rid}, timeout=5)
        except APIError as exc:
            if exc.err_code not in STREAM_FULL or time.monotonic() + delay > give_up:
                raise
            print(f"request stream full ({exc.description}); retrying in {delay:.1f}s", file=sys.stderr)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        if ack.duplicate:
            raise SystemExit(f"request id {rid} was already submitted (the stream's dedup window)")
        return


async def run(args: argparse.Namespace) -> int:
    options = {}
    client_id = args.client_id or args.user or f"example-{uuid.uuid4().hex[:6]}"
    if args.user:
        with open(args.password_file) as f:
            password = f.read().strip()
        # The broker lets a user read only its own inboxes: _INBOX.<user>.>
        options.update(user=args.user, password=password, inbox_prefix=f"_INBOX.{args.user}")
    nc = await nats.connect(args.nats_url, name=client_id, **options)
    js = nc.jetstream()

    rid = args.rid or uuid.uuid4().hex
    reply_to = f"pd.tokens.{subject_token(client_id)}.{subject_token(rid)}"
    chunks: asyncio.Queue[dict] = asyncio.Queue()

    async def on_chunk(msg) -> None:
        await chunks.put(json.loads(msg.data))

    await nc.subscribe(reply_to, cb=on_chunk)  # before publishing: core NATS keeps nothing

    now = time.time()
    request = {
        "v": 1,
        "rid": rid,
        "model": args.model,
        "prompt_ids": args.prompt_ids,
        "reply_to": reply_to,
        "sampling": {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
        },
        "deadline": now + args.timeout,
        "published_at": now,
    }
    try:
        await publish_request(
            js, f"pd.req.{subject_token(args.model)}", json.dumps(request).encode(), rid, args.full_wait
        )
    except APIError as exc:
        print(f"not accepted: {exc.description} (code {exc.err_code})", file=sys.stderr)
        await nc.close()
        return 2 if exc.err_code in STREAM_FULL else 1

    output: dict[int, int] = {}  # output index -> token: a chunk sent twice lands on the same keys
    end = time.monotonic() + args.timeout
    status = 0
    result: dict = {"rid": rid}
    while True:
        remaining = end - time.monotonic()
        try:
            chunk = await asyncio.wait_for(chunks.get(), max(remaining, 0.001))
        except TimeoutError:
            cancel = {"v": 1, "rid": rid, "reason": "timed out", "issued_at": time.time()}
            await nc.publish("pd.cancel", json.dumps(cancel).encode())
            print(f"timed out after {args.timeout}s; cancelled", file=sys.stderr)
            status = 3
            break
        if chunk.get("attempt", 0) != 0:
            continue  # another attempt's chunk (only migrating clients start those)
        if chunk.get("error"):
            error = chunk["error"]
            print(f"error: {error['message']} ({error.get('type')}, {error.get('code')})", file=sys.stderr)
            result["error"] = error
            status = 1
            break
        for i, token in enumerate(chunk.get("token_ids", [])):
            output[chunk["seq"] + i] = token
        if chunk.get("token_ids"):
            print(f"seq {chunk['seq']}: {chunk['token_ids']}", file=sys.stderr)
        if chunk.get("finish_reason"):
            result.update(finish_reason=chunk["finish_reason"], stop_reason=chunk.get("stop_reason"))
            result["usage"] = chunk.get("usage")
            break
    result["output_ids"] = [output[i] for i in sorted(output)]
    print(json.dumps(result))
    await nc.close()
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--model", required=True, help="the served model's name (pdserve up logs it)")
    parser.add_argument("--prompt-ids", required=True, type=lambda s: [int(t) for t in s.split(",")])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole request")
    parser.add_argument("--full-wait", type=float, default=10.0, help="seconds to keep retrying a full stream")
    parser.add_argument("--rid", help="request id (default: random)")
    parser.add_argument("--client-id", help="names the reply subject pd.tokens.<id>.<rid> (default: --user)")
    parser.add_argument("--user")
    parser.add_argument("--password-file")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
