"""KV cache tiers: time to first token of a multi-turn chat with and without them.

**Chat** (one process, one engine per configuration, each cold: fresh pool, fresh tier
directory, the same seeded workload, the configurations' turns interleaved): ``--users`` conversations, each opening on its own
``--prefix`` tokens of context, take turns round-robin for ``--turns`` rounds; a turn
sends the conversation so far plus ``--message`` new tokens, waits for its first token
(TTFT) and its ``--answer`` tokens, which join the conversation. The device pool holds
``--pool-tokens`` tokens, fewer than the conversations together, so by a user's next
turn the device's prefix cache has lost that user's pages: without tiers they are
computed again; with a tier they are loaded from it. Each configuration's reading: the mean
TTFT of the later turns, its ratio to none's, and the median of each later turn against the
same turn without tiers (``later_turns_vs_none_paired``: an outlier turn or a slow spell of
the machine weighs on no configuration alone); ``none_again``, a second engine without tiers,
reads how far two engines doing the same work differ (the noise under those ratios).

**Restart** (separate processes): a prefill process computes a prompt with the disk tier
and exits; a new process (a restarted worker) serves the same prompt from the disk
tier; a third, without tiers, computes it (the baseline). **Store**: a process computes
a prompt with the Mooncake Store tier (the benchmark starts ``mooncake_master`` and a
store server, as ``pdserve up --kv-store`` does) and exits; a second process (another
worker) serves it from the store. A second process without tiers runs after them all
(``cold_again``): how far two processes doing the same work differ. Each fresh process
serves ``--prompts`` prompts, each timed alone, its reading the median.

    python bench/kv_tiers.py --json docs/data/kv_tiers.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from pdserve.engine import kv_tiers
from pdserve.engine.config import EngineConfig, KVTierConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import build_engine, freeze_heap
from pdserve.engine.tiny_model import ensure_default_model
from pdserve.schemas import SamplingParams

VOCAB_LOW, VOCAB_HIGH = 3, 4000


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def _machine(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"one {torch.cuda.get_device_name()} (7B dimensions, dummy weights)"
    return f"CPU, {os.cpu_count()} cores (a shared machine: other work may run)"


class GcPauses:
    """The garbage collector's collections of generation 2 while the block runs, each one's
    milliseconds (a full collection stops whichever thread set it off, an engine's too)."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.ms.append(round((time.perf_counter() - self._began) * 1e3, 2))

    @contextlib.contextmanager
    def watching(self) -> Iterator[GcPauses]:
        gc.callbacks.append(self._callback)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._callback)


class KernelCompiles:
    """The Triton kernels compiled (or loaded from Triton's cache on disk) while the block runs,
    each one's name, milliseconds and argument types: a shape met first in a turn pays it there
    (a process's kernels are shared by its engines: the first engine to meet it pays)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self._began: dict[str, float] = {}
        self.at = ""  # what was running (the bench's label), recorded with each

    def _before(self, *, key: Any, repr: str, **_: Any) -> bool:
        self._began[str(key)] = time.perf_counter()
        return False  # (True would skip the compile)

    def _after(self, *, key: Any, repr: str, fn: Any, **_: Any) -> None:
        began = self._began.pop(str(key), time.perf_counter())
        ms = round((time.perf_counter() - began) * 1e3, 2)
        self.seen.append({"at": self.at, "kernel": getattr(fn, "name", "?"), "ms": ms, "signature": repr[:300]})

    @contextlib.contextmanager
    def watching(self) -> Iterator[KernelCompiles]:
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            yield self
            return
        runtime = knobs.runtime
        saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        try:
            yield self
        finally:
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def alloc_retries() -> int:
    """The CUDA caching allocator's frees and retries of a failed allocation so far (each frees
    its cached blocks and synchronizes the device); 0 without a GPU."""
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if torch.cuda.is_available() else 0


def warm_up(engine: Engine, length: int = 50) -> None:
    """One unrelated request of ``length`` tokens: the first forward passes of its shapes pay
    one-time costs (a long one: random tokens, fresh each process, found in no tier). The
    tiers' writes of it are done before it returns."""
    prompt = list(range(10, 10 + length)) if length <= 50 else tokens(random.Random(), length)
    engine.add_request("warm-up", prompt, SamplingParams(max_new_tokens=2, temperature=0.0))
    while engine.has_work():
        engine.step()
    if engine.tiers is not None:
        engine.tiers.drain()


def warm_up_turns(engine: Engine, longest: int, message: int) -> None:
    """The shapes of a chat's later turns met once in the process before any is measured: a
    random prompt of the longest turn's ``longest`` tokens, computed whole, then the same with
    ``message`` more tokens, its prefix found in the device's cache (a turn's step after a
    load). Engines in one process share the allocator and the kernels' caches, and the turns
    rotate over them, so the first engine at a new size paid its first-time costs alone: the
    store's first later turn on an H100 read 21.5-33.4 ms against ~15.5, in three runs at 512
    tokens, the store being first in that turn's order (2026-12-07)."""
    prompt = tokens(random.Random(), longest)
    for rid, ids in (("warm-turn", prompt), ("warm-turn-again", prompt + tokens(random.Random(), message))):
        engine.add_request(rid, ids, SamplingParams(max_new_tokens=2, temperature=0.0))
        while engine.has_work():
            engine.step()


def rule_inputs(engine: Engine) -> dict[str, Any]:
    """The cost rule's estimates as they stand (before a measured request: what it decides by)."""
    if engine.tiers is None:
        return {}
    e = engine.tiers.estimates
    return {
        "prefill_us_per_token": round(e.prefill_s_per_token * 1e6, 3),
        "prefill_ns_per_pair": round(e.prefill_s_per_pair * 1e9, 4),
        "prefill_fixed_ms": round(e.prefill_fixed_s * 1e3, 3),
        "prefill_floor_ms": round(e.prefill_floor_s * 1e3, 3),
        "prefill_floor_us_per_token": round(e.prefill_floor_s_per_token * 1e6, 4),
        "load_gb_s": {k: round(v / 1e9, 3) for k, v in e.bytes_per_s.items()},
        "prefill_readings": [(t, round(sec * 1e3, 3)) for t, sec, _ in e.prefill_readings],
    }


def one_turn(
    engine: Engine,
    rid: str,
    prompt: list[int],
    answer: int,
    steps: list[float] | None = None,
    first_token: Callable[[], None] | None = None,
) -> tuple[float, list[int], int]:
    """TTFT (seconds), the answer's tokens, and the prompt's cached tokens; each step's wall
    time (seconds) appended to ``steps`` where given, up to the first token; ``first_token``
    called as it comes."""
    sampling = SamplingParams(max_new_tokens=answer, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(rid, prompt, sampling)
    ttft = None
    out: list[int] = []
    cached = 0
    while engine.has_work():
        began = time.perf_counter()
        outputs = engine.step()
        if steps is not None and ttft is None:
            steps.append(time.perf_counter() - began)
        for o in outputs:
            if o.rid != rid:
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
                cached = o.cached_tokens
                if first_token is not None:
                    first_token()
            out += o.token_ids
    assert ttft is not None
    return ttft, out, cached


def tier_counts(engine: Engine) -> dict[str, Any]:
    if engine.tiers is None:
        return {}
    s = engine.tiers.stats
    return {
        name: {
            "hit_pages": c.hit_pages,
            "overlapped_pages": c.overlapped_pages,
            "unbuffered_reads": c.unbuffered_reads,
            "declined_pages": c.declined_pages,
            "skipped_lookups": c.skipped_lookups,
            "stored_pages": c.stored_pages,
            "corrupt": c.corrupt,
            "calibrations": c.calibrations,
            "unwritten_groups": c.unwritten_groups,
        }
        for name, c in s.tiers.items()
    } | {
        "lookup_seconds": round(s.lookup_seconds, 4),
        "load_seconds": round(s.load_seconds, 4),
        "write_errors": s.write_errors,
        "write_drops": s.write_drops,
        "snapshot_allocations": s.snapshot_allocations,
        # the load-or-compute rule's inputs as the run left them
        "load_gb_s": {tier: round(rate / 1e9, 3) for tier, rate in engine.tiers.estimates.bytes_per_s.items()},
        "prefill_us_per_token": round(engine.tiers.estimates.prefill_s_per_token * 1e6, 2),
        "prefill_ns_per_pair": round(engine.tiers.estimates.prefill_s_per_pair * 1e9, 4),
        "prefill_fixed_ms": round(engine.tiers.estimates.prefill_fixed_s * 1e3, 3),
        "prefill_floor_ms": round(engine.tiers.estimates.prefill_floor_s * 1e3, 3),
        "prefill_floor_us_per_token": round(engine.tiers.estimates.prefill_floor_s_per_token * 1e6, 4),
        # the steps the line was fitted on: (tokens, ms, attention pairs)
        "prefill_readings": [(t, round(sec * 1e3, 3), p) for t, sec, p in engine.tiers.estimates.prefill_readings],
    }


def tier_events(engine: Engine) -> dict[str, int]:
    """The tiers' cumulative counts that tell a turn's work apart (``tier.count``), flat."""
    if engine.tiers is None:
        return {}
    s = engine.tiers.stats
    out = {"lookups": s.lookups, "snapshot_allocations": s.snapshot_allocations, "write_drops": s.write_drops}
    for name, c in s.tiers.items():
        for count in ("hit_pages", "stored_pages", "declined_pages", "skipped_lookups", "calibrations"):
            out[f"{name}.{count}"] = getattr(c, count)
    return out


@dataclass
class Run:
    """One configuration's engine and what its turns measured."""

    engine: Engine
    contexts: list[list[int]]
    ttfts: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    prompt_tokens: int = 0
    events: list[dict[str, int]] = field(default_factory=list)  # what each turn's tiers did

    def turn(self, rid: str, user: int, message: list[int], answer: int) -> None:
        prompt = self.contexts[user] + message
        self.prompt_tokens += len(prompt)
        before = tier_events(self.engine)
        ttft, out, hit = one_turn(self.engine, rid, prompt, answer)
        self.ttfts.append(ttft)
        self.cached.append(hit)
        self.outputs.append(out)
        self.contexts[user] = prompt + out
        if self.engine.tiers is not None:
            self.engine.tiers.drain()  # the writes of this turn land before the next (a user's think time)
        after = tier_events(self.engine)
        self.events.append({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)})

    def reading(self, users: int) -> dict[str, Any]:
        later = self.ttfts[users:]
        return {
            "mean_ttft_ms": round(statistics.mean(self.ttfts) * 1000, 2),
            "mean_ttft_later_turns_ms": round(statistics.mean(later) * 1000, 2) if later else None,
            "p50_ttft_ms": round(statistics.median(self.ttfts) * 1000, 2),
            "later_turns_ttft_ms": [round(t * 1000, 2) for t in later],  # in the same order on every engine
            # each later turn's tier work (counts that moved: pages written, loaded, declined, ...)
            "later_turns_events": self.events[users:],
            "turns": len(self.ttfts),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": sum(self.cached),
            "tiers": tier_counts(self.engine),
            "outputs": self.outputs,
        }


def chat(
    model: Path, configs: dict[str, KVTierConfig], args: argparse.Namespace, seed: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every configuration's engine, each cold, serving the same turns interleaved: each
    turn runs on every engine in turn (the order rotating), so a slow spell of this shared
    machine falls on all of them alike. Returns each configuration's reading, and what the
    process's runtime did during the turns (the collector, Triton, the CUDA allocator)."""
    rng = random.Random(seed)
    openings = [tokens(rng, args.prefix) for _ in range(args.users)]
    runs: dict[str, Run] = {}
    for name, tiers in configs.items():
        config = EngineConfig(
            max_total_tokens=args.pool_tokens, kv_tiers=tiers, device=args.device, num_threads=args.num_threads
        )
        # one set of weights for all of them (as a co-located process's two engines share it):
        # five 7B models took 76 of an H100's 80 GB (a suspect for a turn 50-100 ms slower at the
        # start of a round: the caching allocator freeing its blocks to retry; counted below)
        shared = next(iter(runs.values())).engine.runner.model if runs else None
        engine = build_engine(model, config, load_format=args.load_format, model=shared)
        warm_up(engine)
        if not runs and tiers == KVTierConfig():  # the first, without tiers: nothing of it is written
            warm_up_turns(
                engine, args.prefix + args.turns * args.message + (args.turns - 1) * args.answer, args.message
            )
        runs[name] = Run(engine, [list(o) for o in openings])
    names = list(runs)
    frozen = freeze_heap() if args.gc_freeze else 0  # as a worker does once its engine is built
    retries = alloc_retries()
    pauses = GcPauses()
    compiles = KernelCompiles()
    with pauses.watching(), compiles.watching():
        for turn in range(args.turns):
            for user in range(args.users):
                message = tokens(rng, args.message)
                shift = (turn * args.users + user) % len(names)
                for name in names[shift:] + names[:shift]:
                    compiles.at = f"{name} u{user}t{turn}"
                    runs[name].turn(f"u{user}t{turn}", user, message, args.answer)
            print(
                f"turn {turn}:",
                {n: round(statistics.mean(r.ttfts[-args.users :]) * 1000) for n, r in runs.items()},
                flush=True,
            )
    for run in runs.values():
        run.engine.close()
    readings = {name: run.reading(args.users) for name, run in runs.items()}
    process = {
        "frozen_objects": frozen,
        "full_collections_ms": pauses.ms,  # the garbage collector's full walks during the turns
        "kernel_compiles": compiles.seen,  # Triton's compiles and cache loads during the turns
        "cuda_alloc_retries": alloc_retries() - retries,
    }
    del runs  # the engines' models and pools, before a fresh process needs the device
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return readings, process


# ---- one prompt in a fresh process (restart, second worker) -------------------------------
def _vmstat(*names: str) -> dict[str, int]:
    """The system's counters ``names`` from /proc/vmstat (Linux; empty elsewhere)."""
    try:
        lines = Path("/proc/vmstat").read_text().split("\n")
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split() for line in lines if line) if k in names}


class OsCounters:
    """What the OS did around one prompt (``--step-times``): the engine thread's page faults and
    context switches (getrusage of the thread), and the system's dirty and writeback pages at
    the prompt's start and end (/proc/vmstat): a step slowed by the OS writing earlier prompts'
    files back, or by faults, shows here."""

    THREAD = ("ru_minflt", "ru_majflt", "ru_nvcsw", "ru_nivcsw")
    SYSTEM = ("nr_dirty", "nr_writeback")

    WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # the calling thread, on Linux

    def __init__(self) -> None:
        self._began: tuple[Any, dict[str, int]] | None = None

    def start(self) -> None:
        self._began = (resource.getrusage(self.WHO), _vmstat(*self.SYSTEM))

    def stop(self) -> dict[str, Any]:
        assert self._began is not None
        usage, system = self._began
        now = resource.getrusage(self.WHO)
        out: dict[str, Any] = {k.removeprefix("ru_"): getattr(now, k) - getattr(usage, k) for k in self.THREAD}
        out |= {f"{k}_before": v for k, v in system.items()}
        out |= {f"{k}_after": v for k, v in _vmstat(*self.SYSTEM).items()}
        return out


def serve_one(model: Path, tiers: KVTierConfig, args: argparse.Namespace, seed: int) -> tuple[Engine, dict[str, Any]]:
    """A fresh engine serving the seeded prompt: the engine (still open) and its reading."""
    config = EngineConfig(
        max_total_tokens=args.pool_tokens, kv_tiers=tiers, device=args.device, num_threads=args.num_threads
    )
    engine = build_engine(model, config, load_format=args.load_format)
    # a prompt as long as the measured one first: a fresh process without tiers (the cold
    # baseline) pays its shapes' one-time costs there too, as one with a disk or store does
    # in the prefill it times at start (on an H200 its first 2,048-token step took 97 ms, 11
    # after that, 2026-12-05)
    warm_up(engine, args.prefix + args.message)
    if args.gc_freeze:
        freeze_heap()
    before = rule_inputs(engine)
    timed = StepTimes(engine) if args.step_times else None
    os_counters = OsCounters() if args.step_times else None
    os_each: list[dict[str, Any]] = []
    ttfts: list[float] = []
    cached_each: list[int] = []
    answers: list[list[int]] = []
    steps: list[float] = []
    trace = ""
    # several prompts, each measured alone (the writes of one land before the next): a single
    # 512-token step of a 7B model on an H100 is mostly the host's launches, and one reading of
    # it ranged from 14 to 35 ms between processes doing the same work (2026-12-06)
    for i in range(max(1, args.prompts)):
        prompt = tokens(random.Random(seed if i == 0 else f"{seed}-{i}"), args.prefix + args.message)
        with contextlib.ExitStack() as stack:
            if args.profile_dir and i == args.profile_prompt:  # that prompt's host and device timeline
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
                prof = stack.enter_context(profile(activities=acts, with_stack=False))
            if timed is not None:
                timed.start()
            if os_counters is not None:
                os_counters.start()
            ttft, answer, cached = one_turn(
                engine, f"p{i}", prompt, args.answer, steps if i == 0 else None, timed.stop if timed else None
            )
            if timed is not None:
                timed.stop()
            if os_counters is not None:
                os_each.append(os_counters.stop())
        ttfts.append(ttft)
        cached_each.append(cached)
        answers.append(answer)
        if engine.tiers is not None:
            engine.tiers.drain()
        if args.profile_dir and i == args.profile_prompt:
            args.profile_dir.mkdir(parents=True, exist_ok=True)
            named = {"host": tiers.host_bytes, "disk": tiers.disk_dir, "store": tiers.store_master}
            kinds = "+".join(k for k, on in named.items() if on) or "none"
            trace = str(args.profile_dir / f"prompt_{kinds}_{os.getpid()}.json")
            prof.export_chrome_trace(trace)
    reading = {
        "ttft_ms": round(statistics.median(ttfts) * 1000, 2),  # the median over the prompts
        "ttft_ms_each": [round(t * 1000, 2) for t in ttfts],
        "cached_tokens": int(statistics.median(cached_each)),
        "cached_tokens_each": cached_each,
        "step_ms": [round(s * 1000, 2) for s in steps],  # the first prompt's, up to its first token
        "tiers": tier_counts(engine),
    }
    if trace:
        reading["trace"] = trace
    if timed is not None:
        reading["step_times"] = timed.prompts
    if os_counters is not None:
        reading["os_each"] = os_each  # a prompt each, through its first answer's end
    if before:
        reading["rule_before"] = before
    return engine, reading | {"answer": answers}


class StepTimes:
    """Each timed prompt's steps up to its first token (``--step-times``): ``wall_ms`` from the
    step's launch to its tokens collected, on the engine's thread, and on a GPU ``device_ms``,
    the device's own time between the step's first launch and its last kernel
    (:attr:`Engine.time_steps`). A step whose wall time
    exceeds its device time by more in one process than in another is held up on the host."""

    # the host's work around the steps, timed a call each (``host_ms``: milliseconds a part
    # took during the prompt, up to its first token): the engine's, the page manager's, the
    # tiers' (where they are on)
    TIMED = {
        "engine": ("add_request", "schedule", "launch", "collect", "postprocess"),
        "pages": ("register_full_pages", "offer_computed", "promote", "prefetch"),
        "tiers": ("find", "worth_loading", "load", "offer", "note_prefill", "prefetch", "demote"),
    }

    def __init__(self, engine: Engine) -> None:
        engine.time_steps = True
        engine.observer = self
        self.prompts: list[dict[str, Any]] = []
        self._on = False
        owners = {"engine": engine, "pages": engine.pages, "tiers": engine.tiers}
        for owner_name, names in self.TIMED.items():
            owner = owners[owner_name]
            for name in names if owner is not None else ():
                if callable(getattr(owner, name, None)):
                    setattr(owner, name, self._timed(f"{owner_name}.{name}", getattr(owner, name)))

    def _timed(self, label: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if not self._on:
                return fn(*a, **k)
            began = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                host = self.prompts[-1]["host_ms"]
                host[label] = round(host.get(label, 0.0) + (time.perf_counter() - began) * 1e3, 3)

        return call

    def start(self) -> None:
        self.prompts.append({"wall_ms": [], "device_ms": [], "host_ms": {}})
        self._on = True

    def stop(self) -> None:
        self._on = False

    def before_launch(self, batch: Any) -> None:
        pass

    def after_launch(self, launched: Any) -> None:
        pass

    def after_collect(self, launched: Any, result: Any) -> None:
        if not self._on:
            return
        steps = self.prompts[-1]
        if steps.get("sampled"):
            return
        steps["wall_ms"].append(round(result.seconds * 1e3, 3))
        if result.gpu_seconds is not None:
            steps["device_ms"].append(round(result.gpu_seconds * 1e3, 3))
        if result.token_ids:  # the step that sampled: its postprocess ends the prompt's TTFT (stop)
            steps["sampled"] = True


def one_prompt(args: argparse.Namespace) -> None:
    engine, reading = serve_one(args.model, KVTierConfig(**json.loads(args.tiers_json)), args, args.seed)
    engine.close()
    print(json.dumps(reading))


SDPA_BACKENDS = {
    "auto": None,
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
}


def sdpa_backend(name: str) -> contextlib.AbstractContextManager[object]:
    """``torch.nn.attention.sdpa_kernel`` with the one backend ``name`` names (of
    :data:`SDPA_BACKENDS`; "auto": torch's own pick). The turn 50-100 ms slower that comes at a
    round's start on an H100 is suspected to be cuDNN building an execution plan for a shape it
    meets first: run with ``flash`` to tell."""
    backend = SDPA_BACKENDS[name]
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, backend)])


def in_new_process(
    args: argparse.Namespace, model: Path, seed: int, tiers: dict[str, Any], warm_up: bool = True
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--one-prompt",
        *([] if warm_up else ["--no-warm-up"]),
        "--model",
        str(model),
        "--seed",
        str(seed),
        "--tiers-json",
        json.dumps(tiers),
        "--prefix",
        str(args.prefix),
        "--message",
        str(args.message),
        "--answer",
        str(args.answer),
        "--pool-tokens",
        str(args.pool_tokens),
        "--device",
        args.device,
        "--load-format",
        args.load_format,
        "--num-threads",
        str(args.num_threads),
        "--prompts",
        str(args.prompts),
        *(
            ["--profile-dir", str(args.profile_dir), "--profile-prompt", str(args.profile_prompt)]
            if args.profile_dir
            else []
        ),
        *(["--step-times"] if args.step_times else []),
        *([] if args.gc_freeze else ["--no-gc-freeze"]),
        "--sdpa-backend",
        args.sdpa_backend,
    ]
    env = {"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2", "TOKENIZERS_PARALLELISM": "false"}
    before = helpers_cpu()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    after = helpers_cpu()
    if done.returncode != 0:  # kept in the results (the other parts still count), and said
        print(done.stderr[-3000:], file=sys.stderr, flush=True)
        return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}", "answer": None}
    reading = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    # what this run's other processes (the store's master and server) used meanwhile: on an
    # H100 a cold process after the store's part launched its steps twice as slowly (2026-12-06)
    reading["helpers_cpu_s"] = {
        name: round(after[pid][1] - cpu, 2) for pid, (name, cpu) in before.items() if pid in after
    }
    return reading


def helpers_cpu() -> dict[int, tuple[str, float]]:
    """This process's children (the store's master and server; not the fresh processes, which
    have ended): name and CPU seconds so far, from ``/proc`` (empty where there is none)."""
    out: dict[int, tuple[str, float]] = {}
    me = os.getpid()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == me:
                name = (entry / "comm").read_text().strip()
                out[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, ValueError, IndexError):
            continue
    return out


@contextlib.contextmanager
def store_master(args: argparse.Namespace, tmp: Path) -> Iterator[dict[str, str] | None]:
    """Mooncake Store (master and a store server) for the store parts (``None`` with ``--no-store``)."""
    if args.no_store:
        yield None
        return
    from pdserve.kv_store import running_store

    with running_store(args.store_bytes, tmp) as master:
        yield {"store_master": master.address, "store_metadata": master.metadata_url}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--prefix", type=int, default=2048, help="tokens of each conversation's opening context")
    p.add_argument("--message", type=int, default=32, help="new tokens a turn sends")
    p.add_argument("--answer", type=int, default=16, help="tokens a turn generates")
    p.add_argument("--pool-tokens", type=int, default=6144, help="device KV pool (fewer than the users' contexts)")
    p.add_argument("--host-bytes", type=int, default=256 << 20)
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one per run")
    p.add_argument("--model", type=Path, default=None, help="default: the built-in tiny model")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch threads (1, as `pdserve up` gives each of two workers on two cores: on a busy machine "
        "more spin and wait)",
    )
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--no-store", action="store_true", help="skip the Mooncake Store parts")
    p.add_argument("--store-bytes", type=int, default=1 << 30, help="memory of the store server")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="load a prefix's part in a tier slower than computing while the part before it is computed "
        "(--kv-tier-overlap) in every tiered configuration",
    )
    p.add_argument("--no-chat", action="store_true", help="only the fresh processes (restart, second worker)")
    p.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="leave the heap to the garbage collector once the engines are built (a worker freezes it)",
    )
    p.add_argument(
        "--prompts", type=int, default=5, help="prompts each fresh process serves and times (its reading: the median)"
    )
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--profile-dir", type=Path, default=None, help="a fresh process's measured prompt traced (torch profiler) here"
    )
    p.add_argument(
        "--tmp-dir",
        default=None,
        help="where the run's files go, the disk tiers' included (default: the system's temporary directory; "
        "/dev/shm: memory, no writeback to a device)",
    )
    p.add_argument(
        "--profile-prompt", type=int, default=0, help="which of its prompts --profile-dir traces (0: the first)"
    )
    p.add_argument(
        "--step-times",
        action="store_true",
        help="each fresh process also records every prompt's steps up to its first token: wall time, and on a "
        "GPU the device's own time (two CUDA events a step, in every process alike); and around each prompt "
        "the engine thread's page faults and context switches, the system's dirty and writeback pages (os_each)",
    )
    p.add_argument(
        "--sdpa-backend",
        default="auto",
        choices=sorted(SDPA_BACKENDS),
        help="the library attention a whole prompt's prefill may use on a GPU (auto: torch's pick, cuDNN's on an "
        "H100; flash: torch's own kernels, no execution plan built per new shape)",
    )
    p.add_argument(
        "--cut-runs",
        action="store_true",
        help="the chat also runs a disk whose rule may load a found run's leading groups alone (disk_cut: "
        "--kv-tier-cut-runs), beside the disk as it is by default",
    )
    p.add_argument(
        "--compare-warm-up",
        action="store_true",
        help="a restarted worker and a second store worker also run without the start-up warm-up of a load "
        "(KVTiers.warm_up), before the ones with it (restarted_process_disk_no_warm_up, ...)",
    )
    p.add_argument("--no-warm-up", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--one-prompt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tiers-json", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_prompt:
        if args.no_warm_up:
            kv_tiers.WARM_UP = False
        with sdpa_backend(args.sdpa_backend):
            one_prompt(args)
        return
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    model = args.model or ensure_default_model(Path(tempfile.gettempdir()) / "pdserve-bench-data")
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "seed": seed,
        "model": str(model.name),
        "machine": _machine(args.device),
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "one_prompt", "tiers_json", "model")},
    }
    overlap = {"overlap": True} if args.overlap else {}  # every tiered configuration
    # (the disk tiers' files under it: --tmp-dir /dev/shm takes the OS's writeback of them off the host)
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp, store_master(args, Path(tmp)) as store:
        configs = {
            "none": KVTierConfig(),
            # a second engine without tiers: how far two engines doing the same work differ
            # here (the noise under every paired ratio)
            "none_again": KVTierConfig(),
            "host": KVTierConfig(host_bytes=args.host_bytes, **overlap),
            "disk": KVTierConfig(disk_dir=str(Path(tmp) / "disk-chat"), **overlap),
        }
        if args.cut_runs:  # (a disk of its own: a shared store would hand one engine's groups to the other)
            configs["disk_cut"] = KVTierConfig(disk_dir=str(Path(tmp) / "disk-cut"), cut_runs=True, **overlap)
        if store is not None:
            store = {**store, **overlap}
            configs["store"] = KVTierConfig(**store)
            # every tier at once, fastest first (its store is the one above: a first turn may
            # find the "store" engine's groups there; later turns find their own in host memory)
            configs["all"] = KVTierConfig(host_bytes=args.host_bytes, disk_dir=str(Path(tmp) / "disk-all"), **store)
        if not args.no_chat:
            with sdpa_backend(args.sdpa_backend):
                results["chat"], results["chat_process"] = chat(model, configs, args, seed)
            for name, reading in results["chat"].items():
                print(name, json.dumps({k: v for k, v in reading.items() if k != "outputs"}), flush=True)
            base = results["chat"]["none"]
            for name in configs:
                reading = results["chat"][name]
                reading["speedup_mean_ttft"] = round(base["mean_ttft_ms"] / reading["mean_ttft_ms"], 2)
                reading["outputs_equal_to_none"] = reading["outputs"] == base["outputs"]
                # each later turn against the same turn without tiers (run beside it), the median:
                # a slow spell of the machine or an outlier turn weighs on no configuration alone
                pairs = zip(reading["later_turns_ttft_ms"], base["later_turns_ttft_ms"], strict=True)
                reading["later_turns_vs_none_paired"] = round(statistics.median(t / b for t, b in pairs), 3)
            for reading in results["chat"].values():
                del reading["outputs"]
            print("process", json.dumps(results["chat_process"]), flush=True)
        disk = {"disk_dir": str(Path(tmp) / "disk-restart"), **overlap}
        cold = in_new_process(args, model, seed + 1, {})
        results["restart"] = {"first_process_disk": in_new_process(args, model, seed + 1, disk)}
        if args.compare_warm_up:  # (first: the files are in the page cache for both)
            results["restart"]["restarted_process_disk_no_warm_up"] = in_new_process(
                args, model, seed + 1, disk, warm_up=False
            )
        results["restart"]["restarted_process_disk"] = in_new_process(args, model, seed + 1, disk)
        results["restart"]["fresh_process_no_tiers"] = dict(cold)
        if store is not None:
            results["store_shared"] = {"first_worker_store": in_new_process(args, model, seed + 1, store)}
            if args.compare_warm_up:
                results["store_shared"]["second_worker_store_no_warm_up"] = in_new_process(
                    args, model, seed + 1, store, warm_up=False
                )
            results["store_shared"]["second_worker_store"] = in_new_process(args, model, seed + 1, store)
            results["store_shared"]["fresh_process_no_tiers"] = dict(cold)
        # a second cold process after the others: how far two processes doing the same work
        # differ (a short prompt's step is mostly the host's launches, which vary by process)
        again = in_new_process(args, model, seed + 1, {})
        del again["answer"]
        results["cold_again"] = again
    for part in ("restart", "store_shared"):
        if part in results:
            readings = list(results[part].values())
            results[part]["answers_equal"] = all(r["answer"] == readings[0]["answer"] for r in readings)
            for r in readings:
                del r["answer"]
    print(json.dumps({k: results.get(k) for k in ("restart", "store_shared", "cold_again")}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
