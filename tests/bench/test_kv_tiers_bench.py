"""bench/kv_tiers.py's reading of what the OS did around a prompt (``--step-times``'s ``os_each``)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
from kv_tiers import OsCounters


@pytest.mark.skipif(not Path("/proc/vmstat").exists(), reason="Linux' /proc/vmstat")
def test_a_prompt_s_os_counters_see_the_thread_s_faults_and_the_system_s_dirty_pages() -> None:
    """The engine thread's page faults count the memory it first touched in the window; the
    system's dirty and writeback pages are read at its start and end."""
    # A mapping of its own: pages no one touched yet, faulted in on first touch (a bytearray
    # may come from memory malloc had handed out and taken back, faulted in already: 3 faults
    # for 16 MiB in one run of the suite); small pages, whatever the system's huge-page policy.
    block = mmap.mmap(-1, 16 << 20)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        block.madvise(mmap.MADV_NOHUGEPAGE)
    counters = OsCounters()
    counters.start()
    for i in range(0, len(block), 4096):
        block[i] = 1
    reading = counters.stop()
    block.close()
    assert reading["minflt"] >= (16 << 20) // 4096 // 2  # most of the block's pages
    assert {"majflt", "nvcsw", "nivcsw"} <= reading.keys()
    for name in ("nr_dirty", "nr_writeback"):
        assert isinstance(reading[f"{name}_before"], int) and isinstance(reading[f"{name}_after"], int)


def test_the_chat_s_later_turn_shapes_are_met_before_the_turns(tiny_model_dir: Path) -> None:
    """``warm_up_turns`` computes a prompt of the longest turn's length whole, then that prompt
    with a message more, its prefix taken from the device's cache (the step of a turn whose
    context was loaded); the engine is idle after."""
    from kv_tiers import warm_up_turns

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.loader import build_engine

    engine = build_engine(tiny_model_dir, EngineConfig(max_total_tokens=1024))
    warm_up_turns(engine, 300, 32)
    assert engine.stats.prompt_tokens == 300 + 332
    assert engine.stats.cached_tokens >= 288  # the second's prefix: the first's full pages
    assert not engine.has_work()
    engine.close()
