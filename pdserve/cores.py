"""Which CPU cores a process runs on (Linux affinity): ``pdserve up --pin-cores`` gives each
CPU worker cores of its own and the API, the broker and their clients the rest, so that
none of them preempts a worker's OpenMP threads mid-step (they wait for each other at
every operation: one thread taken away holds up the step)."""

from __future__ import annotations

import os
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
