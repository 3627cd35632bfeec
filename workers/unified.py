"""The unified worker: both phases on one engine (the co-located "PD fusion" baseline).

It takes requests from the same queue as prefill workers, so a deployment can run
either kind, or both, against the same API.
"""

from __future__ import annotations

from pdserve.engine.outputs import RequestOutput
from pdserve.workers.runtime import WorkerRuntime


class UnifiedWorker(WorkerRuntime):
    async def setup(self) -> None:
        self.intake = await self.request_intake(prefill_only=False)
        self.side_intakes.append(await self.urgent_intake(prefill_only=False))
        if self.config.prefix_placement:
            self.side_intakes.append(await self.placed_intake(prefill_only=False))

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        await self.stream_outputs(outputs)
