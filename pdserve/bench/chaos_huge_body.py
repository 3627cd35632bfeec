"""The chaos case of a 50 MB body posted while streams run: the API must refuse it at once
(413) without stalling the streams (a part of :mod:`pdserve.bench.chaos_cases`)."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
from asyncio.subprocess import PIPE
from dataclasses import dataclass

from pdserve.bench.chaos import CaseResult, ChaosSystem, Streamed, percentile, prompts, run_streams


@dataclass
class _Sink:
    """A bare socket server that reads each request whole (as the API does, so that the
    client can read its answer), answers 413 and hangs up: the same bodies sent here load
    the machine as much as they do when sent to the API, without the API."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(1 << 16)
                headers, _, body = head.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in headers.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                conn.sendall(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n")
                left = length - len(body)
                while left > 0:
                    got = conn.recv(min(left, 1 << 20))
                    if not got:
                        break
                    left -= len(got)

    def close(self) -> None:
        self._server.close()


class _Poster:
    """A process of its own that posts a ``mb`` MB body to a URL when asked (the body built
    beforehand): sending 50 MB from the measuring process would stall the event loop that
    records the arrival times."""

    def __init__(self, mb: int) -> None:
        self.mb = mb
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _POST_BODY, str(self.mb), stdin=PIPE, stdout=PIPE
        )
        assert self.proc.stdout is not None
        await self.proc.stdout.readline()

    async def post(self, url: str) -> tuple[int, float]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(url.encode() + b"\n")
        await self.proc.stdin.drain()
        code, seconds = (await self.proc.stdout.readline()).decode().split()
        return int(code), float(seconds)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            await self.proc.wait()


async def huge_body(
    system: ChaosSystem,
    streams: int = 16,
    max_new: int = 300,
    body_mb: int = 50,
    tolerance: float = 0.2,
    rounds: int = 3,
    check_itl: bool = True,
) -> CaseResult:
    """Inter-token latency of ``streams`` streams while five ``body_mb`` MB bodies are
    posted one after another to the API, and while the same bodies go to a bare socket that
    refuses them (what sending them costs this machine, the API left out), ``rounds`` times
    each, alternating; and undisturbed, for reference. Each body must be a 413 at once, and
    the median p99 ITL with the bodies sent to the API within ``tolerance`` of the median
    with them sent to the bare socket. Without ``check_itl`` only the rounds that post to the
    API run (the 413s and the streams' completion are checked, not the ITL)."""
    ps = prompts(streams, 32, seed=7)
    sink = _Sink()
    poster = _Poster(body_mb)
    await poster.start()
    answers: list[tuple[int, float]] = []
    p99: dict[str, list[float]] = {"undisturbed": [], "api": [], "bare socket": []}
    complete = True
    try:
        await poster.post(system.url)  # the first refusal warms the path up; it is not measured
        for i in range(rounds):
            targets = (("undisturbed", None), ("api", system.url), ("bare socket", sink.url))
            for kind, target in targets if check_itl else targets[1:2]:
                system.wait_ready()
                running = asyncio.Event()

                async def on_event(s: Streamed, running: asyncio.Event = running) -> None:
                    if len(s.tokens) >= 20:
                        running.set()

                async def send(running: asyncio.Event = running, target: str | None = target, kind: str = kind) -> None:
                    await running.wait()
                    for _ in range(5 if target else 0):
                        answer = await poster.post(target or "")
                        if kind == "api":
                            answers.append(answer)
                        await asyncio.sleep(0.2)

                task = asyncio.create_task(send())
                runs = await run_streams(system, ps, max_new, f"body-{kind}-{i}".replace(" ", "-"), on_event=on_event)
                await task
                complete = complete and all(r.complete for r in runs)
                p99[kind].append(percentile([x for r in runs for x in r.itls()], 0.99))
    finally:
        await poster.stop()
        sink.close()
    median = {kind: sorted(values)[rounds // 2] if values else float("nan") for kind, values in p99.items()}
    slowest = max((s for _, s in answers), default=float("inf"))
    all_413 = len(answers) == 5 * rounds and all(code == 413 for code, _ in answers)
    itl_ok = median["api"] <= median["bare socket"] * (1 + tolerance) or not check_itl
    ok = all_413 and slowest < 0.5 and complete and itl_ok
    figure = (
        f"{sum(c == 413 for c, _ in answers)}/{len(answers)} answered 413 (slowest {slowest * 1e3:.1f} ms); "
        f"ITL p99, median of {rounds} rounds: {median['api'] * 1e3:.1f} ms with the bodies sent to the API, "
        f"{median['bare socket'] * 1e3:.1f} ms sent to a bare socket, {median['undisturbed'] * 1e3:.1f} ms without"
    )
    return CaseResult(f"a {body_mb} MB body while {streams} streams run", ok, figure, {"p99_itl_s": p99})


# Builds a body of argv[1] MB once, then for each URL read from stdin posts it to URL/generate
# and prints the status and the seconds to it.
_POST_BODY = """
import http.client, sys, time, urllib.parse
size = int(sys.argv[1]) << 20
body = b'{"text": "' + b"x" * size + b'"}'
print("ready", flush=True)
for line in sys.stdin:
    url = urllib.parse.urlsplit(line.strip())
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    started = time.monotonic()
    conn.putrequest("POST", "/generate")
    conn.putheader("Content-Type", "application/json"); conn.putheader("Content-Length", str(len(body)))
    conn.endheaders()
    try:
        conn.send(body)
    except OSError:
        pass  # the server answered and closed before taking it all
    try:
        status = conn.getresponse().status
    except OSError:
        status = 0
    print(status, time.monotonic() - started, flush=True)
    conn.close()
"""
