"""Receiving work: fetch from a work queue only while the worker has room (the pull is
the back-pressure), and hand each batch of decoded deliveries to the worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from nats import errors as nats_errors

from pdserve.broker.consumer import Delivery
from pdserve.broker.queues import WorkQueue
from pdserve.schemas import Message

M = TypeVar("M", bound=Message)

log = logging.getLogger(__name__)

BROKER_RETRY_SECONDS = 0.5


class Intake(Generic[M]):
    """One worker's intake from one work queue.

    A fetch that fails because the broker is away is retried; anything else raised here
    (by ``room`` or ``take`` included) ends :meth:`run`, and so the worker.
    ``room()`` says how many more messages the worker takes now (it may do work of its
    own first); at zero the loop waits up to ``idle_wait`` for :attr:`room_freed`.
    ``take`` gets every non-empty batch of decoded deliveries.
    """

    def __init__(
        self,
        queue: WorkQueue[M],
        room: Callable[[], Awaitable[int]],
        take: Callable[[list[Delivery[M]]], Awaitable[None]],
        max_batch: int,
        fetch_timeout: float,
        idle_wait: float,
    ) -> None:
        self.queue = queue
        self.room_freed = asyncio.Event()
        self._room = room
        self._take = take
        self._max_batch = max_batch
        self._fetch_timeout = fetch_timeout
        self._idle_wait = idle_wait

    async def run(self, stopping: asyncio.Event) -> None:
        """Fetch and hand over until ``stopping`` is set."""
        while not stopping.is_set():
            room = await self._room()
            if room == 0:
                self.room_freed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._idle_wait):  # not wait_for: see runtime
                        await self.room_freed.wait()
                continue
            try:
                deliveries = await self.queue.fetch(min(room, self._max_batch), self._fetch_timeout)
            except (nats_errors.Error, TimeoutError) as exc:  # the broker is away: it comes back
                log.warning("fetch failed; retrying", extra={"error": str(exc) or type(exc).__name__})
                await asyncio.sleep(BROKER_RETRY_SECONDS)
                continue
            if deliveries:
                await self._take(deliveries)

    async def stop(self) -> None:
        await self.queue.stop()
