"""What the broker costs: publish -> fetch time at each of the two queues.

Against a real nats-server (started here, JetStream with file storage, the streams and
consumers pdserve creates), a publisher (this process, like the API) sends ``GenerateRequest``s to ``pd.req.<model>``
and ``KVReady``s (with a 512-token prompt and a 4-page handle, the size decode sees) to
``pd.kv.<model>``, ``N`` at a time (1 = one in flight; 64 = a burst of 64 published
concurrently), and a consumer in another process (like a worker) fetches and acks them. Latency is from the timestamp the
message carries (taken when its coroutine builds it, just before publishing it; until
2026-12-02 every message of a burst was built and stamped before the first was published,
which charged each with the building of all 64) to the moment the fetch returns it.

Two consumers are measured in the same run:

* ``pdserve``: ``broker.consumer.PullConsumer`` (one lingering pull for the first
  message, one ``no_wait`` pull for the rest; acks without waiting);
* ``naive``: nats-py's ``pull_subscribe`` + ``fetch(16, timeout=5)`` in a loop,
  ``await msg.ack()`` one by one.

    python bench/broker_latency.py --rounds 50 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.broker import streams, subjects
from pdserve.broker.connection import publish_work
from pdserve.broker.consumer import PullConsumer
from pdserve.broker.server import start_nats_server
from pdserve.schemas import GenerateRequest, KVHandle, KVLayout, KVReady, SamplingParams

MODEL = "bench"


def message(kind: str, rid: str) -> GenerateRequest | KVReady:
    prompt = tuple(range(100, 612))
    req = GenerateRequest(
        rid=rid, model=MODEL, prompt_ids=prompt[:128], reply_to=subjects.tokens("x", rid), published_at=time.time()
    )
    if kind == "request":
        return req
    layout = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, page_size=16, dtype="bfloat16")
    handle = KVHandle(
        "mooncake", "127.0.0.1:12345", layout, ((140000000000, 4 * 16 * 28 * 2 * 4 * 128 * 2),), 512, time.time() + 30
    )
    return KVReady(
        rid=rid,
        model=MODEL,
        prompt_ids=prompt,
        output_ids=(7,),
        reply_to=req.reply_to,
        sampling=SamplingParams(),
        prefill_id="prefill-x",
        handle=handle,
        published_at=time.time(),
    )


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


async def consume(url: str, kind: str, consumer_kind: str, total: int, ready: Any) -> list[float]:
    """Runs in its own process, as a worker would: fetch, stamp, ack."""
    nc = await nats.connect(url)
    stream = subjects.REQUEST_STREAM if kind == "request" else subjects.KV_STREAM
    durable = subjects.prefill_consumer(MODEL) if kind == "request" else subjects.decode_consumer(MODEL)
    subject = subjects.requests(MODEL) if kind == "request" else subjects.kv_ready(MODEL)
    decoder = GenerateRequest if kind == "request" else KVReady
    latencies: list[float] = []
    if consumer_kind == "pdserve":
        pc = PullConsumer(nc, stream, durable)
        await pc.start()
        ready.set()
        while len(latencies) < total:
            msgs = await pc.fetch(64, 5.0)
            now = time.time()
            latencies.extend((now - decoder.decode(m.data).published_at) * 1e3 for m in msgs)
            for m in msgs:
                await m.ack()
    else:
        psub = await nc.jetstream().pull_subscribe(subject, durable=durable, stream=stream)
        ready.set()
        while len(latencies) < total:
            try:
                msgs = await psub.fetch(16, timeout=5)
            except TimeoutError:
                continue
            now = time.time()
            latencies.extend((now - decoder.decode(m.data).published_at) * 1e3 for m in msgs)
            for m in msgs:
                await m.ack_sync()  # the naive loop waits for each ack
    await nc.close()
    return latencies


def consumer_process(url: str, kind: str, consumer_kind: str, total: int, ready: Any, out: Any) -> None:
    out.send(asyncio.run(consume(url, kind, consumer_kind, total, ready)))


async def measure(
    url: str, kind: str, consumer_kind: str, burst: int, rounds: int, publish_ms: list[float]
) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=consumer_process, args=(url, kind, consumer_kind, burst * rounds, ready, send))
    proc.start()
    await asyncio.get_running_loop().run_in_executor(None, ready.wait, 60)
    pub = await nats.connect(url)
    subject = subjects.requests(MODEL) if kind == "request" else subjects.kv_ready(MODEL)

    async def one(rid: str) -> None:
        # built, stamped and published by its own coroutine, as each API request handler
        # does: message k's clock starts when the k before it have been handed to the
        # client, not before any of them
        await publish_work(pub, subject, message(kind, rid), msg_id=rid)

    for r in range(rounds):
        ids = [f"{kind}-{consumer_kind}-{r}-{i}-{time.time_ns()}" for i in range(burst)]
        started = time.perf_counter()
        await asyncio.gather(*(one(rid) for rid in ids))
        publish_ms.append((time.perf_counter() - started) * 1e3)
        await asyncio.sleep(0.02 if burst == 1 else 0.2)  # let the round drain: in-flight stays at `burst`
    await pub.close()
    latencies = await asyncio.get_running_loop().run_in_executor(None, receive.recv)
    proc.join(30)
    return latencies


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    server = start_nats_server(Path(tempfile.mkdtemp(prefix="pdserve-broker-")))
    try:
        nc = await nats.connect(server.url)
        config = streams.BrokerConfig(file_storage=args.storage == "file")
        await streams.ensure_model(nc.jetstream(), MODEL, config)
        await nc.close()
        rows = []
        for kind in ("request", "kv"):
            for burst in (1, 64):
                for consumer in ("pdserve", "naive"):
                    pub: list[float] = []
                    lat = await measure(
                        server.url, kind, consumer, burst, args.rounds if burst == 1 else max(args.rounds // 5, 5), pub
                    )
                    row = {
                        "storage": args.storage,
                        "queue": kind,
                        "in_flight": burst,
                        "consumer": consumer,
                        "n": len(lat),
                        "p50_ms": percentile(lat, 0.5),
                        "p99_ms": percentile(lat, 0.99),
                        "publish_all_ms_p50": percentile(pub, 0.5),
                    }
                    rows.append(row)
                    print(
                        f"{kind:8} x{burst:<3} {consumer:8} p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  (n={len(lat)})",
                        file=sys.stderr,
                    )
                    nc = await nats.connect(server.url)  # fresh durable consumers per row
                    js = nc.jetstream()
                    await js.delete_consumer(
                        subjects.REQUEST_STREAM if kind == "request" else subjects.KV_STREAM,
                        subjects.prefill_consumer(MODEL) if kind == "request" else subjects.decode_consumer(MODEL),
                    )
                    await streams.ensure_model(js, MODEL, config)
                    await nc.close()
        return {"rows": rows}
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="rounds of one message (bursts: a fifth as many)")
    parser.add_argument(
        "--storage", choices=["file", "memory"], default="file", help="stream storage (default: %(default)s)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(
        "| queue | in flight | consumer | publish -> fetch p50 (ms) | p99 (ms) | publishing the whole burst, p50 (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for r in result["rows"]:  # type: ignore[index]
        print(
            f"| {r['queue']} | {r['in_flight']} | {r['consumer']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['publish_all_ms_p50']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
