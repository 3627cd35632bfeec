"""A stub OpenAI/SGLang-compatible streaming server that answers at once.

It exists to measure the benchmark client itself: against it, TTFT and latency are the
client's (and loopback's) own overhead, and the achieved request rate is the most the
client can drive. Raw asyncio HTTP/1.1 with keep-alive and chunked SSE; no framework, so
the stub costs as little CPU as possible.

Endpoints: ``POST /v1/completions``, ``/v1/chat/completions``, ``/generate`` (streaming or
not), ``GET /v1/models``, ``GET /health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from typing import Any

import orjson

DEFAULT_TOKENS = 16


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(obj: Any) -> bytes:
    return _chunk(b"data: " + orjson.dumps(obj) + b"\n\n")


_DONE = _chunk(b"data: [DONE]\n\n")
_END = b"0\r\n\r\n"
_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"


def _json_response(status: int, obj: Any) -> bytes:
    body = orjson.dumps(obj)
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}.get(status, b"Error")
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        reason,
        len(body),
        body,
    )


def _prompt_tokens(body: dict[str, Any]) -> int:
    for key in ("input_ids", "prompt", "text"):
        value = body.get(key)
        if isinstance(value, list):
            return len(value)
        if isinstance(value, str):
            return max(1, len(value) // 4)
    messages = body.get("messages")
    if isinstance(messages, list):
        return max(1, sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict)) // 4)
    return 0


class StubServer:
    """``tokens``: tokens per answer (None: the request's max_tokens / max_new_tokens, else
    16); ``ttft_ms`` before the first token, ``itl_ms`` between tokens (0: the whole answer
    in one write)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        tokens: int | None = None,
        itl_ms: float = 0.0,
        ttft_ms: float = 0.0,
        model: str = "stub-model",
    ) -> None:
        self.host = host
        self.port = port
        self.tokens = tokens
        self.itl = itl_ms / 1000.0
        self.ttft = ttft_ms / 1000.0
        self.model = model
        self.served = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._cache: dict[tuple[str, int], list[bytes]] = {}

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._conns):
                w.close()
            await self._server.wait_closed()

    async def __aenter__(self) -> StubServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- HTTP --------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return
                lines = head.split(b"\r\n")
                method, path, _ = lines[0].split(b" ", 2)
                length = 0
                close = False
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"connection" and value.strip().lower() == b"close":
                        close = True
                raw = await reader.readexactly(length) if length else b""
                await self._respond(method, path.split(b"?", 1)[0].decode(), raw, writer)
                self.served += 1
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._conns.discard(writer)
            writer.close()

    async def _respond(self, method: bytes, path: str, raw: bytes, writer: asyncio.StreamWriter) -> None:
        if method == b"GET":
            if path == "/health":
                writer.write(_json_response(200, {"status": "ok"}))
            elif path == "/v1/models":
                writer.write(
                    _json_response(
                        200,
                        {"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": 1 << 20}]},
                    )
                )
            else:
                writer.write(_json_response(404, {"error": {"message": f"no route {path}"}}))
            return
        if path not in ("/v1/completions", "/v1/chat/completions", "/generate"):
            writer.write(_json_response(404, {"error": {"message": f"no route {path}"}}))
            return
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            writer.write(_json_response(400, {"error": {"message": "invalid JSON"}}))
            return
        n = self._count(body)
        prompt = _prompt_tokens(body)
        if not body.get("stream"):
            writer.write(_json_response(200, self._whole(path, n, prompt)))
            return
        events = self._events(path, n)
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        tail: list[bytes] = []
        if path != "/generate" and (body.get("stream_options") or {}).get("include_usage"):
            obj = "chat.completion.chunk" if path == "/v1/chat/completions" else "text_completion"
            tail.append(_sse({"id": "stub", "object": obj, "model": self.model, "choices": [], "usage": usage}))
        if path == "/generate":
            final = {
                "text": "".join(f" t{i}" for i in range(n)),
                "output_ids": list(range(n)),
                "meta_info": {
                    "id": "stub",
                    "prompt_tokens": prompt,
                    "completion_tokens": n,
                    "cached_tokens": 0,
                    "finish_reason": {"type": "length", "length": n},
                    "timings": {"request_queue": 0.0, "kv_queue": 0.0},
                },
            }
            events = [*events[:-1], _sse(final)]
        tail += [_DONE, _END]
        if self.itl == 0 and self.ttft == 0:
            writer.write(b"".join([_SSE_HEAD, *events, *tail]))
            return
        writer.write(_SSE_HEAD)
        if self.ttft:
            await writer.drain()
            await asyncio.sleep(self.ttft)
        for i, ev in enumerate(events):
            if i and self.itl:
                await asyncio.sleep(self.itl)
            writer.write(ev)
            await writer.drain()
        writer.write(b"".join(tail))
        await writer.drain()

    def _count(self, body: dict[str, Any]) -> int:
        if self.tokens is not None:
            return self.tokens
        params = body.get("sampling_params") or {}
        for value in (body.get("max_tokens"), body.get("max_completion_tokens"), params.get("max_new_tokens")):
            if isinstance(value, int) and value > 0:
                return value
        return DEFAULT_TOKENS

    def _events(self, path: str, n: int) -> list[bytes]:
        key = (path, n)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        events = []
        for i in range(n):
            last = i == n - 1
            finish = "length" if last else None
            if path == "/v1/completions":
                obj: Any = {
                    "id": "stub",
                    "object": "text_completion",
                    "model": self.model,
                    "choices": [{"index": 0, "text": f" t{i}", "finish_reason": finish}],
                }
            elif path == "/v1/chat/completions":
                delta = {"role": "assistant", "content": f" t{i}"} if i == 0 else {"content": f" t{i}"}
                obj = {
                    "id": "stub",
                    "object": "chat.completion.chunk",
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }
            else:
                obj = {
                    "text": "".join(f" t{k}" for k in range(i + 1)),
                    "output_ids": list(range(i + 1)),
                    "meta_info": {
                        "id": "stub",
                        "completion_tokens": i + 1,
                        "finish_reason": {"type": "length", "length": n} if last else None,
                    },
                }
            events.append(_sse(obj))
        if len(self._cache) < 256:
            self._cache[key] = events
        return events

    def _whole(self, path: str, n: int, prompt: int) -> dict[str, Any]:
        text = "".join(f" t{i}" for i in range(n))
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        if path == "/generate":
            return {
                "text": text,
                "output_ids": list(range(n)),
                "meta_info": {"prompt_tokens": prompt, "completion_tokens": n},
            }
        if path == "/v1/chat/completions":
            return {
                "id": "stub",
                "object": "chat.completion",
                "model": self.model,
                "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
            }
        return {
            "id": "stub",
            "object": "text_completion",
            "model": self.model,
            "usage": usage,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        }


def serve(host: str, port: int, tokens: int | None, itl_ms: float, ttft_ms: float, model: str) -> int:
    """Run the stub until SIGINT/SIGTERM; prints ``stub listening on URL`` once ready."""

    async def main() -> None:
        stub = StubServer(host, port, tokens, itl_ms, ttft_ms, model)
        await stub.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        print(f"stub listening on http://{host}:{stub.port}", flush=True)
        await stop.wait()
        await stub.close()
        print(f"stub served {stub.served} requests", file=sys.stderr, flush=True)

    asyncio.run(main())
    return 0
