"""The system a serving benchmark measures: one ``pdserve up`` in its own session (process
group), started on a free port and data dir, stopped with everything it started. Shared by
``serving_sweep.py``, ``two_gpu_pd.py`` and ``xpyd.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from common import free_port

ROOT = Path(__file__).resolve().parent.parent

# The systems a sweep compares: label, `pdserve up` flags, workers per role.
MODES = {
    "pd": (
        "PD (1 prefill + 1 decode)",
        ["--mode", "pd", "--prefill-workers", "1", "--decode-workers", "1"],
        {"prefill": 1, "decode": 1},
    ),
    "unified": ("unified (2 workers)", ["--mode", "unified", "--unified-workers", "2"], {"unified": 2}),
    "unified-1": ("unified (1 worker, the default)", ["--mode", "unified"], {"unified": 1}),
}


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process of process group ``pgid`` is left (Linux /proc)."""
    proc = Path("/proc")
    if not proc.exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat_line = (d / "stat").read_text()
        except OSError:
            continue
        rest = stat_line.rsplit(")", 1)[-1].split()
        if len(rest) > 2 and rest[0] != "Z" and int(rest[2]) == pgid:
            return True
    return False


def start_session(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """``argv`` in a session of its own (its process group: everything it starts can be
    stopped at the end), output to ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(
    proc: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    timeout: float,
    what: str,
    stop: Callable[[], None],
    tail: Callable[[], str],
    poll: float = 0.5,
) -> None:
    """Poll ``ready`` until it holds; raise (with ``tail()``) if ``proc`` exits first, or
    after ``timeout`` (``stop`` first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited early:\n{tail()}")
        if ready():
            return
        time.sleep(poll)
    stop()
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s:\n{tail()}")


def stop_session(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM to ``proc``, then to its process group while any of it runs; SIGKILL after
    ``timeout``."""
    pgid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout / 2
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


class System:
    """One ``pdserve up`` in its own session (process group), so that everything it starts
    can be found and stopped at the end."""

    def __init__(self, mode: str, model_path: Path, root: Path, extra: list[str]) -> None:
        self.mode = mode
        self.label, self.flags, self.roles = MODES[mode]
        self.model_path = model_path
        self.data_dir = root / mode
        self.log_path = root / f"{mode}.log"
        self.extra = extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 240.0) -> None:
        argv = [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            *self.flags,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--model-path",
            str(self.model_path),
            "--log-level",
            "WARNING",
            *self.extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MC_LOG_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = start_session(argv, env, self.log_path)
        wait_ready(self.proc, self._ready, timeout, f"pdserve up ({self.mode})", self.stop, self.log_tail)

    def _ready(self) -> bool:
        """/health is 200 and every worker has registered (/health turns 200 with one)."""
        try:
            if httpx.get(self.url + "/health", timeout=2).status_code != 200:
                return False
            workers = httpx.get(self.url + "/workers", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        have = {role: sum(1 for w in workers if w.get("role") == role) for role in self.roles}
        return all(have[r] >= n for r, n in self.roles.items())

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to ``pdserve up``; then to anything of its process group still running
        (``pdserve up`` may exit before its workers and broker do), SIGKILL after ``timeout``."""
        if self.proc is not None:
            stop_session(self.proc, timeout)
        self.proc = None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""
