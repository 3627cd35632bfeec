"""Claims of placed requests (real nats-server): the first owner to store one holds it."""

from __future__ import annotations

import asyncio

import nats

from pdserve.broker import streams
from pdserve.broker.claims import Claims


async def test_the_first_claim_wins_and_a_repeat_by_its_owner_is_still_its_own(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        claims = Claims(await streams.claim_bucket(nc.jetstream(), streams.BrokerConfig()))
        owners = await asyncio.gather(*(claims.claim("r1", 0, f"owner-{i}") for i in range(5)))
        assert len(set(owners)) == 1, "every contender sees the same winner"
        winner = owners[0]
        assert await claims.claim("r1", 0, winner) == winner
        assert await claims.claim("r1", 0, "late") == winner
        assert await claims.claim("r1", 1, "late") == "late", "each attempt has its own claim"
    finally:
        await nc.close()
