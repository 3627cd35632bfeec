"""Decode steps replayed as CUDA graphs: one launch per step instead of hundreds.

A graph is captured per batch-size bucket (1, 2, 4, 8, then steps of 8 up to
``max_batch``); a step of ``n`` sequences replays the smallest bucket that holds it, the
extra rows pointing at a scratch page that no sequence owns. Inputs travel in one
pinned host buffer and one copy, into static device buffers that every graph reads; a
sequence whose input token is still on the device (an overlapped step) is fed it there
(one small kernel before the replay).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from pdserve.engine.models.batch import StepBatch

log = logging.getLogger(__name__)


def buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(8 if max_batch > 8 else max_batch, max_batch + 1, 8 if max_batch > 8 else max_batch))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode steps of ``forward`` for every bucket up to ``max_batch``."""

    def __init__(
        self,
        forward: Callable[[StepBatch], torch.Tensor],
        max_batch: int,
        max_pages: int,
        page_size: int,
        scratch_page: int,
        splits_for: Callable[[int], int],
        device: torch.device,
        kv_first: bool = False,
    ) -> None:
        self.forward = forward
        self.kv_first = kv_first  # rows of one sequence side by side: speculative verifies
        self.max_batch = max_batch
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.splits_for = splits_for
        self.buckets = buckets(max_batch)
        # One row each: input ids, positions, slots, context lengths, feed rows; then the
        # page tables, row by row. One buffer, so that a step's inputs and its rows of the
        # tables leave in one copy. Two host copies in turn: one is written while the other
        # may still be on its way over.
        self._row_bytes = 5 * max_batch * 8
        size = self._row_bytes + max_batch * max_pages * 4
        self.max_pages = max_pages
        self._stages = [(torch.zeros(size, dtype=torch.uint8, pin_memory=True), torch.cuda.Event()) for _ in range(2)]
        self._stage = 0
        self._bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        self._inputs, self._tables = self._views(self._bytes)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def _views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs ``int64 [5, max_batch]`` and tables ``int32 [max_batch, max_pages]`` in ``buffer``."""
        rows = buffer[: self._row_bytes].view(torch.int64).view(5, self.max_batch)
        return rows, buffer[self._row_bytes :].view(torch.int32).view(self.max_batch, self.max_pages)

    def _step(self, batch: int) -> StepBatch:
        return StepBatch(
            input_ids=self._inputs[0, :batch],
            positions=self._inputs[1, :batch],
            slots=self._inputs[2, :batch],
            num_decodes=batch,
            decode_tables=self._tables[:batch],
            decode_ctx_lens=self._inputs[3, :batch],
            decode_splits=self.splits_for(batch),
            prefill=None,
            sample_index=None,
            kv_first=self.kv_first,
        )

    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory."""
        started = time.monotonic()
        host, _ = self._stages[0]
        rows, tables = self._views(host)
        self._fill_padding(rows.numpy(), tables.numpy(), 0, self.max_batch)
        self._bytes.copy_(host)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.buckets):
                step = self._step(batch)
                for _ in range(2):  # compile and autotune outside the capture
                    self.forward(step)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._outputs[batch] = self.forward(step)
                self._graphs[batch] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info(
            "verify graphs captured" if self.kv_first else "decode graphs captured",
            extra={
                "buckets": len(self.buckets),
                "max_batch": self.max_batch,
                "seconds": round(time.monotonic() - started, 2),
            },
        )

    def bucket(self, n: int) -> int | None:
        for size in self.buckets:
            if size >= n:
                return size
        return None

    def run(
        self,
        ids: list[int],
        positions: list[int],
        tables: list[list[int]],
        feed: tuple[torch.Tensor, list[int]] | None = None,
    ) -> torch.Tensor:
        """Logits ``[n, vocab]`` for ``n`` decoding sequences (``tables[i]`` covers position i);
        ``feed`` names rows whose input token is on the device (see ``ModelRunner.execute``)."""
        n = len(ids)
        batch = self.bucket(n)
        assert batch is not None, f"{n} sequences exceed the largest graph"
        host, uploaded = self._stages[self._stage]
        self._stage ^= 1
        uploaded.synchronize()  # this copy's last trip to the device has left
        page = self.page_size
        host_rows, host_tables = self._views(host)
        rows = host_rows.numpy()
        table_rows = host_tables.numpy()
        rows[0, :n] = ids
        rows[1, :n] = positions
        for i, (p, table) in enumerate(zip(positions, tables, strict=True)):
            table_rows[i, : len(table)] = table
            rows[2, i] = table[p // page] * page + p % page
        rows[3, :n] = rows[1, :n] + 1
        rows[4, :n] = feed[1] if feed is not None else -1
        self._fill_padding(rows, table_rows, n, batch)
        used = self._row_bytes + batch * self.max_pages * 4
        self._bytes[:used].copy_(host[:used], non_blocking=True)
        uploaded.record()
        if feed is not None:
            from pdserve.engine.kernels import elementwise  # the fast path has Triton

            elementwise.feed(self._inputs[0, :n], self._inputs[4, :n], feed[0])
        self._graphs[batch].replay()
        return self._outputs[batch][:n]

    def _fill_padding(self, rows: np.ndarray, table_rows: np.ndarray, start: int, end: int) -> None:
        """Rows ``start..end`` decode one token on the scratch page: harmless, discarded."""
        if start >= end:
            return
        rows[:2, start:end] = 0
        rows[2, start:end] = self.scratch_page * self.page_size
        rows[3, start:end] = 1
        rows[4, start:end] = -1
        table_rows[start:end, 0] = self.scratch_page
