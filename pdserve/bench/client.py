"""The HTTP side: request bodies per backend and the streaming reader that times events.

Requests go out through ``httpx.AsyncClient`` streaming over keep-alive connections from a
:class:`ConnectionPool` that grows to the run's concurrency, so no request waits for a
connection inside the client. Requests (URL, headers, orjson-serialized body) are built
before the clock starts; the reader splits the SSE byte stream itself and parses each
``data:`` line once, so per-event work is one ``orjson.loads`` and a few dict lookups.
Every event of one network read gets that read's timestamp.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from pdserve.bench.datasets import BenchRequest, Tokenizer
from pdserve.bench.metrics import RequestRecord

_DATA = b"data:"
_DONE = b"[DONE]"


@dataclass
class RequestOptions:
    backend: str = "openai"
    model: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_body(req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
    """The JSON body of one streaming request."""
    if opts.backend == "generate":
        params: dict[str, Any] = {"max_new_tokens": req.output_len, "temperature": opts.temperature}
        if opts.ignore_eos:
            params["ignore_eos"] = True
        prompt = req.prompt
        if req.is_chat:
            prompt = "\n\n".join(m["content"] for m in prompt)  # type: ignore[index]
        body: dict[str, Any] = {
            "input_ids" if isinstance(prompt, list) else "text": prompt,
            "sampling_params": params,
            "stream": True,
        }
        if opts.model:
            body["model"] = opts.model
    else:
        body = {"model": opts.model, "max_tokens": req.output_len, "temperature": opts.temperature, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if opts.ignore_eos:
            body["ignore_eos"] = True
        if opts.backend == "openai-chat":
            if req.is_chat:
                body["messages"] = req.prompt
            else:
                if isinstance(req.prompt, list):
                    raise ValueError("openai-chat needs text prompts, not token ids")
                body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            if req.is_chat:
                raise ValueError("the openai backend takes a prompt, not chat messages")
            body["prompt"] = req.prompt
    if opts.extra_body:
        if opts.backend == "generate" and "sampling_params" in opts.extra_body:
            extra = dict(opts.extra_body)
            body["sampling_params"].update(extra.pop("sampling_params"))
            body.update(extra)
        else:
            body.update(opts.extra_body)
    return body


def _cache_missing_sniffio() -> None:
    """httpcore runs ``import sniffio`` on every lock it takes (several per request); when
    sniffio is not installed each failed import searches sys.path again (~0.1 ms each, the
    largest single cost of a request against a fast server). Record its absence once: the
    import then fails at once, exactly as it would have, and httpcore falls back to asyncio."""
    if "sniffio" not in sys.modules and importlib.util.find_spec("sniffio") is None:
        sys.modules["sniffio"] = None  # type: ignore[assignment]


def make_client(concurrency: int, timeout: float | None, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    _cache_missing_sniffio()
    n = max(1, concurrency)
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
        timeout=httpx.Timeout(timeout, connect=min(timeout or 30.0, 30.0)),
        headers=headers,
        http2=False,
        trust_env=False,
    )


class ConnectionPool:
    """Keep-alive connections for one run: each is an ``httpx.AsyncClient`` limited to one
    connection, handed out from a LIFO free list and created when none is free, so the pool
    grows to the run's peak concurrency (``max_concurrency`` bounds it) and no request ever
    waits inside the HTTP client for a connection.

    Why not one client with ``max_connections=N``: httpcore's pool rescans every connection,
    quadratically (``len([c.is_idle() for c in connections])`` for each idle one), several
    times per request; at a few dozen connections that scan dominates the client's CPU time
    and skews the latencies it measures. With one connection per client the scan is O(1).
    """

    def __init__(self, timeout: float | None, base_url: str = "") -> None:
        _cache_missing_sniffio()
        self._timeout = httpx.Timeout(timeout, connect=min(timeout or 30.0, 30.0))
        self._free: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []
        self._ssl: Any = None
        self._https = base_url.startswith("https")

    def acquire(self) -> httpx.AsyncClient:
        if self._free:
            return self._free.pop()
        if self._ssl is None:  # one SSL context for all (loading the CA bundle takes ~50 ms)
            self._ssl = httpx.create_ssl_context(verify=self._https)
        client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            timeout=self._timeout,
            verify=self._ssl,
            trust_env=False,
        )
        self._all.append(client)
        return client

    def release(self, client: httpx.AsyncClient) -> None:
        self._free.append(client)

    @property
    def size(self) -> int:
        return len(self._all)

    async def aclose(self) -> None:
        for client in self._all:
            await client.aclose()
        self._all.clear()
        self._free.clear()

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Stream:
    """Timing state of one request while its events arrive."""

    __slots__ = ("chat", "error", "generate", "last", "prev_tokens", "rec", "start", "text_parts", "usage")

    def __init__(self, rec: RequestRecord, start: float, backend: str) -> None:
        self.rec = rec
        self.start = start
        self.last = 0.0
        self.generate = backend == "generate"
        self.chat = backend == "openai-chat"
        self.prev_tokens = 0
        self.text_parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None

    def token_event(self, now: float) -> None:
        rec = self.rec
        if rec.ttft is None:
            rec.ttft = now - self.start
        else:
            rec.itl.append(now - self.last)
        self.last = now
        rec.token_events += 1

    def event(self, obj: Any, now: float) -> None:
        if not isinstance(obj, dict):
            return
        err = obj.get("error")
        if err is not None:
            self.error = _error_text(err)
            return
        if self.generate:
            meta = obj.get("meta_info")
            n = meta.get("completion_tokens") if meta else None
            if n is None:
                n = len(obj.get("output_ids") or ())
            if n > self.prev_tokens:
                self.prev_tokens = n
                self.token_event(now)
            if meta:
                self.usage = meta
            text = obj.get("text")
            if text is not None:
                self.text_parts = [text]
            return
        choices = obj.get("choices")
        if choices:
            c = choices[0]
            text = (c.get("delta") or {}).get("content") if self.chat else c.get("text")
            if text:
                self.text_parts.append(text)
                self.token_event(now)
        usage = obj.get("usage")
        if usage:
            self.usage = usage


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def http_request(
    url: str, body: bytes, headers: dict[str, str] | None = None, timeout: float | None = 600.0
) -> httpx.Request:
    """A ready-to-send POST (built before the clock starts: URL parsing and header
    normalisation are a good part of httpx's per-request cost). ``timeout``: seconds to
    wait for the connection and for each read (None: forever)."""
    h = {"content-type": "application/json", "accept": "text/event-stream", "user-agent": "pdserve-bench"}
    if headers:
        h.update(headers)
    t = httpx.Timeout(timeout, connect=min(timeout or 30.0, 30.0))
    return httpx.Request("POST", url, content=body, headers=h, extensions={"timeout": t.as_dict()})


async def send_request(
    client: httpx.AsyncClient,
    request: httpx.Request,
    rec: RequestRecord,
    backend: str,
    expected: BenchRequest,
    tokenizer: Tokenizer | None = None,
    clock: Callable[[], float] = time.perf_counter,
    t0: float = 0.0,
) -> None:
    """Send one streaming request and fill ``rec`` (never raises for request errors)."""
    start = clock()
    rec.start = start - t0
    rec.expected_output_tokens = expected.output_len
    st = _Stream(rec, start, backend)
    try:
        resp = await client.send(request, stream=True)
        try:
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.error = f"HTTP {resp.status_code}: {_error_body(raw)}"
            else:
                await _read_events(resp, st, clock)
        finally:
            await resp.aclose()
    except Exception as exc:  # any failure of this request (network, HTTP, a malformed event) is its error
        rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    end = clock()
    rec.latency = end - start
    if rec.error is None and st.error is not None:
        rec.error = st.error
    if rec.error is None and rec.ttft is None:
        rec.error = "the stream ended without any output token"
    rec.ok = rec.error is None
    _fill_counts(st, expected, tokenizer)


async def _read_events(resp: httpx.Response, st: _Stream, clock: Callable[[], float]) -> None:
    """Split the SSE byte stream into ``data:`` lines and hand each event to ``st``; every
    event of one network read gets that read's timestamp."""
    buf = b""
    done = False
    # Read to the end even after [DONE] so the connection goes back to the pool.
    encoded = resp.headers.get("content-encoding", "identity") != "identity"
    async for chunk in resp.aiter_bytes() if encoded else resp.aiter_raw():
        if done:
            continue
        now = clock()
        buf = buf + chunk if buf else chunk
        if b"\n" not in buf:
            continue
        lines = buf.split(b"\n")
        buf = lines.pop()
        for line in lines:
            if not line.startswith(_DATA):
                continue
            data = line[5:].strip()
            if data == _DONE:
                done = True
                break
            if data:
                st.event(orjson.loads(data), now)
    if buf.startswith(_DATA) and not done:  # a last line without its newline
        data = buf[5:].strip()
        if data and data != _DONE:
            st.event(orjson.loads(data), clock())


def _fill_counts(st: _Stream, expected: BenchRequest, tokenizer: Tokenizer | None) -> None:
    rec = st.rec
    usage = st.usage or {}
    p = usage.get("prompt_tokens")
    if isinstance(p, int):
        rec.prompt_tokens, rec.prompt_source = p, "server"
    else:
        rec.prompt_tokens, rec.prompt_source = expected.prompt_len, "dataset"
    c = usage.get("completion_tokens")
    if isinstance(c, int):
        rec.output_tokens, rec.token_source = c, "server"
    elif st.generate and st.prev_tokens:
        rec.output_tokens, rec.token_source = st.prev_tokens, "server"
    elif tokenizer is not None and st.text_parts:
        rec.output_tokens, rec.token_source = tokenizer.count("".join(st.text_parts)), "tokenizer"
    else:
        rec.output_tokens, rec.token_source = rec.token_events, "events"
    cached = usage.get("cached_tokens")
    if cached is None:
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = details.get("cached_tokens")
    if isinstance(cached, int):
        rec.cached_tokens = cached
    timings = usage.get("timings") if st.generate else None
    if isinstance(timings, dict):
        rec.timings = {k: float(v) for k, v in timings.items() if isinstance(v, (int, float))}


def _error_body(raw: bytes) -> str:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:300].decode(errors="replace").strip()
    if isinstance(obj, dict) and "error" in obj:
        return _error_text(obj["error"])[:300]
    if isinstance(obj, dict) and "detail" in obj:
        return str(obj["detail"])[:300]
    return raw[:300].decode(errors="replace")


async def discover_model(client: httpx.AsyncClient, base_url: str) -> tuple[str | None, int | None]:
    """The first model GET /v1/models lists and its max_model_len, when there is one."""
    try:
        resp = await client.get(base_url + "/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None, None
    if not data:
        return None, None
    first = data[0]
    ctx = first.get("max_model_len")
    return first.get("id"), ctx if isinstance(ctx, int) else None
