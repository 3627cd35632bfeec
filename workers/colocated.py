"""Prefill and decode co-located in one process on one device (``pdserve colocated``).

The process holds a :class:`~.prefill.PrefillWorker` and a :class:`~.decode.DecodeWorker`,
each exactly what it is on its own: its own JetStream consumer, registry entry, heartbeat,
counters, lease rules and engine thread. What they share:

- the model's weights (the second engine is built over the first one's model: one copy);
- the device, each engine stepping on a CUDA stream of its own, so decode's graph replays
  run beside prefill's chunks instead of after them (in one process the GPU runs both
  streams at once; two processes would take turns). Prefill's stream is in a green context:
  uncapped, prefill's kernels held every SM and a decode step beside a 2,048-token chunk
  took 31 ms instead of 5 (docs/performance.md). By default (``--prefill-sms auto``) its
  SMs follow the load (:mod:`.sm_share`); a number fixes them;
- KV, handed over by the ``local`` backend (:mod:`.transfer.local`): one device copy per
  request run from the prefill pool into the decode pool, no host memory, no socket.

The process lives and dies as one: SIGTERM stops both (each drains), and a failed task in
either stops both at once (their requests are handed back) and the process exits
non-zero, so the supervisor restarts the pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.engine import Engine
from pdserve.workers.config import WorkerConfig
from pdserve.workers.lifecycle import CRASH_EXIT_SECONDS, WorkerCrashed
from pdserve.workers.runtime import WorkerRuntime, engine_thread_pool
from pdserve.workers.sm_share import PrefillShare, green_stream

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

BACKEND = "local"
# Of the device memory free when the process starts, the decode pool takes this fraction;
# the prefill pool then takes PREFILL_KV_FRACTION of what is left. Prefill holds a prompt's
# KV only until decode has copied it (a fraction of a millisecond) and its prefix cache.
DECODE_KV_FRACTION = 0.6
PREFILL_KV_FRACTION = 0.6
# Decode's stream priority (lower is higher on CUDA) against prefill's default 0.
DECODE_STREAM_PRIORITY = -1
# With two engine threads in one interpreter, a thread waiting for the GIL takes it after
# this long at most (Python's default is 5 ms: a decode step's worth of waiting).
SWITCH_INTERVAL = 0.0005


def role_configs(base: WorkerConfig, stem: str = "") -> tuple[WorkerConfig, WorkerConfig]:
    """The prefill and decode workers' configs: ``base`` with the role, the ``local``
    backend and each engine's share of the device; ids ``<stem>-prefill`` and
    ``<stem>-decode``, or fresh ones of each role without a ``stem``."""
    engine = base.engine
    threads = engine.num_threads
    if engine.device == "cpu":  # two engine threads: half the process's cores each
        threads = max(1, (threads or os.cpu_count() or 1) // 2)
    engines = {
        "prefill": dataclasses.replace(
            engine, cuda_graph_max_batch=0, kv_memory_fraction=PREFILL_KV_FRACTION, num_threads=threads
        ),
        "decode": dataclasses.replace(engine, kv_memory_fraction=DECODE_KV_FRACTION, num_threads=threads),
    }
    prefill, decode = (
        dataclasses.replace(
            base,
            role=role,
            engine=engines[role],
            transfer_backend=BACKEND,
            transfer_protocol=BACKEND,
            worker_id=f"{stem}-{role}" if stem else "",
        )
        for role in ("prefill", "decode")
    )
    return prefill, decode


def _stream_for(device: str, priority: int, sms: int = 0) -> torch.cuda.Stream | None:
    """Make this thread's current stream one of its own (every step it runs goes there):
    in a green context of ``sms`` SMs when given (the other SMs stay free for the rest)."""
    import torch

    if not device.startswith("cuda"):
        return None
    index = torch.device(device).index or 0
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if sms < 0:  # half the SMs
        sms = total // 2
    if sms:
        if not 0 < sms < total:
            raise ValueError(f"--prefill-sms {sms}: this GPU has {total} SMs")
        stream = green_stream(sms, index)
        log.info("prefill stream in a green context", extra={"sms": sms, "of": total})
    else:
        stream = torch.cuda.Stream(torch.device(device), priority=priority)
    torch.cuda.set_stream(stream)
    return stream


def build_engines(
    prefill: WorkerConfig, decode: WorkerConfig, prefill_sms: str | int = 0, share_target: float = 2.0
) -> tuple[Engine, ThreadPoolExecutor, Engine, ThreadPoolExecutor]:
    """Both engines, each built in the thread that will run its steps (on its own stream on a
    GPU), decode's first (its CUDA graphs are captured with nothing else on the device),
    then prefill's over the same model. ``prefill_sms``: a fixed green context (a count of
    SMs; 0: none, -1: half), or ``auto``: prefill's engine gets a :class:`PrefillShare` as
    its observer, its SMs following decode's load (on a CPU, nothing)."""
    from pdserve.engine.loader import build_engine

    def make(config: WorkerConfig, priority: int, model: torch.nn.Module | None, sms: int = 0) -> Engine:
        _stream_for(config.engine.device, priority, sms)
        return build_engine(
            Path(config.model_path),
            config.engine,
            config.dtype,
            config.trust_remote_code,
            config.load_format,
            model=model,
        )

    def make_prefill(decode_engine: Engine) -> Engine:
        device = prefill.engine.device
        if prefill_sms != "auto" or not device.startswith("cuda"):
            return make(prefill, 0, decode_engine.runner.model, 0 if prefill_sms == "auto" else int(prefill_sms))
        import torch

        index = torch.device(device).index or 0
        total = torch.cuda.get_device_properties(index).multi_processor_count
        share = PrefillShare.create(index, total, share_target, decode_engine, green_stream)
        torch.cuda.set_stream(share.streams[share.rule.levels[-1]])
        share.current = share.rule.levels[-1]
        engine = make(prefill, 0, decode_engine.runner.model)
        share.prefill = engine
        engine.observer = share
        engine.time_steps = True  # the share learns each level's rate from the steps' device times
        return engine

    decode_thread = engine_thread_pool()
    decode_engine = decode_thread.submit(make, decode, DECODE_STREAM_PRIORITY, None).result()
    prefill_thread = engine_thread_pool()
    prefill_engine = prefill_thread.submit(make_prefill, decode_engine).result()
    return prefill_engine, prefill_thread, decode_engine, decode_thread


async def serve_together(workers: Sequence[WorkerRuntime]) -> None:
    """Start every worker, serve until SIGTERM/SIGINT or until any of them stops (a crash),
    then stop them all. Raises :class:`WorkerCrashed` if a supervised task of any failed."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        for worker in workers:
            await worker.start()
        waits = [asyncio.create_task(stop.wait())] + [asyncio.create_task(w.stopping.wait()) for w in workers]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)
    crashed = [w.lifecycle.crashed for w in workers if w.lifecycle.crashed is not None]
    if crashed:  # the pair goes down together: every request in hand goes back at once
        for w in workers:
            w.lifecycle.crash("co-located peer", RuntimeError(crashed[0]))
        try:
            async with asyncio.timeout(CRASH_EXIT_SECONDS):
                await asyncio.gather(*(w.shutdown() for w in workers))
        except Exception as exc:  # ending anyway: the supervisor restarts us
            log.error("shutdown after a crash did not complete", extra={"error": repr(exc)})
        raise WorkerCrashed("; ".join(crashed))
    # Prefill stops taking prompts while decode finishes what it holds (and what prefill
    # hands it meanwhile); both drain within their drain time.
    await asyncio.gather(*(w.shutdown() for w in workers))
