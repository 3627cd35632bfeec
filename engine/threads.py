"""Threads beside an engine's own that may run torch ops (KV copies into the pool, tier reads
and writes): each runs its ops on itself alone.

A torch op in a fresh thread starts an OpenMP team of its own with the process's thread count,
and once a process holds more OpenMP threads than cores, libgomp stops spinning between
parallel regions: the engine's team then sleeps and wakes around every op. Measured on 2 cores
(2026-12-04): a PD decode worker with two threads stepped in 25 ms, as with one, against 18
unified, because its KV-pull threads had started teams of their own; with them held to one
thread it steps in 19.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    try:
        return ctypes.CDLL("libgomp.so.1").omp_set_num_threads  # torch's, already loaded
    except (OSError, AttributeError):
        return None


def one_torch_thread() -> None:
    """Hold this thread's torch ops to one thread, without touching the process-wide count
    (``torch.set_num_threads`` would change it for every thread started later)."""
    torch.get_num_threads()  # torch's own first-use setup of this thread, which would undo the call below
    setter = _omp_set_num_threads()
    if setter is not None:
        setter(1)
    else:  # not libgomp: torch's call, which also sets the count new threads start with
        torch.set_num_threads(1)


def helper_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of helper threads, each held to one torch thread."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=one_torch_thread)


def helper_thread(target: Callable[[], Any], name: str) -> threading.Thread:
    """A daemon helper thread (not started), held to one torch thread."""

    def run() -> None:
        one_torch_thread()
        target()

    return threading.Thread(target=run, name=name, daemon=True)
