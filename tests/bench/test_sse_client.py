"""bench/sse_client.py, the benchmarks' lean streaming client, against ``pdserve bench stub``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sse_client import Connection, HttpError, split_url


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[str, int]]:
    """The stub, one write per token 1 ms apart, on a free loopback port."""
    cmd = [sys.executable, "-m", "pdserve.bench", "stub", "--port", "0", "--itl-ms", "1"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("stub listening on "), line
        try:
            yield split_url(line.split()[-1])
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def test_split_url() -> None:
    assert split_url("http://127.0.0.1:8000/") == ("127.0.0.1", 8000)
    assert split_url("localhost:9") == ("localhost", 9)


def test_streams_on_one_kept_connection(stub: tuple[str, int]) -> None:
    async def run() -> list:
        conn = Connection(*stub)
        status, _ = await conn.get("/health")
        assert status == 200
        writer = conn.writer
        got = []
        for n in (5, 12):
            body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": n}}
            got.append(await conn.stream("/generate", body))
        assert conn.writer is writer  # every request on the connection /health opened
        await conn.close()
        return got

    five, twelve = asyncio.run(run())
    for got, n in ((five, 5), (twelve, 12)):
        assert got.sent < got.first < got.ended
        assert got.events == n  # one event a token, each written on its own
        assert got.last is not None and got.last["meta_info"]["completion_tokens"] == n


def test_an_error_status_raises_with_the_body(stub: tuple[str, int]) -> None:
    async def run() -> HttpError:
        conn = Connection(*stub)
        try:
            await conn.stream("/nowhere", {"stream": True})
        except HttpError as exc:
            status, _ = await conn.get("/health")  # the connection still serves
            assert status == 200
            return exc
        finally:
            await conn.close()
        raise AssertionError("no error")

    exc = asyncio.run(run())
    assert exc.status == 404 and exc.body
