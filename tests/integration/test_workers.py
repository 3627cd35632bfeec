"""Workers in this process against a real nats-server and real Mooncake engines:
held KV and its release, cancel and expiry; decode's fallbacks; hand-back on shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import nats
import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.api.gateway import Gateway
from pdserve.broker import streams, subjects
from pdserve.broker.connection import publish_work
from pdserve.broker.consumer import PullConsumer
from pdserve.engine.config import EngineConfig
from pdserve.schemas import Cancel, GenerateRequest, KVHandle, KVReady, KVRelease, SamplingParams, TokenChunk

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


async def until(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def replies(nc: Any, subject: str, keepalives: bool = False) -> asyncio.Queue[TokenChunk]:
    """Chunks arriving at ``subject`` (without the ``alive`` ones unless ``keepalives``)."""
    queue: asyncio.Queue[TokenChunk] = asyncio.Queue()

    async def on(msg: Any) -> None:
        chunk = TokenChunk.decode(msg.data)
        if keepalives or chunk.state != "alive":
            await queue.put(chunk)

    await nc.subscribe(subject, cb=on)
    return queue


def reference(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[
            0, len(prompt) :
        ].tolist()


async def test_prefill_holds_kv_until_release_cancel_or_expiry(workers, nats_server, tiny_model_dir: Path) -> None:
    prefill = await workers("prefill", kv_hold_seconds=3.0, kv_hold_grace_seconds=0.2)
    nc = await nats.connect(nats_server.url)
    model = tiny_model_dir.name
    inbox = "pd.tokens.test.prefill"
    chunks = await replies(nc, inbox)
    kv = PullConsumer(nc, subjects.KV_STREAM, subjects.decode_consumer(model))
    await kv.start()
    used = prefill.engine.pages
    try:
        for rid in ("released", "cancelled", "expired"):
            req = GenerateRequest(rid=rid, model=model, prompt_ids=tuple(range(5, 90)), reply_to=inbox, sampling=GREEDY)
            await publish_work(nc, subjects.requests(model), req, msg_id=rid)
            first = await asyncio.wait_for(chunks.get(), 15)
            assert first.rid == rid and first.seq == 0 and len(first.token_ids) == 1
            (msg,) = await kv.fetch(1, 10)
            ready = KVReady.decode(msg.data)
            await msg.ack()
            assert ready.handle.num_tokens == 85 and ready.prefill_id == prefill.worker_id
            assert sum(s[1] for s in ready.handle.segments) == 6 * prefill.engine.runner.pool.page_bytes
            assert used.num_used_pages == 6 and rid in prefill.holds
            started = time.monotonic()
            if rid == "released":
                await nc.publish(
                    subjects.kv_release(prefill.worker_id), KVRelease(rid=rid, prefill_id=prefill.worker_id).encode()
                )
            elif rid == "cancelled":
                await nc.publish(subjects.CANCEL, Cancel(rid=rid).encode())
            await until(lambda: used.num_used_pages == 0)
            if rid == "expired":
                assert time.monotonic() - started > 2.0  # freed by the expiry, not earlier
            assert not prefill.holds
    finally:
        await nc.close()


async def _publish_ready(nc: Any, ready: KVReady, msg_id: str | None = None) -> None:
    await publish_work(nc, subjects.kv_ready(ready.model), ready, msg_id=msg_id or ready.rid)


async def test_decode_recomputes_when_the_handle_is_expired(workers, nats_server, tiny_model_dir: Path) -> None:
    decode = await workers("decode")
    prompt = list(range(40, 110))
    expected = reference(tiny_model_dir, prompt, GREEDY.max_new_tokens)
    layout = decode.engine.runner.pool.layout
    nc = await nats.connect(nats_server.url)
    released: asyncio.Queue[KVRelease] = asyncio.Queue()

    async def on_release(msg: Any) -> None:
        await released.put(KVRelease.decode(msg.data))

    await nc.subscribe(subjects.kv_release("gone-prefill"), cb=on_release)
    chunks = await replies(nc, "pd.tokens.test.decode")
    ready = KVReady(
        rid="recompute-expired",
        model=tiny_model_dir.name,
        prompt_ids=tuple(prompt),
        output_ids=(expected[0],),
        reply_to="pd.tokens.test.decode",
        sampling=GREEDY,
        prefill_id="gone-prefill",
        handle=KVHandle(
            "mooncake", "127.0.0.1:1", layout, ((4096, 5 * layout.page_numel * 4),), len(prompt), time.time() - 1
        ),
    )
    try:
        await _publish_ready(nc, ready)
        tokens: list[int] = []
        while True:
            chunk = await asyncio.wait_for(chunks.get(), 20)
            assert chunk.error is None
            assert chunk.seq == 1 + len(tokens)
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                break
        assert [expected[0], *tokens] == expected
        release = await asyncio.wait_for(released.get(), 5)
        assert release.rid == ready.rid and not release.ok
        await until(lambda: decode.engine.pages.num_used_pages == 0)
        assert decode.counters["recomputes"] == 1 and decode.counters["kv_pulls"] == 0
    finally:
        await nc.close()


@pytest.mark.parametrize("why", ["page size", "dtype", "protocol", "kv heads"])
async def test_a_handle_decode_cannot_read_is_a_clear_error(
    workers, nats_server, tiny_model_dir: Path, why: str
) -> None:
    """Pools started with different --page-size, --dtype or transport, or KV heads that do
    not map between the tensor-parallel sizes (here 2 ranks of 2 heads against 1 rank of 2):
    every request would silently recompute; instead it fails with a message naming what
    differs."""
    decode = await workers("decode")
    layout = decode.engine.runner.pool.layout
    protocol = "tcp"
    ranks: dict[str, Any] = {}
    if why == "page size":
        layout = dataclasses.replace(layout, page_size=layout.page_size * 2)
    elif why == "dtype":
        layout = dataclasses.replace(layout, dtype="float16")
    elif why == "kv heads":
        ranks = {"tp_size": 2, "rank_endpoints": ("127.0.0.1:1", "127.0.0.1:2"), "rank_bases": (4096, 1 << 20)}
    else:
        protocol = "rdma"
    nc = await nats.connect(nats_server.url)
    chunks = await replies(nc, "pd.tokens.test.mismatch")
    prompt = tuple(range(40, 110))
    ready = KVReady(
        rid=f"mismatch-{why.replace(' ', '-')}",
        model=tiny_model_dir.name,
        prompt_ids=prompt,
        output_ids=(5,),
        reply_to="pd.tokens.test.mismatch",
        sampling=GREEDY,
        prefill_id="other-prefill",
        handle=KVHandle(
            "mooncake",
            "127.0.0.1:1",
            layout,
            ((4096, 5 * layout.page_numel * 4),),
            len(prompt),
            time.time() + 60,
            protocol,
            **ranks,
        ),
    )
    try:
        await _publish_ready(nc, ready)
        chunk = await asyncio.wait_for(chunks.get(), 20)
        assert chunk.finish_reason == "error" and chunk.error is not None
        flag = {
            "page size": "--page-size",
            "dtype": "--dtype",
            "protocol": "--disaggregation-ib-device",
            "kv heads": "KV heads: prefill 4 (2 on each of 2 ranks), decode 2 (2 on each of 1 ranks)",
        }[why]
        assert flag in chunk.error.message and "other-prefill" in chunk.error.message
        assert decode.counters["recomputes"] == 0
        assert decode.engine.pages.num_used_pages == 0
    finally:
        await nc.close()


async def test_shutdown_hands_unfinished_requests_to_another_worker(workers, nats_server, tiny_model_dir: Path) -> None:
    first = await workers("unified", drain_seconds=0.3)
    gateway = Gateway(nats_server.url, tiny_model_dir.name, streams.BrokerConfig())
    await gateway.start()
    prompt = list(range(7, 60))
    n = 400
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    received: list[int] = []
    try:
        async for chunk in gateway.generate(prompt, params, rid="handed-back"):
            received.extend(chunk.token_ids)
            if len(received) >= 20 and not first.stopping.is_set():
                await first.shutdown()  # mid-stream: the request goes back to the queue
                await workers("unified")
            if chunk.finish_reason:
                break
        assert len(received) == n
        assert received == reference(tiny_model_dir, prompt, n)
        assert gateway.live == {}
    finally:
        await gateway.stop()


async def test_unified_worker_overlaps_steps_on_the_fast_path(workers, nats_server, tiny_model_dir: Path) -> None:
    """pdserve's own forward pass (Triton kernels, interpreted on the CPU) in a worker: the
    next decode step is launched while the last one's tokens are published."""
    worker = await workers("unified", engine=EngineConfig(max_total_tokens=2048, model_impl="pdserve"))
    assert worker.engine.overlap
    gateway = Gateway(nats_server.url, tiny_model_dir.name, streams.BrokerConfig())
    await gateway.start()
    prompts = [list(range(5, 5 + n)) for n in (9, 21, 30)]
    n = 8
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for chunk in gateway.generate(prompt, params, rid=f"fast-{i}"):
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                break
        return tokens

    try:
        received = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        assert received == [reference(tiny_model_dir, p, n) for p in prompts]
        assert worker.engine.stats.overlapped_steps > 0
        await until(lambda: worker.engine.pages.num_used_pages == 0)
    finally:
        await gateway.stop()


async def test_a_worker_steps_its_engine_in_the_thread_that_built_it(nats_server, tiny_model_dir: Path) -> None:
    """As ``pdserve unified`` runs it: the engine is built in the worker's engine thread and
    every forward pass runs there (one OpenMP pool in the process, see workers/runtime.py)."""
    import threading

    from pdserve.engine.loader import build_engine
    from pdserve.workers.config import WorkerConfig
    from pdserve.workers.runtime import engine_thread_pool
    from pdserve.workers.unified import UnifiedWorker

    config = WorkerConfig(
        role="unified",
        model_path=tiny_model_dir,
        model_name=tiny_model_dir.name,
        nats_url=nats_server.url,
        engine=EngineConfig(max_total_tokens=16 * 512),
    )
    pool = engine_thread_pool()
    built_in = pool.submit(threading.get_ident).result()
    engine = pool.submit(build_engine, tiny_model_dir, config.engine).result()
    ran_in: set[int] = set()
    launch = engine.launch
    engine.launch = lambda batch: (ran_in.add(threading.get_ident()), launch(batch))[1]  # type: ignore[method-assign]
    worker = UnifiedWorker(config, engine, pool)
    await worker.start()
    gateway = Gateway(nats_server.url, tiny_model_dir.name, streams.BrokerConfig())
    await gateway.start()
    prompt, n = list(range(9, 30)), 6
    try:
        tokens: list[int] = []
        async for chunk in gateway.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0), rid="thread"):
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                break
        assert tokens == reference(tiny_model_dir, prompt, n)
        assert ran_in == {built_in}
    finally:
        await gateway.stop()
        await worker.shutdown()


async def test_a_lease_keeps_cancelled_kv_until_the_read_ends(workers, nats_server, tiny_model_dir: Path) -> None:
    from pdserve.broker import contract
    from pdserve.schemas import KVLease

    prefill = await workers("prefill", kv_hold_seconds=30.0)
    nc = await nats.connect(nats_server.url)
    model = tiny_model_dir.name
    inbox = "pd.tokens.test.lease"
    chunks = await replies(nc, inbox)
    kv = PullConsumer(nc, subjects.KV_STREAM, subjects.decode_consumer(model))
    await kv.start()
    pages = prefill.engine.pages
    try:
        req = GenerateRequest(
            rid="leased", model=model, prompt_ids=tuple(range(5, 90)), reply_to=inbox, sampling=GREEDY
        )
        await publish_work(nc, subjects.requests(model), req, msg_id=req.rid)
        await asyncio.wait_for(chunks.get(), 15)
        (msg,) = await kv.fetch(1, 10)
        await msg.ack()
        gen = KVReady.decode(msg.data).handle.generation
        assert gen != 0

        async def lease(generation: int) -> Any:
            return await contract.ask(
                nc,
                contract.KV_LEASE,
                KVLease("leased", prefill.worker_id, generation, 1.5),
                prefill.worker_id,
                timeout=5,
            )

        assert not (await lease(gen + 1)).granted  # a handle of another hold reads nothing
        assert (await lease(gen)).granted
        await nc.publish(subjects.CANCEL, Cancel(rid="leased").encode())
        await nc.publish(
            subjects.kv_release(prefill.worker_id),
            KVRelease(rid="leased", prefill_id=prefill.worker_id, generation=gen + 1).encode(),
        )
        await asyncio.sleep(0.5)
        assert pages.num_used_pages == 6  # cancelled and wrongly released, but a read may be in flight
        assert not (await lease(gen)).granted  # nobody new reads pages on their way out
        started = time.monotonic()
        await until(lambda: pages.num_used_pages == 0)
        assert time.monotonic() - started < 3.0  # freed once the lease ran out
    finally:
        await nc.close()


async def test_a_redelivered_kv_ready_after_release_reads_nothing(workers, nats_server, tiny_model_dir: Path) -> None:
    """The pages of a handle that was consumed are freed (and may be reused): the same
    KVReady again is refused its lease, and decode computes the prompt itself."""
    prefill = await workers("prefill")
    decode = await workers("decode")
    model = tiny_model_dir.name
    prompt = list(range(11, 83))
    expected = reference(tiny_model_dir, prompt, GREEDY.max_new_tokens)
    nc = await nats.connect(nats_server.url)
    seen: asyncio.Queue[KVReady] = asyncio.Queue()

    async def watch(msg: Any) -> None:
        await seen.put(KVReady.decode(msg.data))

    await nc.subscribe(subjects.kv_ready(model), cb=watch)  # core NATS sees what the stream stores
    try:
        runs = []
        for attempt in range(2):
            inbox = f"pd.tokens.test.again{attempt}"
            chunks = await replies(nc, inbox)
            if attempt == 0:
                req = GenerateRequest(
                    rid="again", model=model, prompt_ids=tuple(prompt), reply_to=inbox, sampling=GREEDY
                )
                await publish_work(nc, subjects.requests(model), req, msg_id="again")
            else:
                stale = dataclasses.replace(await asyncio.wait_for(seen.get(), 5), reply_to=inbox)
                await _publish_ready(nc, stale, msg_id="again-republished")  # past the dedup window
            tokens: list[int] = []
            while True:
                chunk = await asyncio.wait_for(chunks.get(), 20)
                assert chunk.error is None
                tokens.extend(chunk.token_ids)
                if chunk.finish_reason:
                    break
            runs.append(tokens)
            await until(lambda: decode.engine.pages.num_used_pages == 0 and prefill.engine.pages.num_used_pages == 0)
        assert runs[0] == expected and [expected[0], *runs[1]] == expected
        assert decode.counters["kv_pulls"] == 1 and decode.counters["kv_leases_refused"] == 1
        assert decode.counters["recomputes"] == 1
    finally:
        await nc.close()


async def test_an_allowed_tcp_fallback_is_logged_counted_and_advertised(
    workers, caplog: pytest.LogCaptureFixture
) -> None:
    """RDMA was asked for and could not work, and the user allowed tcp: the worker says so,
    counts it on its heartbeat (pdserve_kv_transport_fallbacks_total) and advertises tcp at
    its --transfer-host, so no decode worker mistakes it for an RDMA peer."""
    why = "mlx5_0 not found (RDMA devices here: none)"
    fell_back = await workers(
        "prefill", transport_fallback=why, transport_fallback_device="mlx5_0", transfer_host="127.0.0.2"
    )
    plain = await workers("decode")
    info = fell_back.worker_info()
    assert info.counters.kv_transport_fallbacks == 1 and info.transfer_protocol == "tcp"
    assert info.transfer_endpoint.startswith("127.0.0.2:")
    assert plain.worker_info().counters.kv_transport_fallbacks == 0
    assert any("RDMA cannot work here" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


async def test_both_sides_name_a_peer_whose_kv_heads_do_not_map(workers, caplog: pytest.LogCaptureFixture) -> None:
    """A decode worker of 1 rank and 2 KV heads, a prefill worker whose registry entry says
    2 ranks of 2 heads (4 in all): each logs the other as a peer it cannot pair with, naming
    both TP sizes; a peer that maps (2 ranks of 1 head) is not named."""
    prefill, decode = await workers("prefill"), await workers("decode")
    info = prefill.worker_info()
    assert info.tp_size == 1 and decode.worker_info().tp_size == 1
    layout = info.kv_layout
    assert layout is not None and layout.num_kv_heads == 2
    wide = dataclasses.replace(info, worker_id="prefill-wide", tp_size=2)
    fits = dataclasses.replace(
        info, worker_id="prefill-fits", tp_size=2, kv_layout=dataclasses.replace(layout, num_kv_heads=1)
    )
    await decode.on_peers([wide, fits])
    wide_decode = dataclasses.replace(decode.worker_info(), worker_id="decode-wide", tp_size=2)
    await prefill.on_peers([wide_decode])
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    said = [(getattr(r, "prefill", None) or getattr(r, "decode", None), getattr(r, "differs", "")) for r in errors]
    assert ("prefill-wide", "KV heads: prefill 4 (2 on each of 2 ranks), decode 2 (2 on each of 1 ranks)") in said
    assert ("decode-wide", "KV heads: prefill 2 (2 on each of 1 ranks), decode 4 (2 on each of 2 ranks)") in said
    assert not any(who == "prefill-fits" for who, _ in said)


@pytest.mark.parametrize("prefill_cache", [False, True])
async def test_pd_usage_reports_the_prefill_workers_cached_tokens(workers, nats_server, prefill_cache: bool) -> None:
    """In PD the prompt is computed by the prefill worker: ``usage.cached_tokens`` is what
    its prefix cache saved, not the decode worker's reuse of pages it already holds (which
    saves only a transfer). A repeated prompt with the prefill worker's cache off reports 0
    while the decode worker reused pages; with it on, the prefill worker's hit."""
    prefill = await workers(
        "prefill", engine=EngineConfig(max_total_tokens=16 * 512, enable_prefix_cache=prefill_cache)
    )
    await workers("decode")
    gateway = Gateway(nats_server.url, prefill.config.model_name, streams.BrokerConfig())
    await gateway.start()
    prompt = list(range(300, 364))  # 64 tokens: four pages
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    usages = []
    try:
        for i in range(2):
            before = prefill.engine.stats.cached_tokens
            async for chunk in gateway.generate(prompt, params, rid=f"usage-{prefill_cache}-{i}"):
                if chunk.finish_reason:
                    assert chunk.usage is not None
                    usages.append((chunk.usage.cached_tokens, prefill.engine.stats.cached_tokens - before))
                    break
    finally:
        await gateway.stop()
    assert usages[0] == (0, 0)
    reported, prefill_hit = usages[1]
    assert reported == prefill_hit
    assert (prefill_hit > 0) == prefill_cache


async def urgent_passes(worker: Any, nats_url: str, model_dir: Path, settle: float) -> None:
    """``worker`` (one seat) busy with a long request, three more queued before it: a request of
    priority -1 is done first, the long one next (it gave its seat and went on), then the
    three; every output is transformers' greedy one, the preempted request's too."""
    gateway = Gateway(nats_url, model_dir.name, streams.BrokerConfig())
    await gateway.start()
    prompts = {rid: list(range(9 + i, 40 + 2 * i)) for i, rid in enumerate(("long", "w0", "w1", "w2", "urgent"))}
    short = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    params = {rid: short for rid in prompts}
    # long enough to be running still when the urgent one arrives on a loaded 2-core machine
    params["long"] = SamplingParams(max_new_tokens=900, temperature=0.0, ignore_eos=True)
    params["urgent"] = dataclasses.replace(short, priority=-1)
    done: list[str] = []
    streaming = asyncio.Event()

    async def one(rid: str) -> list[int]:
        tokens: list[int] = []
        async for chunk in gateway.generate(prompts[rid], params[rid], rid=rid):
            tokens.extend(chunk.token_ids)
            if len(tokens) > 1:  # (past the first token: decoding, also in PD mode)
                streaming.set()
            if chunk.finish_reason:
                break
        done.append(rid)
        return tokens

    try:
        first = asyncio.create_task(one("long"))
        await asyncio.wait_for(streaming.wait(), 30)
        queued = [asyncio.create_task(one(rid)) for rid in ("w0", "w1", "w2")]
        await until(lambda: len(gateway.live) == 4)
        await asyncio.sleep(settle)  # (queued: the worker, full, takes none of them)
        assert worker.engine.num_running == 1 and len(worker.tracked) == 1 and "long" not in done
        got = await asyncio.gather(one("urgent"), first, *queued)
        received = dict(zip(("urgent", "long", "w0", "w1", "w2"), got, strict=True))
        assert done[:2] == ["urgent", "long"] and sorted(done[2:]) == ["w0", "w1", "w2"]
        assert worker.engine.scheduler.num_priority_preemptions == 1
        for rid, tokens in received.items():
            assert tokens == reference(model_dir, prompts[rid], params[rid].max_new_tokens), rid
    finally:
        await gateway.stop()


async def test_an_urgent_request_passes_a_full_worker_s_queue(workers, nats_server, tiny_model_dir: Path) -> None:
    """Unified: the request of priority -1 goes to the urgent queue, which the full worker
    takes from; it takes the long request's seat."""
    worker = await workers("unified", engine=EngineConfig(max_total_tokens=16 * 512, max_num_seqs=1))
    await urgent_passes(worker, nats_server.url, tiny_model_dir, settle=0.2)


async def test_an_urgent_request_passes_a_full_decode_worker_s_queue(
    workers, nats_server, tiny_model_dir: Path
) -> None:
    """PD: the three wait prefilled; the urgent request is prefilled, its KV-ready event goes
    to the decode pool's urgent queue, which the full decode worker takes from; the long
    request gives its seat (recomputed there later)."""
    await workers("prefill")
    decode = await workers("decode", engine=EngineConfig(max_total_tokens=16 * 512, max_num_seqs=1))
    await urgent_passes(decode, nats_server.url, tiny_model_dir, settle=0.5)
