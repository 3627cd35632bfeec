"""pdserve.cores: the cpu lists, the plan `up --pin-cores` follows, and pinning real
processes (every thread of them), down to a worker pinned by ``--cpus``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.cores import core_plan, format_cpus, parse_cpus, pin


def allowed(pid: int) -> dict[int, str]:
    """Each thread of ``pid`` → the cores it may run on, as the kernel lists them."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found[int(tid)] = line.split(":", 1)[1].strip()
    return found


def test_cpu_lists_read_and_write_the_kernels_format() -> None:
    assert parse_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpus("5, 2-3,2") == [2, 3, 5]
    assert format_cpus([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    assert format_cpus(parse_cpus("1,3-6")) == "1,3-6"
    for bad in ("", "a", "3-1", "1-", "-2", "1,,2"):
        with pytest.raises(ValueError, match="not a list of CPU cores"):
            parse_cpus(bad)


def test_the_plan_leaves_one_core_in_eight_and_gives_each_worker_its_own() -> None:
    assert core_plan([14], range(16)) == ([0, 1], [list(range(2, 16))])
    spare, own = core_plan([7, 7], range(16))
    assert spare == [0, 1] and own == [list(range(2, 9)), list(range(9, 16))]
    assert core_plan([4, 10], range(16))[1] == [[2, 3, 4, 5], list(range(6, 16))], "as many as each one's threads"
    spare, own = core_plan([2, 2, 2], [4, 5, 6, 7, 8, 9, 10, 11])
    assert spare == [4] and own == [[5, 6], [7, 8], [9, 10]], "the cores it may use, not 0..n-1"
    with pytest.raises(ValueError, match="2 cores cannot give workers of 1 threads"):
        core_plan([1], range(2))
    with pytest.raises(ValueError, match=r"16 cores cannot give workers of 8[+]7 threads"):
        core_plan([8, 7], range(16))


def test_pin_moves_every_thread_and_the_threads_started_after() -> None:
    script = (
        "import sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('up', flush=True); sys.stdin.readline()\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('more', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "up\n"
        assert len(allowed(proc.pid)) >= 2
        pin([0], proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "more\n"
        threads = allowed(proc.pid)
        assert len(threads) >= 3 and set(threads.values()) == {"0"}
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_given_cpus_runs_every_thread_on_them_wherever_it_started(nats_server, tiny_model_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["unified", "--model-path", str(tiny_model_dir), "--nats-url", nats_server.url]
    argv += ["--cpus", "0", "--num-threads", "2", "--port", str(port), "--host", "127.0.0.1"]
    # started on the other core, as a worker of `up --pin-cores` starts on the API's
    last = max(os.sched_getaffinity(0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", *argv], preexec_fn=lambda: os.sched_setaffinity(0, {last})
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise AssertionError(f"the worker did not become healthy: {proc.poll()}")
        threads = allowed(proc.pid)
        assert len(threads) > 2, "the engine's OpenMP pool, the event loop, the transfer engine's..."
        assert set(threads.values()) == {"0"}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_worker_refuses_cores_it_cannot_run_on(tiny_model_dir: Path) -> None:
    argv = ["unified", "--model-path", str(tiny_model_dir), "--cpus", "0,100000"]
    run = subprocess.run([sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "--cpus 0,100000: " in run.stderr and "Traceback" not in run.stderr
