"""What the GPU engine benchmark (``bench/gpu_engine.py``) times with: wall time after the
device has finished (:class:`Timer`), fresh random prompts, and ``--profile``'s device-time
tables of decode and prefill steps (:func:`profile`)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from pdserve.engine.engine import Engine
from pdserve.schemas import SamplingParams


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def profile(engine: Engine, vocab: int, rng: random.Random, path: Path) -> None:
    """Where steady decode steps (batch 1 and 64) and a 4,096-token prefill spend time; Chrome
    traces beside ``path`` of the prefill and of 8 decode steps at batch 64."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    lines = []
    timer = Timer(engine.runner.device)
    for name, batch, length, trace in (
        ("decode, batch 1 (16 steps)", 1, 512, None),
        ("prefill 4096", 1, 4096, "trace_prefill.json"),
        ("decode, batch 64 (8 steps)", 64, 512, "trace_decode64.json"),
    ):
        prefill_only = length == 4096
        engine.pages.reset_prefix_cache()
        params = SamplingParams(max_new_tokens=1 if prefill_only else 40, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts(rng, batch, length, vocab)):
            engine.add_request(f"profile-{name}-{i}", p, params)
        seen: set[str] = set()
        while not prefill_only and len(seen) < batch:  # prefills first, outside the profile
            seen.update(o.rid for o in engine.step())
        for _ in range(3 if not prefill_only else 0):
            engine.step()
        timer.sync()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(1 if prefill_only else 16 if batch == 1 else 8):
                engine.step()
            timer.sync()
        while engine.has_work():
            engine.step()
        lines.append(f"== {name}\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        if trace:
            prof.export_chrome_trace(str(path.parent / trace))
    path.write_text("\n".join(lines))
