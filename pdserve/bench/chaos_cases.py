"""The chaos cases, each against a running :class:`ChaosSystem` (2 prefill and
2 decode workers): the failure it injects, what it measures, and whether it passes.
``bench/chaos.py`` runs them at full size and prints the table; the tests in
``tests/integration/test_chaos.py`` run them small."""

from __future__ import annotations

import asyncio
import ctypes
import signal
import time
from typing import Any

import httpx

from pdserve.bench.chaos import (
    CaseResult,
    ChaosSystem,
    Observer,
    Streamed,
    client_for,
    percentile,
    prompts,
    run_streams,
    stream,
)
from pdserve.bench.chaos_huge_body import huge_body


async def _until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval)
    return False


async def _busiest(system: ChaosSystem, client: httpx.AsyncClient, role: str) -> dict[str, Any]:
    workers = [w for w in await system.aworkers(client) if w["role"] == role]
    return max(workers, key=lambda w: w["requests_in_flight"])


# ---- kill -9 of a decode worker ---------------------------------------------------------------
async def decode_kill(system: ChaosSystem, n: int = 64, max_new: int = 384, min_held: int = 10) -> CaseResult:
    ps = prompts(n, 48, seed=1)
    calm = await run_streams(system, ps, max_new, "calm-decode")
    system.wait_ready()
    held = {"count": 0}
    done = asyncio.Event()

    async def killer() -> None:
        async with client_for() as client:

            async def spread() -> bool:
                busiest = await _busiest(system, client, "decode")
                return bool(busiest["requests_in_flight"] >= min(min_held, n // 2))

            await _until(spread, 120)
            victim = await _busiest(system, client, "decode")
            held["count"] = victim["requests_in_flight"]
            system.kill(victim["pid"])
            done.set()

    kill_task = asyncio.create_task(killer())
    runs = await run_streams(system, ps, max_new, "killed-decode")
    await kill_task
    complete = sum(r.complete and len(r.tokens) == max_new for r in runs)
    identical = sum(r.tokens == c.tokens for r, c in zip(runs, calm, strict=True))
    stall = max((max(r.itls(), default=0.0) for r in runs), default=0.0)
    ok = held["count"] >= min(min_held, n // 2) and complete == n and identical == n
    figure = f"{complete}/{n} complete, {identical}/{n} identical; victim held {held['count']}; longest client gap {stall:.1f}s"
    return CaseResult("kill -9 a decode worker", ok, figure, {"held": held["count"], "longest_gap_s": stall})


# ---- kill -9 of a prefill worker --------------------------------------------------------------
async def prefill_kill(system: ChaosSystem, n: int = 32, prompt_len: int = 1500, max_new: int = 16) -> CaseResult:
    ps = prompts(n, prompt_len, seed=2)
    victim: dict[str, Any] = {}

    async def killer() -> None:
        async with client_for() as client:

            async def busy() -> bool:  # the requests have spread over both prefill workers
                victim.update(await _busiest(system, client, "prefill"))
                return bool(victim["requests_in_flight"] >= max(2, n // 4))

            await _until(busy, 120, 0.02)
            system.kill(victim["pid"])

    kill_task = asyncio.create_task(killer())
    started = time.monotonic()
    runs = await run_streams(system, ps, max_new, "killed-prefill")
    await kill_task
    complete = sum(r.complete and len(r.tokens) == max_new for r in runs)
    seconds = time.monotonic() - started
    figure = f"{complete}/{n} complete (victim held {victim.get('requests_in_flight', 0)}) in {seconds:.0f}s"
    return CaseResult("kill -9 a prefill worker", complete == n, figure, {"seconds": seconds})


# ---- SIGTERM of workers ----------------------------------------------------------------------
async def drain(system: ChaosSystem, n: int = 32, max_new: int = 256) -> CaseResult:
    """SIGTERM (a graceful stop) of the busiest decode worker and then of a prefill worker
    while ``n`` greedy streams run: each stops taking work, finishes or hands back what it
    holds with the tokens so far, frees its KV; every stream ends complete and identical."""
    ps = prompts(n, 40, seed=8)
    calm = await run_streams(system, ps, max_new, "calm-drain")
    system.wait_ready()
    stopped: list[str] = []

    async def on_event(s: Streamed) -> None:
        if len(s.tokens) >= max_new // 4 and not stopped:
            stopped.append("decode")
            async with client_for() as client:
                system.kill((await _busiest(system, client, "decode"))["pid"], signal.SIGTERM)
                prefill = next(w for w in await system.aworkers(client) if w["role"] == "prefill")
                system.kill(prefill["pid"], signal.SIGTERM)
                stopped.append("prefill")

    runs = await run_streams(system, ps, max_new, "drained", on_event=on_event)
    complete = sum(r.complete and len(r.tokens) == max_new for r in runs)
    identical = sum(r.tokens == c.tokens for r, c in zip(runs, calm, strict=True))
    ok = len(stopped) == 2 and complete == n and identical == n
    figure = f"{complete}/{n} complete, {identical}/{n} identical to an undisturbed run"
    return CaseResult("SIGTERM of a decode and a prefill worker", ok, figure)


# ---- kill -9 and restart of nats-server -------------------------------------------------------
async def broker_restart(system: ChaosSystem, n: int = 32, max_new: int = 256) -> CaseResult:
    ps = prompts(n, 40, seed=3)
    calm = await run_streams(system, ps, max_new, "calm-broker")
    system.wait_ready()
    killed = asyncio.Event()

    async def on_event(s: Streamed) -> None:
        if len(s.tokens) >= max_new // 4 and not killed.is_set():
            killed.set()
            system.kill(system.broker_pid())

    runs = await run_streams(system, ps, max_new, "broker-restart", on_event=on_event)
    complete = sum(r.complete and len(r.tokens) == max_new for r in runs)
    identical = sum(r.tokens == c.tokens for r, c in zip(runs, calm, strict=True))
    lost = n - complete
    figure = f"{lost} of {n} accepted requests lost; {identical}/{n} identical to an undisturbed run"
    return CaseResult("kill -9 and restart nats-server", killed.is_set() and lost == 0 and identical == n, figure)


# ---- client disconnects -----------------------------------------------------------------------
async def disconnects(system: ChaosSystem, n: int = 100, limit: float = 0.5) -> CaseResult:
    """Leave ``n`` streams one after another; each time, how long until every worker's
    pages are back where they were (the registry, refreshed every 0.1 s, tells)."""
    ps = prompts(n, 64, seed=4)
    waits: list[float] = []
    async with client_for() as client:
        baseline = {w["id"]: w["pages_used"] for w in await system.aworkers(client)}
        for i, p in enumerate(ps):
            await stream(client, system.url, p, 3000, f"leave-{i}", stop_after=4)
            left, left_wall = time.monotonic(), time.time()

            async def back(left_wall: float = left_wall) -> bool:
                workers = await system.aworkers(client)
                fresh = all(w["last_seen_seconds"] <= time.time() - left_wall for w in workers)
                return fresh and all(w["pages_used"] <= baseline.get(w["id"], 0) for w in workers)

            await _until(back, 10, 0.02)
            waits.append(time.monotonic() - left)
    worst = max(waits)
    figure = (
        f"pages back to baseline after each of {n}: p50 {percentile(waits, 0.5) * 1e3:.0f} ms, max {worst * 1e3:.0f} ms"
    )
    return CaseResult("client disconnects mid-stream", worst <= limit, figure, {"waits_s": waits})


# ---- transfer failures and expired handles ----------------------------------------------------
async def transfer_faults(system: ChaosSystem, n: int = 100, limit: float = 5.0, wave: int = 20) -> CaseResult:
    """``n`` handles whose pull fails in Mooncake (a real engine here, asked for memory it
    never registered), ``n`` handles expired (half past their time, half of a hold
    generation the prefill side no longer has): every request must end within ``limit``
    seconds, and the decode pool's pages go back to baseline."""
    import nats

    from pdserve.broker import contract, subjects
    from pdserve.broker.connection import publish_work
    from pdserve.schemas import KVHandle, KVLayout, KVLease, KVLeaseReply, KVReady, SamplingParams, TokenChunk
    from pdserve.workers.transfer import create_transfer

    async with client_for() as client:
        workers = await system.aworkers(client)
    decode = next(w for w in workers if w["role"] == "decode")
    layout = KVLayout(**decode["kv_layout"])
    model = next(w["model"] for w in workers)
    prefill_id = "chaos-prefill"
    nats_url = await _nats_url(system)
    nc = await nats.connect(nats_url, **_nats_options(system))
    transfer = create_transfer("mooncake", host="127.0.0.1", protocol="tcp")
    buffer = ctypes.create_string_buffer(1 << 20)
    transfer.register(ctypes.addressof(buffer), len(buffer))

    async def grant(lease: KVLease) -> KVLeaseReply:  # the fake prefill side grants generation 1 only
        return KVLeaseReply(rid=lease.rid, granted=lease.generation == 1, reason="another generation")

    await contract.answer(nc, contract.KV_LEASE, grant, prefill_id)
    ended: dict[str, float] = {}
    outcome: dict[str, str] = {}

    async def on_chunk(msg: Any) -> None:
        c = TokenChunk.decode(msg.data)
        if c.finish_reason and c.rid not in ended:
            ended[c.rid] = time.monotonic()
            outcome[c.rid] = c.finish_reason

    await nc.subscribe("pd.tokens.chaos.*", cb=on_chunk)
    page_bytes = layout.page_numel * (2 if layout.dtype in ("float16", "bfloat16") else 4)
    kinds = ["failed pull"] * n + ["expired"] * (n // 2) + ["old generation"] * (n - n // 2)
    published: dict[str, float] = {}
    try:
        for start in range(0, len(kinds), wave):
            batch = list(enumerate(kinds))[start : start + wave]
            for i, kind in batch:
                rid = f"fault-{i}"
                prompt = tuple(prompts(1, 40, seed=100 + i)[0])
                handle = KVHandle(
                    backend="mooncake",
                    endpoint=transfer.endpoint,
                    layout=layout,
                    segments=(
                        (ctypes.addressof(buffer) + (64 << 30), -(-len(prompt) // layout.page_size) * page_bytes),
                    ),
                    num_tokens=len(prompt),
                    expires_at=time.time() + (-1.0 if kind == "expired" else 60.0),
                    protocol="tcp",
                    generation=1 if kind == "failed pull" else 7,
                )
                ready = KVReady(
                    rid=rid,
                    model=model,
                    prompt_ids=prompt,
                    output_ids=(5,),
                    reply_to=f"pd.tokens.chaos.{rid}",
                    sampling=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
                    prefill_id=prefill_id,
                    handle=handle,
                    published_at=time.time(),
                )
                published[rid] = time.monotonic()
                await publish_work(nc, subjects.kv_ready(model), ready, msg_id=f"chaos-{rid}-{time.time()}")

            async def wave_done(ids: list[str] = [f"fault-{i}" for i, _ in batch]) -> bool:  # noqa: B006
                return all(r in ended for r in ids)

            await _until(wave_done, limit + 5)
    finally:
        await nc.close()
        transfer.close()
    waits = [ended[r] - published[r] for r in published if r in ended]
    by_kind: dict[str, float] = {}
    for i, kind in enumerate(kinds):
        rid = f"fault-{i}"
        if rid in ended:
            by_kind[kind] = max(by_kind.get(kind, 0.0), ended[rid] - published[rid])
    unfinished = len(published) - len(waits)
    async with client_for() as client:

        async def idle() -> bool:
            return all(w["pages_used"] == 0 for w in await system.aworkers(client))

        pages_back = await _until(idle, 10)
    worst = max(waits, default=float("inf"))
    completed = sum(1 for r in outcome.values() if r == "length")
    ok = unfinished == 0 and worst <= limit and pages_back
    slowest = ", ".join(f"{kind} {seconds:.2f}s" for kind, seconds in by_kind.items())
    figure = (
        f"{completed}/{len(kinds)} completed, {unfinished} unfinished; slowest: {slowest}; "
        f"pages {'back to baseline' if pages_back else 'NOT back'}"
    )
    return CaseResult("injected transfer failures and expired handles", ok, figure, {"waits_s": waits})


async def _nats_url(system: ChaosSystem) -> str:
    """The broker's URL, from its ports file."""
    import json

    for path in (system.data_dir / "data" / "nats" / "ports").glob(f"*_{system.broker_pid()}.ports"):
        return str(json.loads(path.read_text())["nats"][0])
    raise RuntimeError("no ports file for the running broker")


def _nats_options(system: ChaosSystem) -> dict[str, Any]:
    """Connect as the broker's ``admin`` (every subject: the harness plays every role)."""
    from pdserve.broker.credentials import ADMIN, embedded_auth

    return embedded_auth(system.data_dir / "data" / "nats" / "auth", ADMIN).options()


# ---- forced redelivery and duplicate publish ----------------------------------------------------
async def redelivery(system: ChaosSystem, n: int = 32, max_new: int = 96) -> CaseResult:
    """Every request published twice (a second copy past the dedup window) and one decode
    worker drained mid-run (its KV events go back to the stream), with temperature 1 and
    no seed: every stream must be whole, no token repeated, none spliced."""
    import nats

    from pdserve.broker import subjects

    async with client_for() as client:
        model = (await system.aworkers(client))[0]["model"]
    observer = Observer(await _nats_url(system), model, _nats_options(system))
    copier = await nats.connect(await _nats_url(system), **_nats_options(system))
    copies: list[str] = []

    async def copy(data: bytes, req: dict[str, Any]) -> None:
        if req.get("attempt", 0) == 0 and req["rid"] not in copies:
            copies.append(req["rid"])
            await copier.jetstream().publish(
                subjects.requests(model), data, headers={"Nats-Msg-Id": f"{req['rid']}-copy"}
            )

    await observer.start(on_request=copy)
    drained = asyncio.Event()

    async def on_event(s: Streamed) -> None:
        if len(s.tokens) >= max_new // 3 and not drained.is_set():
            drained.set()
            async with client_for() as client:
                victim = await _busiest(system, client, "decode")
            system.kill(victim["pid"], signal.SIGTERM)

    try:
        runs = await run_streams(system, prompts(n, 32, seed=5), max_new, "twice", temperature=1.0, on_event=on_event)
        await asyncio.sleep(0.5)
        spliced = sum(bool(observer.splices(r.rid, r.tokens)) for r in runs)
    finally:
        await observer.stop()
        await copier.close()
    repeated = sum(r.repeated > 0 or len(r.tokens) != max_new for r in runs)
    complete = sum(r.complete for r in runs)
    ok = complete == n and repeated == 0 and spliced == 0 and len(copies) >= n
    figure = (
        f"{complete}/{n} complete; {repeated} with duplicated tokens, {spliced} spliced ({len(copies)} published twice)"
    )
    return CaseResult("forced redelivery and duplicate publish", ok, figure)


# ---- many streams -------------------------------------------------------------------------------
async def many_streams(system: ChaosSystem, n: int = 1000, max_new: int = 16) -> CaseResult:
    started = time.monotonic()
    async with client_for(n) as client:
        ps = prompts(n, 16, seed=6)
        runs = await asyncio.gather(*(stream(client, system.url, p, max_new, f"many-{i}") for i, p in enumerate(ps)))
    complete = sum(r.complete and len(r.tokens) == max_new for r in runs)
    seconds = time.monotonic() - started
    return CaseResult(f"{n} concurrent SSE streams", complete == n, f"{complete}/{n} complete in {seconds:.0f}s")


CASES = {
    "decode-kill": decode_kill,
    "prefill-kill": prefill_kill,
    "drain": drain,
    "broker-restart": broker_restart,
    "disconnects": disconnects,
    "transfer-faults": transfer_faults,
    "redelivery": redelivery,
    "many-streams": many_streams,
    "huge-body": huge_body,
}
