"""Worker processes on this machine: their command lines, and keeping them running.

A child that dies is started again after a growing back-off; a child being *retired*
(scaled in: SIGTERM, it drains) is left to finish and then dropped, never restarted.
Shared by ``pdserve up`` and ``pdserve autoscale``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import flags
from pdserve.broker.credentials import EmbeddedCredentials
from pdserve.cores import available, format_cpus

log = logging.getLogger("pdserve.up")

RESTART_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)
# A retired worker drains for up to its drain time (30 s) plus its teardown; past this it
# is killed (its deliveries then come back after ack_wait).
RETIRE_KILL_SECONDS = 90.0


@dataclass
class Child:
    role: str
    index: int
    argv: list[str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None
    retired_at: float | None = None

    @property
    def retiring(self) -> bool:
        return self.retired_at is not None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL)
        self.started_at = time.monotonic()
        self.restart_at = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def retire(self) -> None:
        """Scale in: SIGTERM (the worker stops taking work, finishes or hands back what it
        holds, leaves the registry) and never restart it."""
        self.retired_at = time.monotonic()
        self.stop()


def tend(children: list[Child], now: float | None = None) -> None:
    """One pass over ``children``: restart the dead (after their back-off), drop retired
    ones that have exited (killing one that outlasts :data:`RETIRE_KILL_SECONDS`)."""
    now = time.monotonic() if now is None else now
    for child in list(children):
        proc = child.process
        if child.retired_at is not None:
            if proc is None or proc.poll() is not None:
                code = proc.returncode if proc is not None else None
                (log.info if code == 0 else log.warning)(
                    "retired worker exited",
                    extra={
                        "role": child.role,
                        "index": child.index,
                        "code": code,
                        "drain_s": round(now - child.retired_at, 1),
                    },
                )
                children.remove(child)
            elif now - child.retired_at > RETIRE_KILL_SECONDS:
                log.error("retired worker still running; killing it", extra={"role": child.role, "pid": proc.pid})
                proc.kill()
            continue
        if proc is None:
            if child.restart_at is not None and now >= child.restart_at:
                child.start()
            continue
        if proc.poll() is None:
            continue
        if now - child.started_at > 60:
            child.restarts = 0
        delay = RESTART_BACKOFF_SECONDS[min(child.restarts, len(RESTART_BACKOFF_SECONDS) - 1)]
        log.error(
            "child process exited; restarting",
            extra={"role": child.role, "index": child.index, "code": proc.returncode, "in_seconds": delay},
        )
        child.process = None
        child.restarts += 1
        child.restart_at = now + delay


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """Torch CPU threads for each of ``workers`` workers sharing this machine's ``cores``
    with the API, the broker and their clients: one core in eight is left to those (none
    on fewer than eight), the rest shared out. A CPU worker's OpenMP threads wait for
    each other at every operation, so one of them preempted by the API holds up the
    step: on a 16-core host the unified pipeline made 2,583-2,660 output tok/s with 14
    threads against 1,892-1,995 with 16 (docs/performance.md)."""
    cores = cores or len(available())  # not os.cpu_count(): a container's cpuset may allow fewer
    return max(1, (cores - cores // 8) // max(workers, 1))


def worker_argv(
    args: argparse.Namespace,
    role: str,
    model_path: Path,
    nats_url: str,
    threads: int,
    device: str | None = None,
    credentials: EmbeddedCredentials | None = None,
    cores: list[int] | None = None,
    core_turns: Path | None = None,
) -> list[str]:
    """``python -m pdserve <role>`` with every flag ``up`` shares with workers, from the flag
    table, plus what ``up`` decides: the model (the directory ``--model-path`` resolved to),
    the broker (and the role's user of the embedded one, by password file), threads, the
    transfer host and the worker's device (default ``--device``), and the role's
    tensor-parallel size (its ranks share the worker's threads), and its own ``cores``
    (``up --pin-cores``) or the lock it takes turns at the cores by (``up --core-sharing turns``)."""
    tp = role_tp_size(args, role)
    values = {
        **vars(args),
        "device": device or args.device,
        "model_path": model_path,
        "revision": None,  # model_path is the resolved directory
        "gguf_file": None,
        "nats_url": nats_url,
        "num_threads": max(1, threads // tp),
        "host": args.transfer_host,
        "exit_with_parent": True,
        **({"cpus": format_cpus(cores)} if cores else {}),
        **({"core_turns": core_turns} if core_turns else {}),
        **nats_user(credentials, role),
    }
    argv = [sys.executable, "-m", "pdserve", role, *flags.render(flags.forwarded(), values)]
    return argv + (["--tensor-parallel-size", str(tp)] if tp > 1 else [])


def role_tp_size(args: argparse.Namespace, role: str) -> int:
    """``--prefill-/--decode-tensor-parallel-size``, else ``--tensor-parallel-size``."""
    own = getattr(args, f"{role}_tensor_parallel_size", None)
    return int(own or getattr(args, "tensor_parallel_size", 1) or 1)


def nats_user(credentials: EmbeddedCredentials | None, user: str | None) -> dict[str, Any]:
    """Flag values naming ``user`` of the embedded broker and its password file."""
    if credentials is None or user is None:
        return {}
    return {"nats_user": user, "nats_password_file": credentials.password_file(credentials.directory, user)}
