"""The chaos harness: a real ``pdserve up`` to break, streaming clients that record every
token and its arrival, and an audit that proves what a client got is one continuation.

:class:`ChaosSystem` starts ``pdserve up`` (its own nats-server, real workers, real
Mooncake) and reaches in the way an operator would: ``kill -9`` of a worker or of the
broker by pid, SIGTERM of a worker, the ``/workers`` registry. :func:`stream` runs one
``/generate`` SSE stream. :class:`Observer` listens on NATS to every request, KV event
and token chunk, and :meth:`Observer.splices` checks each client token was produced by a
worker run conditioned on exactly the client's earlier tokens. The cases themselves live
in :mod:`pdserve.bench.chaos_cases`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompts(n: int, length: int, seed: int = 0, vocab: int = 4000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


@dataclass
class CaseResult:
    """One chaos case's outcome: whether it passed, its figure, the details behind it."""

    case: str
    passed: bool
    figure: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChaosSystem:
    """``pdserve up`` in a process of its own, with its own broker under ``data_dir``."""

    data_dir: Path
    model_path: Path
    prefill: int = 2
    decode: int = 2
    extra: tuple[str, ...] = ()
    url: str = ""
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self, timeout: float = 240.0) -> ChaosSystem:
        port = free_port()
        self.log_path = self.data_dir / "pdserve.log"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "pdserve", "up",
            "--data-dir", str(self.data_dir / "data"),
            "--model-path", str(self.model_path),
            "--host", "127.0.0.1", "--port", str(port),
            "--prefill-workers", str(self.prefill), "--decode-workers", str(self.decode),
            "--heartbeat-seconds", "0.1",
            "--stall-timeout", "3",
            *self.extra,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every worker is registered and idle (pages back to none used)."""
        deadline = time.monotonic() + timeout
        workers: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"pdserve up exited:\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                workers = self.workers()
                roles = [w["role"] for w in workers]
                if roles.count("prefill") >= self.prefill and roles.count("decode") >= self.decode:
                    if all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in workers):
                        return
            time.sleep(0.3)
        seen = [{k: w.get(k) for k in ("id", "role", "pages_used", "requests_in_flight")} for w in workers]
        raise RuntimeError(f"pdserve up not ready in {timeout:.0f}s; workers {seen}:\n{self.log()[-4000:]}")

    def workers(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/workers", timeout=10).json())

    async def aworkers(self, client: httpx.AsyncClient) -> list[dict[str, Any]]:
        return list((await client.get(self.url + "/workers")).json())

    def broker_pid(self) -> int:
        """The running nats-server's pid (from the ports file it writes)."""
        for path in sorted((self.data_dir / "data" / "nats" / "ports").glob("*.ports"), key=os.path.getmtime):
            pid = int(path.stem.rsplit("_", 1)[1])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 0)
                return pid
        raise RuntimeError("no running nats-server found")

    @staticmethod
    def kill(pid: int, sig: int = signal.SIGKILL) -> None:
        os.kill(pid, sig)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@dataclass
class Streamed:
    """One client's view of a ``/generate`` stream."""

    rid: str
    status: int = 0
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each event
    finish: str | None = None
    error: str | None = None
    repeated: int = 0  # events whose output_ids did not extend the previous ones

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.error is None and self.finish is not None

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


async def stream(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    max_new: int,
    rid: str,
    temperature: float = 0.0,
    seed: int | None = None,
    on_event: Callable[[Streamed], Any] | None = None,
    stop_after: int | None = None,
) -> Streamed:
    """Stream ``/generate``; ``stop_after`` events, then leave (a client disconnect)."""
    params: dict[str, Any] = {"max_new_tokens": max_new, "temperature": temperature, "ignore_eos": True}
    if seed is not None:
        params["seed"] = seed
    body = {"input_ids": prompt, "sampling_params": params, "stream": True, "rid": rid}
    out = Streamed(rid)
    try:
        async with client.stream("POST", url + "/generate", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = orjson.loads(line[6:])
                if "error" in event:
                    out.error = event["error"].get("message", "error")
                    continue
                ids = event["output_ids"]
                if ids[: len(out.tokens)] != out.tokens:
                    out.repeated += 1
                out.tokens = list(ids)
                out.arrivals.append(time.monotonic())
                reason = event["meta_info"].get("finish_reason")
                if reason:
                    out.finish = reason.get("type") if isinstance(reason, dict) else str(reason)
                if on_event is not None:
                    await on_event(out)
                if stop_after is not None and len(out.arrivals) >= stop_after:
                    return out
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Observer:
    """Everything that travels on NATS for the model: requests, KV events, token chunks
    (one per message, or a step's worth in a ``TokenBatch``).

    :meth:`splices` is the audit: a client token at position ``p`` is sound when some
    worker run produced that token at ``p`` conditioned on exactly the client's tokens
    before ``p`` (its given prefix — the request's ``output_ids``, or for a decode run the
    KV event's — followed by its own earlier tokens)."""

    def __init__(self, nats_url: str, model: str, connect_options: dict[str, Any] | None = None) -> None:
        self.nats_url = nats_url
        self.connect_options = connect_options or {}
        self.model = model
        self.requests: dict[str, list[dict[str, Any]]] = {}
        self.kv_ready: dict[tuple[str, int], list[int]] = {}
        # (rid, attempt, worker) -> that worker's runs of the attempt, each position -> token
        self.runs: dict[tuple[str, int, str], list[dict[int, int]]] = {}
        self.nc: Any = None

    async def start(self, on_request: Callable[[bytes, dict[str, Any]], Any] | None = None) -> None:
        import nats

        from pdserve.broker import subjects

        self.nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1, **self.connect_options)

        async def on_req(msg: Any) -> None:
            req = orjson.loads(msg.data)
            self.requests.setdefault(req["rid"], []).append(req)
            if on_request is not None:
                await on_request(msg.data, req)

        async def on_kv(msg: Any) -> None:
            ready = orjson.loads(msg.data)
            self.kv_ready.setdefault((ready["rid"], ready.get("attempt", 0)), list(ready["output_ids"]))

        async def on_chunk(msg: Any) -> None:
            data = orjson.loads(msg.data)
            for c in data["chunks"] if "chunks" in data else [data]:  # a TokenBatch, or one TokenChunk
                runs = self.runs.setdefault((c["rid"], c.get("attempt", 0), c.get("worker_id", "")), [{}])
                tokens = c.get("token_ids") or ()
                if tokens and c["seq"] in runs[-1]:  # the same worker runs the attempt again (a second copy)
                    runs.append({})
                for i, t in enumerate(tokens):
                    runs[-1][c["seq"] + i] = t

        await self.nc.subscribe(subjects.requests(self.model), cb=on_req)
        await self.nc.subscribe(subjects.kv_ready(self.model), cb=on_kv)
        await self.nc.subscribe("pd.tokens.>", cb=on_chunk)

    async def stop(self) -> None:
        if self.nc is not None:
            await self.nc.close()

    def splices(self, rid: str, client: list[int]) -> list[int]:
        """Positions of ``client`` that no correctly conditioned run produced (empty: sound)."""
        runs = [(a, w, toks) for (r, a, w), each in self.runs.items() if r == rid for toks in each if toks]
        bad = []
        for p, token in enumerate(client):
            if not any(toks.get(p) == token and self._given(rid, a, w, toks, p, client) for a, w, toks in runs):
                bad.append(p)
        return bad

    def _given(self, rid: str, attempt: int, worker: str, toks: dict[int, int], p: int, client: list[int]) -> bool:
        start = min(toks)
        if worker.startswith("decode"):
            base = self.kv_ready.get((rid, attempt))
            if base is None or len(base) != start:
                return False
        else:
            sent = [r for r in self.requests.get(rid, []) if r.get("attempt", 0) == attempt]
            base = list(sent[0].get("output_ids", [])) if sent else []
            if len(base) != start:
                return False
        if base != client[:start]:
            return False
        return all(toks.get(j) == client[j] for j in range(start, p))


def client_for(n: int = 64) -> httpx.AsyncClient:
    """An HTTP client for ``n`` streams at once."""
    limits = httpx.Limits(max_connections=n + 16, max_keepalive_connections=n + 16)
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits)


async def run_streams(system: ChaosSystem, ps: list[list[int]], max_new: int, tag: str, **kw: Any) -> list[Streamed]:
    """Stream each prompt of ``ps`` at once, ``tag``-numbered."""
    async with client_for(len(ps)) as client:
        return list(
            await asyncio.gather(
                *(stream(client, system.url, p, max_new, f"{tag}-{i}", **kw) for i, p in enumerate(ps))
            )
        )


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


async def gather_limited(coros: list[Any], limit: int) -> list[Any]:
    """Run ``coros`` with at most ``limit`` at a time, results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(c: Any) -> Any:
        async with gate:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))
