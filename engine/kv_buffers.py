"""Reused host buffers for the group tiers' reads (:class:`ReadBuffers`).

A load from the disk or the store reads each page group's blob into one of a few buffers kept
for the purpose, pinned where the pool is on a GPU, instead of a fresh ``bytearray`` a group: a
fresh buffer of megabytes is page-faulted in as the file is read into it (on this project's
2-core machine 3.5 GB/s against 17.8 for reused ones, ``docs/data/tier_read_probe_cpu.json``),
and a copy to the device from pageable memory is staged by the driver, synchronously. A buffer goes back
once the copy out of it is queued; the device's event then guards its next fill.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass
class ReadBuffer:
    """One buffer: ``data`` (uint8, on the host; reads go from byte ``offset`` on) and the
    event of the last copy out of it (``None``: nothing in flight)."""

    data: torch.Tensor
    offset: int = 0
    ready: torch.cuda.Event | None = None

    def view(self) -> memoryview:
        """The buffer from ``offset`` as writable bytes, once the last copy out of it has run."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.data[self.offset :].numpy().data.cast("B")

    @property
    def address(self) -> int:
        return int(self.data.data_ptr()) + self.offset

    @property
    def size(self) -> int:
        return int(self.data.numel()) - self.offset


class ReadBuffers:
    """``count`` buffers of ``nbytes`` each (read into from byte ``offset`` of theirs: a blob
    whose header is ``offset`` short of a multiple of 64 bytes then has its pages aligned),
    allocated at first use; :meth:`take` never blocks (``None`` when all are out: the caller
    reads into a fresh buffer, counted)."""

    def __init__(self, nbytes: int, count: int, pin: bool, offset: int = 0) -> None:
        self.nbytes = nbytes
        self.count = count
        self.pin = pin
        self.offset = offset
        self._free: list[ReadBuffer] | None = None
        self._all: list[ReadBuffer] = []
        self._lock = threading.Lock()

    def allocate(self) -> list[ReadBuffer]:
        """Every buffer, allocated now if not yet (pinning megabytes takes milliseconds: a
        rate's measurement allocates first)."""
        with self._lock:
            if self._free is None:
                self._free = [
                    ReadBuffer(
                        torch.empty(self.offset + self.nbytes, dtype=torch.uint8, pin_memory=self.pin), self.offset
                    )
                    for _ in range(self.count)
                ]
                self._all = list(self._free)
            return list(self._all)

    def take(self) -> ReadBuffer | None:
        if self._free is None:
            self.allocate()
        with self._lock:
            assert self._free is not None
            return self._free.pop() if self._free else None

    def give(self, buffer: ReadBuffer, ready: torch.cuda.Event | None = None) -> None:
        """``buffer`` back; ``ready``: the event after the last copy out of it was queued."""
        if ready is not None:
            buffer.ready = ready
        with self._lock:
            assert self._free is not None and len(self._free) < self.count
            self._free.append(buffer)

    @property
    def free(self) -> int:
        with self._lock:
            return self.count if self._free is None else len(self._free)
