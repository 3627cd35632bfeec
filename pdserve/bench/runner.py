"""Running a benchmark: build the workload, schedule the arrivals, time every request."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import gc
import logging
import math
import os
import platform
import random
import sys
import time
from typing import Any

import orjson

from pdserve.bench.arrivals import arrival_offsets, offered_rate
from pdserve.bench.client import (
    ConnectionPool,
    RequestOptions,
    build_body,
    discover_model,
    http_request,
    make_client,
    send_request,
)
from pdserve.bench.config import BenchConfig
from pdserve.bench.datasets import BenchRequest, Tokenizer, prefix_chat_requests, random_requests, sharegpt_requests
from pdserve.bench.metrics import RequestRecord, summarize

log = logging.getLogger("pdserve.bench")

WARMUP_SEED_OFFSET = 7919
CLIENT_BEHIND_MS = 10.0  # median lag between scheduled and actual send above which results are client-bound


def build_requests(cfg: BenchConfig, n: int, seed: int, tokenizer: Tokenizer | None) -> list[BenchRequest]:
    form = cfg.prompt_form()
    if cfg.dataset == "random":
        return random_requests(
            n, cfg.input_len, cfg.output_len, cfg.range_ratio, seed, tokenizer, form, cfg.short_fraction, cfg.short_len
        )
    if cfg.dataset == "sharegpt":
        assert cfg.dataset_path
        return sharegpt_requests(cfg.dataset_path, n, seed, tokenizer, form, cfg.sharegpt_output_len)
    return prefix_chat_requests(
        n, cfg.num_groups, cfg.prefix_len, cfg.turn_len, cfg.output_len, cfg.num_turns, seed, tokenizer, form
    )


# ---- progress ---------------------------------------------------------------------------
class Progress:
    """A one-line text progress bar on stderr (redrawn in place on a terminal, a line every
    few seconds otherwise)."""

    WIDTH = 30

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total = total
        self.label = label
        self.enabled = enabled
        self.done = 0
        self.failed = 0
        self.t0 = 0.0
        self._task: asyncio.Task[None] | None = None
        self._tty = sys.stderr.isatty()

    def step(self, ok: bool) -> None:
        self.done += 1
        if not ok:
            self.failed += 1

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * self.WIDTH)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        failed = f", {self.failed} failed" if self.failed else ""
        return f"{self.label} [{bar:<{self.WIDTH}}] {self.done}/{self.total}{failed} {elapsed:6.1f}s {rate:7.1f} req/s"

    async def _loop(self) -> None:
        period = 0.25 if self._tty else 5.0
        while True:
            await asyncio.sleep(period)
            self._draw()

    def _draw(self, final: bool = False) -> None:
        if self._tty:
            sys.stderr.write("\r" + self.line() + ("\n" if final else ""))
        else:
            sys.stderr.write(self.line() + "\n")
        sys.stderr.flush()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._draw(final=True)


# ---- one run ------------------------------------------------------------------------------
@dataclasses.dataclass
class Target:
    """What the runs of one invocation share: the model name, its context, the tokenizer."""

    model: str | None
    context_length: int | None
    tokenizer: Tokenizer | None


async def resolve_target(cfg: BenchConfig) -> Target:
    tokenizer = Tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    model, ctx = cfg.model, None
    async with make_client(1, 30.0, _headers(cfg)) as client:
        found, ctx = await discover_model(client, cfg.base_url)
    if model is None:
        model = found
    if model is None and cfg.backend != "generate":
        raise RuntimeError(f"no --model given and GET {cfg.base_url}/v1/models named none")
    return Target(model, ctx, tokenizer)


def _headers(cfg: BenchConfig) -> dict[str, str]:
    return {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def run_point(
    cfg: BenchConfig, target: Target, rate: float, max_concurrency: int | None, seed: int, label: str = ""
) -> dict[str, Any]:
    """One benchmark at one load; returns ``{"request_rate", "max_concurrency", "seed",
    "metrics", ["requests"]}``."""
    tok = target.tokenizer
    requests = build_requests(cfg, cfg.num_prompts, seed, tok)
    if target.context_length:
        over = sum(1 for r in requests if r.prompt_len + r.output_len > target.context_length)
        if over:
            log.warning(
                "%d of %d requests exceed the model's context of %d tokens", over, len(requests), target.context_length
            )
    # /generate bodies name the model only when asked to: SGLang's /generate rejects unknown keys
    model = cfg.model if cfg.backend == "generate" else target.model
    opts = RequestOptions(cfg.backend, model, cfg.ignore_eos, cfg.temperature, cfg.extra_body)
    headers = _headers(cfg)
    prepared = [
        http_request(cfg.url, orjson.dumps(build_body(r, opts)), headers, cfg.request_timeout) for r in requests
    ]
    offsets = arrival_offsets(len(requests), rate, cfg.burstiness, seed)
    n = len(requests)
    pool = max_concurrency or n
    backend = cfg.backend
    records = [RequestRecord(i, scheduled=offsets[i]) for i in range(n)]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = Progress(n, label or _label(rate, max_concurrency), not cfg.quiet)

    async with ConnectionPool(cfg.request_timeout, cfg.base_url) as conns:
        if cfg.warmup:
            await _warmup(cfg, conns, opts, tok, seed, pool)
        gc.collect()
        gc.freeze()  # keep the collector away from the long-lived workload objects
        clock = time.perf_counter

        async def one(i: int, t0: float) -> None:
            rec = records[i]
            if sem is None:
                client = conns.acquire()
                await send_request(client, prepared[i], rec, backend, requests[i], tok, clock, t0)
                conns.release(client)
            else:
                async with sem:
                    client = conns.acquire()
                    await send_request(client, prepared[i], rec, backend, requests[i], tok, clock, t0)
                    conns.release(client)
            progress.step(rec.ok)

        tasks = []
        t0 = clock()
        progress.start()
        loop = asyncio.get_running_loop()
        for i in range(n):
            delay = t0 + offsets[i] - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(one(i, t0)))
        await asyncio.gather(*tasks)
        duration = clock() - t0
        await progress.stop()
        gc.unfreeze()

    lags = [r.start - r.scheduled for r in records] if sem is None and not math.isinf(rate) else None
    metrics = summarize(records, duration, cfg.slo, offered_rate(offsets), lags)
    lag = metrics.get("send_lag_ms")
    if lag and lag["median"] > CLIENT_BEHIND_MS:
        metrics["client_behind_schedule"] = True
        log.warning(
            "the client fell behind its arrival schedule (median send lag %.1f ms): it cannot sustain %s req/s here, "
            "so the results are partly client-bound",
            lag["median"],
            point_rate(rate),
        )
    point: dict[str, Any] = {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": max_concurrency,
        "seed": seed,
        "metrics": metrics,
    }
    if cfg.save_requests:
        point["requests"] = [r.row() for r in records]
    return point


async def _warmup(
    cfg: BenchConfig, conns: ConnectionPool, opts: RequestOptions, tok: Tokenizer | None, seed: int, pool: int
) -> None:
    warm = build_requests(cfg, cfg.warmup, seed + WARMUP_SEED_OFFSET, tok)
    sem = asyncio.Semaphore(max(1, min(pool, len(warm))))
    recs = [RequestRecord(-1 - i) for i in range(len(warm))]

    async def one(i: int) -> None:
        async with sem:
            client = conns.acquire()
            request = http_request(cfg.url, orjson.dumps(build_body(warm[i], opts)), _headers(cfg), cfg.request_timeout)
            await send_request(client, request, recs[i], cfg.backend, warm[i], tok)
            conns.release(client)

    await asyncio.gather(*(one(i) for i in range(len(warm))))
    bad = [r.error for r in recs if not r.ok]
    if bad:
        log.warning("%d of %d warm-up requests failed; first error: %s", len(bad), len(recs), bad[0])


def point_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _label(rate: float, conc: int | None) -> str:
    parts = [f"rate={'inf' if math.isinf(rate) else f'{rate:g}'}"]
    if conc:
        parts.append(f"conc={conc}")
    return " ".join(parts)


def sweep_points(cfg: BenchConfig) -> list[tuple[float, int | None]]:
    """(request rate, max concurrency) of every run the config asks for."""
    if cfg.sweep and cfg.sweep_concurrency:
        raise ValueError("give --sweep or --sweep-concurrency, not both")
    if cfg.sweep:
        return [(r, cfg.max_concurrency) for r in cfg.sweep]
    if cfg.sweep_concurrency:
        return [(cfg.request_rate, c) for c in cfg.sweep_concurrency]
    return [(cfg.request_rate, cfg.max_concurrency)]


async def run_benchmark(cfg: BenchConfig, on_point: Any = None) -> dict[str, Any]:
    """Every run the config asks for (one, or a sweep); returns the JSON-ready result.

    Each sweep point uses its own seed (``seed + k``) so its prompts differ from the
    previous points' and a server's prefix cache cannot serve them from an earlier run;
    without a seed in ``cfg`` the run draws a fresh one (recorded in ``config.seed``), so
    running the same command twice measures cold both times.
    """
    if cfg.seed is None:
        cfg = dataclasses.replace(cfg, seed=random.SystemRandom().randrange(1 << 31))
    assert cfg.seed is not None
    target = await resolve_target(cfg)
    points = []
    plan = sweep_points(cfg)
    for k, (rate, conc) in enumerate(plan):
        if k and cfg.sweep_pause > 0:
            await asyncio.sleep(cfg.sweep_pause)
        label = _label(rate, conc) + (f" ({k + 1}/{len(plan)})" if len(plan) > 1 else "")
        point = await run_point(cfg, target, rate, conc, cfg.seed + k, label)
        points.append(point)
        if on_point is not None:
            on_point(point)
    result: dict[str, Any] = {
        "tool": "pdserve bench",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "config": cfg.to_json(),
        "model": target.model,
        "sweep": "request_rate" if cfg.sweep else "max_concurrency" if cfg.sweep_concurrency else None,
        "points": points,
    }
    if len(points) == 1:
        result["metrics"] = points[0]["metrics"]
    return result
