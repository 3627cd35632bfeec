"""Helper threads run their torch ops on one thread, and leave every other thread's count,
and the count new threads start with, as they were (engine/threads.py)."""

from __future__ import annotations

import threading

import torch

from pdserve.engine.threads import helper_pool, helper_thread


def counts_in_a_plain_thread() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_helper_threads_run_torch_on_one_thread_and_change_no_other() -> None:
    original = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = counts_in_a_plain_thread()
        with helper_pool(2, "test-helper") as pool:
            inside = pool.submit(lambda: (torch.get_num_threads(), torch.ones(1 << 16).sum().item())).result()
        assert inside == (1, float(1 << 16))
        seen: list[int] = []
        thread = helper_thread(lambda: seen.append(torch.get_num_threads()), "test-helper-thread")
        thread.start()
        thread.join()
        assert thread.daemon and seen == [1]
        assert torch.get_num_threads() == 2
        assert counts_in_a_plain_thread() == before == 2  # the count new threads start with
    finally:
        torch.set_num_threads(original)
