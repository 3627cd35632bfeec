"""The host-memory tier: pages demoted from the device pool, in a fixed set of slots.

``max_bytes`` of host memory (pinned when the pool is on a GPU, so copies both ways run
asynchronously on the device's stream) is cut into page-sized slots, allocated once.
Each slot holds one page keyed by its chained hash; when all are taken the least
recently used page is dropped. Copies in and out are queued on the pool device's
stream, so they are ordered with the forward passes around them: a page is read out of
the device before a later step overwrites it, and loaded before the step that reads it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pdserve.engine.kv_pool import KVPool


class HostTier:
    name = "host"

    def __init__(self, pool: KVPool, max_bytes: int) -> None:
        self.pool = pool
        self.num_slots = max_bytes // pool.page_bytes
        if self.num_slots < 1:
            raise ValueError(f"a host tier of {max_bytes} bytes holds no KV page of {pool.page_bytes} bytes")
        pin = pool.device.type == "cuda"
        self.slots = torch.empty((self.num_slots, *pool.tensor.shape[1:]), dtype=pool.tensor.dtype, pin_memory=pin)
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # LRU order, oldest first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.num_evicted = 0

    @property
    def max_bytes(self) -> int:
        return self.num_slots * self.pool.page_bytes

    @property
    def num_bytes(self) -> int:
        return len(self._slot_of) * self.pool.page_bytes

    def __len__(self) -> int:
        return len(self._slot_of)

    def contains(self, h: bytes) -> bool:
        return h in self._slot_of

    def store(self, h: bytes, page: int) -> None:
        """Copy device page ``page`` in under ``h`` (the oldest page goes if all slots are taken)."""
        slot = self._slot_of.get(h)
        if slot is not None:
            self._slot_of.move_to_end(h)
            return
        if not self._free:
            _, old = self._slot_of.popitem(last=False)
            self._free.append(old)
            self.num_evicted += 1
        slot = self._free.pop()
        self.slots[slot].copy_(self.pool.tensor[page], non_blocking=True)
        self._slot_of[h] = slot

    def load(self, h: bytes, page: int) -> bool:
        """Copy the page kept under ``h`` into device page ``page``; False if not kept."""
        slot = self._slot_of.get(h)
        if slot is None:
            return False
        self._slot_of.move_to_end(h)
        self.pool.tensor[page].copy_(self.slots[slot], non_blocking=True)
        return True

    def clear(self) -> int:
        """Forget every page; returns how many."""
        n = len(self._slot_of)
        self._free.extend(self._slot_of.values())
        self._slot_of.clear()
        return n
