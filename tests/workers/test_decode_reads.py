"""A decode worker's KV read that nobody awaits any more still has its outcome taken."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from typing import Any

from pdserve.workers.decode import DecodeWorker
from pdserve.workers.transfer import TransferError


async def test_a_read_left_by_a_cancelled_request_fails_without_an_unretrieved_error() -> None:
    """The request waiting on a read is cancelled (its client left, the worker stops); the
    read's thread fails later: nothing is reported as "exception was never retrieved"."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        read: asyncio.Future[int] = loop.create_future()
        # ``self`` and the KVReady are read only when the read outlasts its limit (60 s here).
        waiter = asyncio.ensure_future(DecodeWorker._bounded(None, None, read, 30.0))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        read.set_exception(TransferError("Mooncake read of 1 segments from 127.0.0.1:1 returned -1"))
        await asyncio.sleep(0)  # its done callbacks run
        del read, waiter
        gc.collect()
        assert reported == []
    finally:
        loop.set_exception_handler(None)
