"""bench/system.py's process handling, shared by the benchmarks that start servers
(pdserve up, vLLM): a session of its own, waiting until ready, stopping the whole group."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import system
from system import start_session, stop_session, wait_ready

SLEEPER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"


def test_ready_then_the_whole_group_stops(tmp_path: Path) -> None:
    proc = start_session([sys.executable, "-c", SLEEPER], dict(os.environ), tmp_path / "out.log")
    polls = []
    wait_ready(proc, lambda: polls.append(1) or len(polls) >= 3, 30.0, "sleeper", lambda: None, str, poll=0.05)
    assert len(polls) == 3 and proc.poll() is None
    pgid = proc.pid
    assert system._group_alive(pgid)
    stop_session(proc, timeout=10.0)
    assert proc.returncode is not None
    assert not system._group_alive(pgid)  # the child it started went with it


def test_early_exit_and_timeout_raise_with_the_tail(tmp_path: Path) -> None:
    proc = start_session(
        [sys.executable, "-c", "print('bad flag'); raise SystemExit(2)"], dict(os.environ), tmp_path / "a.log"
    )
    with pytest.raises(RuntimeError, match=r"server exited early:\ntail of a\.log"):
        wait_ready(proc, lambda: False, 30.0, "server", lambda: None, lambda: "tail of a.log", poll=0.05)
    stopped = []
    proc = start_session([sys.executable, "-c", SLEEPER], dict(os.environ), tmp_path / "b.log")
    with pytest.raises(RuntimeError, match="not ready after 0s"):
        wait_ready(proc, lambda: False, 0.3, "server", lambda: stopped.append(1), str, poll=0.05)
    assert stopped == [1]
    stop_session(proc, timeout=10.0)
