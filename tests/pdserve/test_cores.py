"""pdserve.cores: the cpu lists, the plan `up --pin-cores` follows, and pinning real
processes (every thread of them), down to a worker pinned by ``--cpus``; the core share of
`up --share-cores` (a worker stepping under it: tests/integration/test_workers.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.cores import CoreShare, core_plan, format_cpus, parse_cpus, pin


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


def test_a_core_share_gives_each_busy_worker_its_weights_share_and_all_to_one_alone(tmp_path: Path) -> None:
    path = tmp_path / "cores.share"
    CoreShare.create(path, 8)
    prefill, decode = CoreShare(path, 2), CoreShare(path, 6)
    try:
        assert (prefill.slot, decode.slot, decode.cores) == (0, 1, 8)
        assert decode.share() == 8, "alone: every core"
        assert prefill.share() == 2 and decode.share() == 6, "both busy: by weight"
        prefill.idle()
        assert decode.share() == 8, "prefill out of prompts: decode takes its cores"
        third = CoreShare(path, 8)
        assert third.share() == 4 and decode.share() == 3, "never more threads than cores in all"
        third.close()
        assert decode.share() == 8 and CoreShare(path, 1).slot == 2, "a closed slot is free again"
        decode.STALE = 0.05
        prefill.share()
        time.sleep(0.1)
        assert decode.share() == 8, "a worker that stopped saying it is busy (killed mid-step) counts as idle"
    finally:
        prefill.close()
        decode.close()


def test_a_core_share_frees_a_dead_processs_slot_and_refuses_what_is_not_one(tmp_path: Path) -> None:
    path = tmp_path / "cores.share"
    CoreShare.create(path, 2)
    join = f"from pdserve.cores import CoreShare; s = CoreShare({str(path)!r}, 1); s.share(); print(s.slot)"
    assert subprocess.run([sys.executable, "-c", join], capture_output=True, text=True, check=True).stdout == "0\n"
    mine = CoreShare(path, 1)
    try:
        assert mine.slot == 0, "the process that held slot 0 is gone (it never closed it)"
        assert mine.share() == 2, "and its busy mark does not count"
    finally:
        mine.close()
    with pytest.raises(ValueError, match="no core share at"):
        CoreShare(tmp_path / "missing", 1)
    (tmp_path / "other").write_bytes(b"x" * 10)
    with pytest.raises(ValueError, match="is not a core share"):
        CoreShare(tmp_path / "other", 1)
    with pytest.raises(ValueError, match="at least 1"):
        CoreShare(path, 0)


def test_taking_a_share_sets_the_calling_threads_torch_threads(tmp_path: Path) -> None:
    import threading

    import torch

    path = tmp_path / "cores.share"
    CoreShare.create(path, 3)
    share, other = CoreShare(path, 1), CoreShare(path, 2)
    seen: list[tuple[int, int]] = []

    def step() -> None:  # in a thread of its own, as a worker's engine thread
        seen.append((share.take(), torch.get_num_threads()))
        other.share()
        seen.append((share.take(), torch.get_num_threads()))

    try:
        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
        assert seen == [(3, 3), (1, 1)]
    finally:
        share.close()
        other.close()
