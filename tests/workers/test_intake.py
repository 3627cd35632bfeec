"""workers.intake against a real nats-server: nothing is fetched without room, batches
never exceed the room, and a freed room wakes the loop at once."""

from __future__ import annotations

import asyncio
import time

from pdserve.broker import contract, queues
from pdserve.broker.connection import connect
from pdserve.broker.consumer import Delivery
from pdserve.broker.streams import BrokerConfig, ensure_model
from pdserve.schemas import GenerateRequest
from pdserve.workers.intake import Intake

MODEL = "intake-test"


async def test_intake_fetches_only_what_there_is_room_for(nats_server) -> None:
    nc = await connect(nats_server.url, "intake-test")
    js = nc.jetstream()
    await ensure_model(js, MODEL, BrokerConfig())
    for i in range(5):
        req = GenerateRequest(rid=f"r{i}", model=MODEL, prompt_ids=(1, 2), reply_to=f"pd.tokens.t.r{i}")
        await queues.submit(nc, contract.REQUESTS, req, MODEL, req.rid)
    queue = queues.WorkQueue(nc, contract.REQUESTS, MODEL, "w")
    await queue.start()
    room = [0]
    batches: list[list[str]] = []

    async def free() -> int:
        return room[0]

    async def take(deliveries: list[Delivery[GenerateRequest]]) -> None:
        batches.append([d.message.rid for d in deliveries])
        room[0] -= len(deliveries)
        for d in deliveries:
            await d.ack()

    intake = Intake(queue, free, take, max_batch=2, fetch_timeout=0.2, idle_wait=5.0)
    stopping = asyncio.Event()
    loop = asyncio.create_task(intake.run(stopping))
    try:
        await asyncio.sleep(0.3)
        assert batches == []  # no room: nothing fetched
        room[0] = 3
        started = time.monotonic()
        intake.room_freed.set()  # wakes the loop long before idle_wait
        while sum(map(len, batches)) < 3:
            assert time.monotonic() - started < 3.0
            await asyncio.sleep(0.01)
        assert all(len(b) <= 2 for b in batches)
        assert [rid for b in batches for rid in b] == ["r0", "r1", "r2"]
    finally:
        stopping.set()
        intake.room_freed.set()
        await asyncio.wait_for(loop, 5)
        await intake.stop()
        await nc.close()
