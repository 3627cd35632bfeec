"""A lean HTTP/1.1 client for the benchmarks' streamed requests.

The benchmarks' job is to measure the server, so their client must cost far less than
the server it drives. ``httpx`` costs 110-210 us of CPU per streamed token (its
anyio streams, h11's state machine and ``aiter_lines`` for every SSE event): one
process reads about 5,000-10,000 tokens a second, less than one GPU serves at 64 in
flight, so the client's backlog, not the server, set when each lane sent its next
request. This client keeps one keep-alive connection per lane on asyncio's own streams,
reads the chunked body chunk by chunk and looks at the events only for what a benchmark
needs: when the first one came, and the last one (its ``meta_info`` or ``usage``).
It speaks only what ``pdserve``'s API answers: a status line, headers, then either a
``Content-Length`` body or a chunked one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson


class HttpError(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status
        self.body = body


@dataclass
class Streamed:
    """One streamed response: when it was sent, its first event came and it ended
    (``time.perf_counter``), and its last data event parsed (``None`` without one)."""

    sent: float
    first: float | None
    ended: float
    last: dict | None
    events: int


class Connection:
    """One keep-alive connection; reopened when the server closes it."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None

    async def get(self, path: str) -> tuple[int, bytes]:
        """A plain GET (e.g. ``/health`` to open the connection before a clock starts)."""
        return await self._exchange(b"GET", path, b"", None)

    async def stream(self, path: str, body: dict) -> Streamed:
        """POST ``body`` as JSON and read the SSE answer to its end."""
        state = {"first": None, "events": 0, "tail": b""}

        def on_chunk(data: bytes) -> None:
            n = data.count(b"data: {")
            if n:
                if state["first"] is None:
                    state["first"] = time.perf_counter()
                state["events"] += n
                state["tail"] = data  # the last chunk holding an event
            elif state["events"] and b"data: [DONE]" not in data:
                state["tail"] += data  # an event split across chunks (not what the API does)

        sent = time.perf_counter()
        status, rest = await self._exchange(b"POST", path, orjson.dumps(body), on_chunk)
        if status != 200:
            raise HttpError(status, rest)
        tail: bytes = state["tail"]  # type: ignore[assignment]
        last = None
        at = tail.rfind(b"data: {")
        if at >= 0:
            end = tail.find(b"\n\n", at)
            last = orjson.loads(tail[at + 6 : end if end >= 0 else len(tail)])
        return Streamed(sent, state["first"], time.perf_counter(), last, state["events"])  # type: ignore[arg-type]

    async def _exchange(self, method: bytes, path: str, body: bytes, on_chunk) -> tuple[int, bytes]:
        if self.writer is None:
            await self.open()
        assert self.reader is not None and self.writer is not None
        head = b"%s %s HTTP/1.1\r\nHost: %s:%d\r\n" % (method, path.encode(), self.host.encode(), self.port)
        if body:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        self.writer.write(head + b"\r\n" + body)
        reader = self.reader
        status_line = await reader.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        headers = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        keep = headers.get(b"connection") != b"close"
        out = b""
        if headers.get(b"transfer-encoding") == b"chunked":
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the end
                        pass
                    break
                data = (await reader.readexactly(size + 2))[:-2]
                if status == 200 and on_chunk is not None:
                    on_chunk(data)
                else:
                    parts.append(data)
            out = b"".join(parts)
        elif b"content-length" in headers:
            out = await reader.readexactly(int(headers[b"content-length"]))
        else:  # the body runs to the end of the connection
            out = await reader.read()
            keep = False
        if not keep:
            await self.close()
        return status, out


def split_url(url: str) -> tuple[str, int]:
    """``http://host:port`` -> (host, port)."""
    rest = url.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.partition(":")
    return host, int(port or 80)
