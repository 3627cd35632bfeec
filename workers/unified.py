"""The unified worker: both phases on one engine (the co-located "PD fusion" baseline).

It takes requests from the same queue as prefill workers, so a deployment can run
either kind, or both, against the same API.
"""

from __future__ import annotations

from pdserve.broker import subjects
from pdserve.broker.consumer import PullConsumer
from pdserve.engine.engine import RequestOutput
from pdserve.workers.runtime import WorkerRuntime


class UnifiedWorker(WorkerRuntime):
    consumer: PullConsumer | None = None

    async def setup(self) -> None:
        assert self.nc is not None
        self.consumer = PullConsumer(
            self.nc, subjects.REQUEST_STREAM, subjects.prefill_consumer(self.config.model_name)
        )
        await self.consumer.start()

    async def fetch_loop(self) -> None:
        assert self.consumer is not None
        await self.pull_requests(self.consumer, prefill_only=False)

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            await self.stream_output(out)

    async def teardown(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
