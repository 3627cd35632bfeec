"""A worker's cancels and timers: cancels that reach it, deadlines, keep-alives to clients
and to the stream, the roles' own timers, and the periodic look at its peers. A part of
:class:`~pdserve.workers.runtime.WorkerRuntime`."""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.schemas import (
    Cancel,
    WorkerInfo,
)
from pdserve.schemas.tokens import ALIVE
from pdserve.workers.replies import Tracked
from pdserve.workers.stepping import EngineLoop

log = logging.getLogger("pdserve.workers.runtime")

TICK_SECONDS = 0.25
PEER_CHECK_SECONDS = 10.0


class Housekeeping(EngineLoop):
    """Cancels and timers (over the engine loop's state)."""

    def is_cancelled(self, rid: str, attempt: int = 0, published_at: float = 0.0) -> bool:
        raise NotImplementedError

    def wake(self) -> None:
        raise NotImplementedError

    async def _on_cancel(self, cancel: Cancel) -> None:
        self.cancels.note(cancel, time.monotonic())
        await self.apply_cancel(cancel.rid, cancel.reason)

    async def apply_cancel(self, rid: str, reason: str) -> None:
        """Drop what this worker holds of ``rid`` that the cancels noted cover (a cancel of
        superseded attempts leaves a newer attempt alone)."""
        t = self.tracked.get(rid)
        if t is not None and self.is_cancelled(rid, t.attempt, t.published_at):
            await self.cancel(rid, reason)
            return
        for group in [g for g in self.tracked.values() if rid in g.samples]:  # one sample of a request
            if self.is_cancelled(rid, group.attempt, group.published_at):
                self.engine.abort(rid)
                log.info("sample cancelled", extra={"rid": rid, "reason": reason})
                await self.sample_done(group, rid)
                self.wake()

    async def cancel(self, rid: str, reason: str) -> None:
        """Drop ``rid`` everywhere in this worker and free its pages."""
        found = self.engine.abort(rid)
        self.engine.release(rid)
        t = self.tracked.pop(rid, None)
        self.requests.pop(rid, None)
        if t is not None:
            await t.settle(ok=True)  # done with it: do not redeliver a cancelled request
        if found or t is not None:
            log.info("request cancelled", extra={"rid": rid, "reason": reason})
        self.wake()

    async def _tick_loop(self) -> None:
        """Deadlines, keep-alives (a chunk to each client that heard nothing for a
        second; ``in_progress`` to the stream), the role's own timers."""
        next_second = 0.0
        next_peer_check = 0.0
        while True:
            await asyncio.sleep(TICK_SECONDS)
            now = time.monotonic()
            for t in self.in_hand():
                if now - t.sent_at >= self.config.keepalive_seconds:
                    await self.replies.state(t, ALIVE)
                await t.keep_alive(now, self.config.broker.ack_wait / 3)
            if now < next_second:
                continue
            next_second = now + 1.0
            now_wall = time.time()
            for rid, t in list(self.tracked.items()):
                if t.deadline and now_wall > t.deadline:
                    await self.replies.fail(t, "deadline exceeded", "timeout")
                    await self.cancel(rid, "deadline exceeded")
            self.cancels.forget(now)
            await self.on_tick()
            await self.publish_kv_events()
            if now >= next_peer_check:
                next_peer_check = now + PEER_CHECK_SECONDS
                await self._check_peers()

    def in_hand(self) -> list[Tracked]:
        """Every request this worker holds a delivery of (roles add what waits aside)."""
        return list(self.tracked.values())

    async def on_tick(self) -> None:
        """Called about once a second (expiry of held KV and the like)."""

    async def _check_peers(self) -> None:
        try:
            peers = await self.lifecycle.workers()
        except Exception as exc:  # the broker is away: next time
            log.debug("peer check skipped", extra={"error": str(exc)})
            return
        await self.on_peers(peers)

    async def on_peers(self, peers: list[WorkerInfo]) -> None:
        """Every ``PEER_CHECK_SECONDS``, the live workers of the registry: the transfer
        backend drops what it keeps for peers that left (their communicators)."""
        if self.transfer is not None:
            live = {w.worker_id for w in peers}
            await asyncio.get_running_loop().run_in_executor(None, self.transfer.retain, live)
