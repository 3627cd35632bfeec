"""Which CPU cores a process runs on (Linux affinity): ``pdserve up --pin-cores`` gives each
CPU worker cores of its own and the API, the broker and their clients the rest, so that
none of them preempts a worker's OpenMP threads mid-step (they wait for each other at
every operation: one thread taken away holds up the step)."""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections.abc import Iterable, Sequence


def parse_cpus(text: str) -> list[int]:
    """``"0-3,8"`` → ``[0, 1, 2, 3, 8]`` (the kernel's cpu-list format)."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        last = last if dash else first
        if not (first.isdigit() and last.isdigit()) or int(last) < int(first):
            raise ValueError(f"not a list of CPU cores: {text!r} (e.g. 0-3,8)")
        cores += range(int(first), int(last) + 1)
    return sorted(set(cores))


def format_cpus(cores: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpus`, in ranges."""
    spans: list[list[int]] = []
    for core in sorted(set(cores)):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def available() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def spare(cores: Sequence[int]) -> list[int]:
    """The cores left to the API, the broker and clients: one in eight, the first ones."""
    return list(cores[: len(cores) // 8])


def core_plan(threads: Sequence[int], cores: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """(:func:`spare`; each worker's own cores: as many as its ``threads``, in runs after
    the spare ones). Raises ValueError where that does not fit: fewer than eight cores, or
    more threads than the rest."""
    left = spare(cores)
    if not left or sum(threads) > len(cores) - len(left) or min(threads, default=1) < 1:
        raise ValueError(
            f"{len(cores)} cores cannot give workers of {'+'.join(map(str, threads))} threads "
            "their own and leave one in eight"
        )
    own, start = [], len(left)
    for n in threads:
        own.append(list(cores[start : start + n]))
        start += n
    return left, own


def pin(cores: Iterable[int], pid: int | None = None) -> None:
    """Every thread of process ``pid`` (default: this one) onto ``cores``; threads they
    start later inherit it. (Affinity is a thread's: the process's main thread alone is
    not enough once a runtime has started its threads.)"""
    mask = set(cores)
    pid = pid or os.getpid()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


class CoreShare:
    """CPU workers of one host sharing its cores by load (``pdserve up --share-cores``).

    A file holds the cores to share and one slot per worker: its pid, its weight while it
    has work (its ``--num-threads``: the static split ``up`` would give it) and when it last
    said so. Before each step a worker marks itself busy and takes its weight's share of
    the cores among the workers busy now, as its torch threads (all of them when it is the
    only one); idle, it marks itself so. A one-wave PD run thus gives decode every core once
    the prompts are computed, where a fixed split leaves prefill's half idle. A slot not
    refreshed for :attr:`STALE` seconds (a worker killed mid-step) counts as idle."""

    SLOTS = 64
    STALE = 30.0
    _HEADER = struct.Struct("<q")
    _SLOT = struct.Struct("<qdd")  # pid, weight while busy (0: idle), monotonic time

    def __init__(self, path: str | os.PathLike[str], weight: int) -> None:
        if weight < 1:
            raise ValueError(f"a worker's weight in a core share is its threads, at least 1: {weight}")
        self.path = os.fspath(path)
        self.weight = float(weight)
        try:
            self._file = open(self.path, "r+b")  # held for the process's life
        except FileNotFoundError:
            raise ValueError(f"no core share at {self.path} (`CoreShare.create` makes one)") from None
        size = self._HEADER.size + self.SLOTS * self._SLOT.size
        if os.fstat(self._file.fileno()).st_size != size:
            self._file.close()
            raise ValueError(f"{self.path} is not a core share ({size} bytes)")
        self._map = mmap.mmap(self._file.fileno(), size)
        (self.cores,) = self._HEADER.unpack_from(self._map, 0)
        self.slot = self._take_slot()
        self.threads = 0  # what this worker last took (0: not yet)

    @classmethod
    def create(cls, path: str | os.PathLike[str], cores: int) -> None:
        """A share of ``cores`` cores at ``path``, no worker in it (replacing any there)."""
        if cores < 1:
            raise ValueError(f"a core share needs at least one core: {cores}")
        with open(path, "wb") as f:
            f.write(cls._HEADER.pack(cores) + bytes(cls.SLOTS * cls._SLOT.size))

    def _offset(self, slot: int) -> int:
        return self._HEADER.size + slot * self._SLOT.size

    def _take_slot(self) -> int:
        """The first slot free or left by a process that is gone, under the file's lock."""
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            for slot in range(self.SLOTS):
                pid, _, _ = self._SLOT.unpack_from(self._map, self._offset(slot))
                if pid == 0 or not _alive(pid):
                    self._SLOT.pack_into(self._map, self._offset(slot), os.getpid(), 0.0, time.monotonic())
                    return slot
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)
        raise ValueError(f"{self.path}: all {self.SLOTS} slots of the core share are taken")

    def _mark(self, weight: float) -> float:
        now = time.monotonic()
        self._SLOT.pack_into(self._map, self._offset(self.slot), os.getpid(), weight, now)
        return now

    def share(self) -> int:
        """Mark this worker busy; its threads now: its weight's share of the cores among
        the busy workers (at least one)."""
        now = self._mark(self.weight)
        busy = 0.0
        for slot in range(self.SLOTS):
            pid, weight, stamp = self._SLOT.unpack_from(self._map, self._offset(slot))
            if pid and weight and now - stamp < self.STALE:
                busy += weight
        return max(1, int(self.cores * self.weight / busy))

    def take(self) -> int:
        """:meth:`share`, and set torch's threads to it when it changed (call from the
        thread that runs the steps: OpenMP's thread count is per calling thread)."""
        threads = self.share()
        if threads != self.threads:
            import torch

            torch.set_num_threads(threads)
            self.threads = threads
        return threads

    def idle(self) -> None:
        """This worker has no step to run: its share goes to the busy ones."""
        self._mark(0.0)

    def close(self) -> None:
        """Leave the share (the slot is free for the next worker)."""
        if self._map.closed:
            return
        self._SLOT.pack_into(self._map, self._offset(self.slot), 0, 0.0, 0.0)
        self._map.close()
        self._file.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
