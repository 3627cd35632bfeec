"""The KV tiers below the device pool: each round-trips pages bit-exact, stays within its
bound, refuses corrupt or foreign entries; greedy output served from any tier equals
``transformers``' (and the engine's without the tiers)."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine import kv_blob
from pdserve.engine.config import EngineConfig, KVTierConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv_buffers import ReadBuffer, ReadBuffers
from pdserve.engine.kv_cost import CostEstimates
from pdserve.engine.kv_disk import DiskTier
from pdserve.engine.kv_host import HostTier
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.kv_tiers import KVTiers
from pdserve.engine.kv_write import TierCounters
from pdserve.engine.loader import build_engine
from pdserve.kv_store import StoreMaster, plan_master, running_store, start
from pdserve.schemas import KVLayout, SamplingParams, WorkerCounters, WorkerInfo
from pdserve.schemas.kv_events import page_hashes
from pdserve.workers.metrics import WorkerMetrics
from tests.engine.test_engine import hf_greedy, random_prompts, run_all

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
IDENT = kv_blob.identity(b"model", LAYOUT, 2)
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
POOL_TOKENS = 320  # 20 pages of 16: one prompt and a little more


def random_pool(num_pages: int = 8, seed: int = 0) -> KVPool:
    pool = KVPool(LAYOUT, num_pages, torch.device("cpu"))
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_host_tier_round_trips_pages_and_keeps_its_bound() -> None:
    pool = random_pool()
    host = HostTier(pool, 3 * pool.page_bytes + 1)
    assert host.num_slots == 3
    original = pool.tensor.clone()
    for page in range(5):
        host.store(key(page), page)
        assert len(host) <= 3 and host.num_bytes <= host.max_bytes
    assert host.num_evicted == 2
    assert not host.contains(key(0)) and not host.contains(key(1))  # the least recently used went
    pool.tensor.zero_()
    for page in (2, 3, 4):
        assert host.load(key(page), 7 - page)
        assert torch.equal(pool.tensor[7 - page], original[page])
    assert not host.load(key(0), 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn/block"])
def test_blob_round_trips_pages_of_every_pool_dtype(dtype: str) -> None:
    """bfloat16 above all: the GPU's pool dtype, which numpy cannot hold (the disk and store
    tiers once failed every write of it)."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=dtype)
    pool = KVPool(layout, 4, torch.device("cpu"))
    source = torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(1))
    pool.tensor.copy_(source if pool.tensor.is_floating_point() else source.mul(40).to(torch.uint8))
    ident = kv_blob.identity(b"model", layout, 2)
    blob = kv_blob.encode(ident, key(1), pool.tensor[:2])
    back = kv_blob.decode(blob, ident, key(1), layout)
    assert back.dtype == pool.tensor.dtype and torch.equal(back, pool.tensor[:2])


def test_blob_round_trips_and_refuses_corrupt_or_foreign_ones() -> None:
    pages = random_pool().tensor[:2].clone()
    blob = kv_blob.encode(IDENT, key(1), pages)
    assert torch.equal(kv_blob.decode(blob, IDENT, key(1), LAYOUT), pages)
    flipped = bytearray(blob)
    flipped[-5] ^= 0x40
    other_layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
    for bad, ident, k in [
        (bytes(flipped), IDENT, key(1)),  # a flipped bit in the payload
        (blob[:-4], IDENT, key(1)),  # truncated
        (blob[:10], IDENT, key(1)),  # shorter than the header
        (blob, kv_blob.identity(b"model", other_layout, 2), key(1)),  # another layout
        (blob, kv_blob.identity(b"other", LAYOUT, 2), key(1)),  # another model
        (blob, IDENT, key(2)),  # renamed onto another key
    ]:
        with pytest.raises(kv_blob.CorruptBlob):
            kv_blob.decode(bad, ident, k, LAYOUT)


def test_the_blob_checksum_catches_changed_words_blocks_out_of_place_and_a_ragged_tail() -> None:
    """The payload's checksum: the CRC-32 of its 4 KiB blocks' sums and of its bytes after the
    last whole word. Any flipped bit (first, last word of a block, the tail), two blocks
    swapped, or a page zeroed changes it; so does a blob of the older CRC-32 format (version 2)."""
    rng = torch.Generator().manual_seed(5)
    payload = torch.randint(0, 256, (3 * 4096 + 13,), dtype=torch.uint8, generator=rng).numpy().tobytes()
    base = kv_blob._checksum(payload)
    assert base == kv_blob._checksum(bytearray(payload)) == kv_blob._checksum(memoryview(payload))
    for i in (0, 7, 4095, 4096, 8191, 3 * 4096, len(payload) - 1):
        flipped = bytearray(payload)
        flipped[i] ^= 0x10
        assert kv_blob._checksum(flipped) != base, i
    swapped = bytearray(payload)
    swapped[0:4096], swapped[4096:8192] = payload[4096:8192], payload[0:4096]
    assert kv_blob._checksum(swapped) != base
    assert kv_blob._checksum(bytes(4096) + payload[4096:]) != base
    pages = random_pool().tensor[:2].clone()
    blob = bytearray(kv_blob.encode(IDENT, key(1), pages))
    blob[4:6] = (2).to_bytes(2, "little")  # the version before
    with pytest.raises(kv_blob.CorruptBlob, match="version"):
        kv_blob.decode(blob, IDENT, key(1), LAYOUT)


def test_disk_tier_round_trips_keeps_its_bound_and_survives_a_restart(tmp_path: Path) -> None:
    pages = random_pool().tensor[:2].clone()
    blob = kv_blob.encode(IDENT, key(0), pages)
    disk = DiskTier(tmp_path, IDENT, max_bytes=3 * len(blob))
    for i in range(5):
        disk.put(key(i), kv_blob.encode(IDENT, key(i), pages + i))
        on_disk = sum(f.stat().st_size for f in disk.dir.iterdir())
        assert on_disk == disk.num_bytes <= disk.max_bytes
    assert disk.num_evicted == 2 and not disk.contains(key(0)) and disk.contains(key(4))
    (disk.dir / "leftover.kv.1234.tmp").write_bytes(b"half a file")  # a write cut short by a crash
    again = DiskTier(tmp_path, IDENT, max_bytes=3 * len(blob))  # a restarted worker
    assert again.num_bytes == disk.num_bytes and not list(again.dir.glob("*.tmp"))
    got = again.get(key(3))
    assert got is not None and torch.equal(kv_blob.decode(got, IDENT, key(3), LAYOUT), pages + 3)
    assert again.get(key(0)) is None
    # read into a buffer of the blob's size: in place; a buffer of another size: read as get reads
    buffer = ReadBuffer(torch.zeros(len(blob), dtype=torch.uint8))
    got = again.get_into(key(3), buffer)
    assert (
        isinstance(got, memoryview) and got.tobytes() == bytes(buffer.data.numpy()) == again.path(key(3)).read_bytes()
    )
    assert torch.equal(kv_blob.decode(got, IDENT, key(3), LAYOUT), pages + 3)
    other = again.get_into(key(3), ReadBuffer(torch.zeros(len(blob) - 1, dtype=torch.uint8)))
    assert isinstance(other, bytearray) and torch.equal(kv_blob.decode(other, IDENT, key(3), LAYOUT), pages + 3)
    assert again.get_into(key(0), buffer) is None


# ---- the engine with tiers, against transformers ------------------------------------------
@pytest.fixture(scope="module")
def prompts_and_expected(tiny_model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """A long prompt, then that prompt with two other endings (the reuse), and fillers."""
    base = random_prompts(1, 4000, seed=11, low=200, high=200)[0]
    fillers = random_prompts(2, 4000, seed=12, low=220, high=220)
    prompts = [base, base + [5, 6, 7], *fillers, base[:100] + [9, 9]]
    return prompts, hf_greedy(tiny_model_dir, prompts, GREEDY.max_new_tokens)


def tiered_engine(model_dir: Path, dtype: str = "auto", **tiers: object) -> Engine:
    """An engine over the tiers ``tiers``; they load whatever they hold (``load='always'``:
    these tests are about what the tiers hold and give back, the cost rule has its own)."""
    tiers.setdefault("load", "always")
    config = EngineConfig(max_total_tokens=POOL_TOKENS, kv_tiers=KVTierConfig(**tiers))  # type: ignore[arg-type]
    return build_engine(model_dir, config, dtype=dtype)


def keys_asked(tier: object, method: str) -> list[int]:
    """How many keys each call of ``tier``'s ``method`` (keys first) asks for, from now on."""
    calls: list[int] = []
    wrapped = getattr(tier, method)

    def counted(keys: Sequence[bytes], *args: Any) -> Any:
        calls.append(len(keys))
        return wrapped(keys, *args)

    setattr(tier, method, counted)
    return calls


def serve(engine: Engine, prompts: list[list[int]], first: int = 0) -> list[list[int]]:
    """Each prompt alone, in order (so each one's pages are evicted by the next ones)."""
    outs = []
    for i, p in enumerate(prompts, start=first):
        engine.add_request(f"r{i}", p, GREEDY)
        outs.append(run_all(engine)[f"r{i}"])
    return outs


def test_a_tier_measured_slower_than_computing_is_declined_and_output_stays_equal(
    tiny_model_dir: Path, prompts_and_expected
) -> None:
    """The default rule (``load='cost'``): host memory that has measured slower than this
    engine's prefill is not loaded from; the prefix is computed, counted as declined, and
    what the heartbeat says shows the rule's inputs."""
    prompts, expected = prompts_and_expected
    engine = tiered_engine(tiny_model_dir, host_bytes=64 << 20, load="cost")
    assert engine.tiers is not None
    engine.tiers.estimates.note_load("host", 1, 1.0)  # a byte a second: slower than any prefill
    base, again, *fillers, shorter = prompts
    assert serve(engine, [base, *fillers, again, shorter]) == [expected[0], *expected[2:4], expected[1], expected[4]]
    host = engine.tiers.stats.tiers["host"]
    assert host.stored_pages > 0 and host.hit_pages == 0
    assert host.declined_pages >= 200 // 16 - 2  # the base prompt's pages were found there, and computed
    (counts,) = engine.tiers.counts()
    assert counts.declined_pages == host.declined_pages
    assert counts.load_s_per_page > counts.recompute_s_per_page > 0
    assert counts.recompute_s_per_pair == engine.tiers.estimates.prefill_s_per_pair >= 0.0
    engine.pages.check_invariants()


def test_host_tier_serves_evicted_prefixes_with_equal_output(tiny_model_dir: Path, prompts_and_expected) -> None:
    prompts, expected = prompts_and_expected
    engine = tiered_engine(tiny_model_dir, host_bytes=64 << 20)
    assert engine.tiers is not None
    tiers = engine.tiers

    def info() -> WorkerInfo:  # what the worker's heartbeat says of its tiers
        counters = WorkerCounters(**tiers.totals())
        return WorkerInfo("w", "prefill", "m", "h", 1, 1, 1, 0, 16, 0, counters=counters, kv_tiers=tiers.counts())

    metrics = WorkerMetrics(info, tiers)
    base, again, *fillers, shorter = prompts
    assert serve(engine, [base, *fillers, again, shorter]) == [expected[0], *expected[2:4], expected[1], expected[4]]
    host = engine.tiers.stats.tiers["host"]  # type: ignore[union-attr]
    assert host.stored_pages > 0  # the fillers pushed the base prompt's pages out of the pool
    assert host.hit_pages >= 200 // 16 - 2  # ... and they came back from host memory
    assert engine.stats.cached_tokens >= host.hit_pages * 16
    engine.pages.check_invariants()
    text = metrics.exposition().decode()
    page_bytes = engine.runner.pool.page_bytes
    for line in (
        f'pdserve_kv_tier_hit_pages_total{{role="prefill",tier="host",worker="w"}} {host.hit_pages}.0',
        f'pdserve_kv_tier_load_bytes_total{{role="prefill",tier="host",worker="w"}} {host.hit_pages * page_bytes}.0',
        f'pdserve_kv_tier_lookups_total{{role="prefill",worker="w"}} {tiers.stats.lookups}.0',
        f"pdserve_kv_tier_lookup_duration_seconds_count {tiers.stats.lookups}.0",
    ):
        assert line in text


def test_disk_tier_serves_a_restarted_engine_and_skips_corrupt_files(
    tiny_model_dir: Path, prompts_and_expected, tmp_path: Path
) -> None:
    prompts, expected = prompts_and_expected
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)
    assert serve(engine, prompts[:1]) == expected[:1]
    engine.close()  # the writes are done
    disk = engine.tiers.stats.tiers["disk"]  # type: ignore[union-attr]
    assert disk.stored_pages == 200 // 16 // 4 * 4
    # A new engine over the same directory finds the whole prefix there, not only its first
    # group (whether the cost rule takes it is timed, on this machine's mood: the rule's own
    # tests set the rates).
    restarted = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)
    assert serve(restarted, [prompts[1]]) == [expected[1]]
    stats = restarted.tiers.stats.tiers["disk"]  # type: ignore[union-attr]
    assert stats.hit_pages == disk.stored_pages and stats.corrupt == 0 and stats.unbuffered_reads == 0
    assert engine.tiers.stats.write_errors == engine.tiers.stats.write_drops == 0  # type: ignore[union-attr]
    assert restarted.stats.cached_tokens == disk.stored_pages * 16
    restarted.close()
    files = sorted(Path(tmp_path).rglob("*.kv"))
    for f in files:  # a flipped byte in every file's payload
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    third = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)
    assert serve(third, [prompts[4]]) == [expected[4]]
    stats = third.tiers.stats.tiers["disk"]  # type: ignore[union-attr]
    assert stats.hit_pages == 0 and stats.corrupt == 1  # the first group failed: a miss, and removed
    assert third.stats.cached_tokens == 0
    third.tiers.drain()  # type: ignore[union-attr]  # (the writer's thread: on a busy machine it lags the engine)
    assert len(list(Path(tmp_path).rglob("*.kv"))) == len(files)  # rewritten by this run's own prefill
    third.close()


def test_a_bfloat16_pool_round_trips_through_the_disk_tier(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The GPU's pool dtype, on the CPU: a restarted bfloat16 engine serves a prompt from the
    disk and answers as the engine that computed it did."""
    prompt = list(range(5, 205))
    first = tiered_engine(tiny_model_dir, dtype="bfloat16", disk_dir=str(tmp_path), group_pages=4)
    assert first.runner.pool.tensor.dtype == torch.bfloat16
    computed = serve(first, [prompt])
    first.close()
    assert first.tiers.stats.write_errors == 0  # type: ignore[union-attr]
    assert first.tiers.stats.tiers["disk"].stored_pages == 200 // 16 // 4 * 4  # type: ignore[union-attr]
    restarted = tiered_engine(tiny_model_dir, dtype="bfloat16", disk_dir=str(tmp_path), group_pages=4)
    assert serve(restarted, [prompt], first=1) == computed
    assert restarted.tiers.stats.tiers["disk"].hit_pages == 200 // 16 // 4 * 4  # type: ignore[union-attr]
    restarted.close()


def test_a_load_is_one_reading_of_its_tier_s_rate(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A load of several groups gives its tier one rate reading, its bytes over its time: read
    step by step, the groups read ahead of their turn take only their copies' time, and their
    average made a disk read 19 GB/s on an H200 where its loads ran at about 3 (2026-12-05)."""
    prompt = list(range(5, 205))
    first = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)
    serve(first, [prompt])
    first.close()
    restarted = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)
    assert restarted.tiers is not None
    restarted.tiers.drain()
    readings: list[tuple[str, int]] = []
    note = restarted.tiers.estimates.note_load
    restarted.tiers.estimates.note_load = lambda tier, nbytes, seconds: (  # type: ignore[method-assign]
        readings.append((tier, nbytes)),
        note(tier, nbytes, seconds),
    )
    serve(restarted, [prompt + [1, 2, 3]])
    page = restarted.tiers.pool.page_bytes
    pages = 200 // 16 // 4 * 4
    assert restarted.tiers.stats.tiers["disk"].hit_pages == pages
    # the load's one reading (a calibration's reads, blobs with their headers, are no multiple of a page)
    assert [n for tier, n in readings if tier == "disk" and n % page == 0] == [pages * page]
    restarted.close()


def test_a_worker_runs_a_load_and_a_write_once_at_start_leaving_no_trace(tmp_path: Path) -> None:
    """Before its first request a worker with a disk or store runs a write's snapshot and a
    load's copy into the pool once (a restarted worker's first load paid those first times on
    an H100, 2026-12-07): the pool is as it was, nothing is written, counted or read, the
    loaders' threads are up, and every read buffer is back."""
    pool = random_pool(num_pages=8)
    before = pool.tensor.clone()
    tiers = KVTiers(pool, KVTierConfig(disk_dir=str(tmp_path), group_pages=2), IDENT)
    assert tiers._loaders is None
    tiers.warm_up()
    tiers.drain()
    assert torch.equal(pool.tensor, before)
    assert tiers._loaders is not None and len(tiers._loaders._threads) == 4
    assert tiers._read_buffers.free == tiers._read_buffers.count
    assert not any(tiers.totals().values())
    assert all(counters == TierCounters() for counters in tiers.stats.tiers.values())
    assert not list(tmp_path.rglob("*.kv"))
    tiers.close()


def test_an_engine_with_a_group_tier_warms_its_loads_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)
    assert engine.tiers is not None and engine.tiers._loaders is not None
    assert engine.stats.steps == 0 and engine.pages.num_cached_pages == 0
    engine.close()


FIRST_REQUESTS = """
import sys
from pathlib import Path
from tests.engine.test_kv_tiers import serve, tiered_engine
model, disk = Path(sys.argv[1]), sys.argv[2]
prompts = [list(range(5 + i, 205 + i)) + [1, 2, 3] for i in range(2)]
for _ in range(2):  # the second: a restarted worker, which loads the prompts' groups
    engine = tiered_engine(model, disk_dir=disk, group_pages=4)  # (load "always": it loads, whatever the timing)
    engine.tiers.drain()
    before = set(sys.modules)
    for prompt in prompts:
        serve(engine, [prompt])
    engine.tiers.drain()
    print(sorted(set(sys.modules) - before), engine.tiers.stats.tiers["disk"].hit_pages)
    engine.close()
"""


def test_a_worker_s_first_requests_import_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    """No module is imported on a request's path, in a first process writing its disk nor in a
    restarted one loading from it (a fresh interpreter: another test may have imported it):
    numpy's median imported numpy.ma at a worker's first lookup (9 ms of its time to first
    token on this project's CPU, 2026-12-07)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", FIRST_REQUESTS, str(tiny_model_dir), str(tmp_path / "disk")],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    first, restarted = done.stdout.strip().splitlines()[-2:]
    assert first == "[] 0"
    assert restarted.startswith("[] ") and int(restarted.split()[1]) > 0  # it loaded


def test_a_tier_is_measured_off_the_request_path(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The writer reads a tier's first group back to time it, and a restarted engine times
    one of the groups its disk holds before any request: the cost rule never has to load a
    whole prefix on a request's path to learn that a tier is slow (on an H200 a chat's first
    load from disk took 4x computing, 2026-12-04)."""
    first = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost")
    assert first.tiers is not None and first.tiers.estimates.load_seconds("disk", 1) is None
    serve(first, [list(range(5, 205))])
    first.tiers.drain()
    assert first.tiers.stats.tiers["disk"].calibrations == 1  # the first write only (of 3 groups)
    assert first.tiers.estimates.load_seconds("disk", 1) is not None
    assert first.tiers.stats.tiers["disk"].hit_pages == 0  # measured without a load
    first.close()
    restarted = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost")
    assert restarted.tiers is not None
    assert restarted.tiers.estimates.load_seconds("disk", 1) is not None  # measured before it returned
    # its own prefill timed at start too, leaving no trace: nothing cached, offered or counted
    assert restarted.tiers.estimates.recompute_seconds(16) is not None
    assert restarted.stats.steps == restarted.stats.prompt_tokens == 0 and not restarted.has_work()
    assert restarted.pages.num_cached_pages == 0
    restarted.tiers.drain()
    assert restarted.tiers.stats.tiers["disk"].calibrations == 1
    assert restarted.tiers._width["disk"] == 3  # its three groups read at once, as a load would
    assert restarted.tiers.stats.tiers["disk"].stored_pages == 0
    assert restarted.tiers.estimates.load_seconds("disk", 1) is not None
    (counts,) = [c for c in restarted.tiers.counts() if c.tier == "disk"]
    assert counts.calibrations == 1 and counts.load_s_per_page > 0
    restarted.close()


def test_disk_loads_read_into_reused_buffers_and_count_a_read_without_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A restarted engine loads 12 one-page groups (more than its read buffers), each read into
    a reused buffer, none fresh; with every buffer held elsewhere the same load reads each group
    into a fresh buffer, counted, and serves the same tokens; every buffer comes back."""
    prompt = list(range(5, 205))  # 12 full pages
    first = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=1)
    computed = serve(first, [prompt])
    first.close()
    for hold in (False, True):
        engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=1, prefetch_bytes=0)
        assert engine.tiers is not None
        buffers = engine.tiers._read_buffers
        assert buffers.count < 12 and not buffers.pin  # pinned where the pool is on a GPU
        held = []
        while hold and (b := buffers.take()) is not None:
            held.append(b)
        assert serve(engine, [prompt], first=1) == computed
        disk = engine.tiers.stats.tiers["disk"]
        assert disk.hit_pages == 12 and disk.unbuffered_reads == (12 if hold else 0)
        assert buffers.free == buffers.count - len(held)
        for b in held:
            buffers.give(b)
        if not hold:  # a group read into a buffer is a 64-byte aligned view of that buffer's tensor
            from pdserve.engine.kv_tiers import _Step

            disk_tier = engine.tiers.tier("disk")
            assert isinstance(disk_tier, DiskTier)
            buffer = buffers.take()
            assert buffer is not None
            got = engine.tiers._fetch_group(_Step("disk", disk_tier.sample_keys(1)[0], 0, 1), buffer)
            assert got.group is not None and got.group.untyped_storage().data_ptr() == buffer.data.data_ptr()
            assert got.group.data_ptr() % 64 == 0
            buffers.give(buffer)
        engine.close()


def restarted_over_disk(
    model_dir: Path, disk: Path, prompt: list[int], **tiers: object
) -> tuple[list[list[int]], Engine]:
    """``prompt``'s greedy output from a first engine whose disk tier keeps it, and a second
    engine over that disk (the cost rule unless ``tiers`` names another ``load``, no read-ahead;
    ``tiers``: more of its settings)."""
    first = tiered_engine(model_dir, disk_dir=str(disk), group_pages=4)
    computed = serve(first, [prompt])
    first.close()
    settings: dict[str, object] = {"load": "cost", "prefetch_bytes": 0, **tiers}
    return computed, tiered_engine(model_dir, disk_dir=str(disk), group_pages=4, **settings)


def test_a_tier_is_measured_reading_as_many_groups_at_once_as_a_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The first write's group is read back alone; once LOAD_THREADS groups are written they
    are read back at once, on as many threads as a load uses, and that reading replaces the
    first (one group on one thread understates what a load's parallel reads deliver)."""
    from pdserve.engine import kv_write

    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=1, load="cost", prefetch_bytes=0)
    assert engine.tiers is not None
    serve(engine, [list(range(5, 205))])  # 12 full pages: 12 groups of one page
    engine.tiers.drain()
    assert engine.tiers.stats.tiers["disk"].calibrations == 2  # the first group, then the first four
    assert engine.tiers._width["disk"] == kv_write.LOAD_THREADS
    assert engine.tiers.estimates.load_seconds("disk", 1) is not None
    engine.close()


def test_a_tier_found_holding_a_prefix_before_it_was_measured_is_timed_on_one_group_then_ruled(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A disk or store not measured yet (a second worker on a shared store: nothing to time at
    its start) is timed reading one of the prefix's groups before the rule decides, not loaded
    blind (on an H200 such a blind load from the store took 2.4x computing, 2026-12-04): here,
    where reading is far cheaper than this CPU's prefill, the prefix then loads."""
    prompt = list(range(5, 205))
    computed, second = restarted_over_disk(tiny_model_dir, tmp_path, prompt)
    assert second.tiers is not None
    second.tiers.estimates.bytes_per_s.pop("disk")  # as a store is at start: no rate
    second.tiers.estimates.clear_prefill()  # and a prefill of a millisecond a token (this CPU's own
    second.tiers.note_prefill(1000, 1.0)  # rate, read at start on a busy runner, could be any)
    calibrated = second.tiers.stats.tiers["disk"].calibrations
    assert serve(second, [prompt], first=1) == computed
    disk = second.tiers.stats.tiers["disk"]
    assert disk.calibrations == calibrated + 1 and second.tiers.estimates.load_seconds("disk", 1) is not None
    assert disk.hit_pages == 200 // 16 // 4 * 4 and disk.declined_pages == 0
    # the same on a disk that reads slower than anything computes: timed, then declined
    computed, third = restarted_over_disk(tiny_model_dir, tmp_path / "slow", prompt)
    assert third.tiers is not None
    third.tiers.estimates.bytes_per_s.pop("disk")
    disk_tier = third.tiers.tier("disk")
    assert disk_tier is not None
    get, get_into = disk_tier.get, disk_tier.get_into  # type: ignore[attr-defined]

    def slow_get(key: bytes, *into: memoryview) -> object:
        blob = get_into(key, *into) if into else get(key)
        time.sleep(1.0)  # a group a second: slower than computing the whole prompt here
        return blob

    disk_tier.get = disk_tier.get_into = slow_get  # type: ignore[method-assign, attr-defined]
    assert serve(third, [prompt], first=1) == computed
    disk = third.tiers.stats.tiers["disk"]
    assert disk.hit_pages == 0 and disk.declined_pages == 200 // 16 // 4 * 4
    third.close()
    second.close()


def over_a_slow_disk(tiny_model_dir: Path, tmp_path: Path) -> tuple[Engine, KVTiers, list[bytes]]:
    """A restarted engine over a disk holding a 200-token prompt's 12 pages, measured slower
    than computing them (a prompt token a microsecond, a page of 16 tokens 16 us; a page's load
    a millisecond), and the prompt's page hashes."""
    prompt = list(range(5, 205))
    _, engine = restarted_over_disk(tiny_model_dir, tmp_path, prompt)
    tiers = engine.tiers
    assert tiers is not None
    tiers.estimates.clear_prefill()
    tiers.note_prefill(1000, 1e-3)
    tiers.estimates.bytes_per_s["disk"] = tiers.pool.page_bytes / 1e-3
    return engine, tiers, page_hashes(prompt, 16, None)


def test_a_tier_known_to_hold_a_run_too_long_to_pay_whole_is_not_asked(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Without ``cut_runs`` the decision takes a tier's run whole or not at all, and the run a
    lookup finds is at least what this worker knows the tier holds (written there, or found
    there by a lookup): once a lookup found the prompt's 12 pages, where one group would pay
    but the whole run cannot (a page 16 us to compute, 12.5 to load as weighed; the step's
    floor leaves 70 us to save), the tier is not asked again; with ``cut_runs`` it is."""
    engine, tiers, hashes = over_a_slow_disk(tiny_model_dir, tmp_path)
    disk = tiers.stats.tiers["disk"]
    tiers.estimates.bytes_per_s["disk"] = tiers.pool.page_bytes / 10e-6
    tiers.estimates.call_seconds.clear()
    tiers.estimates._floor = 130e-6  # of the 200-token step's 200 us, 70 above the floor
    assert tiers._held_pages("disk", hashes, 0, 12) == 0  # a restarted worker: nothing known
    assert not tiers._cannot_pay("disk", 0, 12, hashes)  # a run of one group would pay
    plan = tiers.find(hashes, 0, len(hashes))
    assert plan.num_pages == 12 and disk.skipped_lookups == 0  # asked: found whole
    assert tiers.worth_loading(plan).now.num_pages == 0  # the whole run: 192 us of computing, 70 saved, 150 to load
    assert tiers._held_pages("disk", hashes, 0, 12) == 12 and tiers._held_pages("disk", hashes, 5, 12) == 7
    tiers.estimates.call_seconds.clear()  # (the lookup's round trip, timed, aside)
    assert tiers._cannot_pay("disk", 0, 12, hashes)
    assert tiers.find(hashes, 0, len(hashes)).num_pages == 0 and disk.skipped_lookups == 1
    tiers.config = dataclasses.replace(tiers.config, cut_runs=True)  # a cut may take the first group: asked
    assert not tiers._cannot_pay("disk", 0, 12, hashes)
    assert tiers.find(hashes, 0, len(hashes)).num_pages == 12 and disk.skipped_lookups == 1
    engine.close()


def test_a_tier_no_run_of_which_could_pay_is_not_asked(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A group tier from which no run of the prompt's pages that begins where a load would
    begin is measured worth loading (slower than computing even its dearest page, or only its
    last pages dearer to compute than to load) is not looked up (a store's lookup is a round
    trip to its master, every request): counted, and the prefix is computed. It is asked
    while unmeasured, where it is faster, with ``load='always'``, with overlap on, and when a
    group of the prefix was read ahead into memory."""
    engine, tiers, hashes = over_a_slow_disk(tiny_model_dir, tmp_path)
    disk = tiers.stats.tiers["disk"]
    page_bytes = tiers.pool.page_bytes
    plan = tiers.find(hashes, 0, len(hashes))
    assert plan.num_pages == 0 and disk.skipped_lookups == 1
    tiers.estimates.bytes_per_s["disk"] = page_bytes / 1e-6  # a page a microsecond: asked, found
    assert tiers.find(hashes, 0, len(hashes)).num_pages == 12 and disk.skipped_lookups == 1
    tiers.estimates.bytes_per_s["disk"] = page_bytes / 1e-3
    for setting in ({"load": "always"}, {"overlap": True}):
        saved = tiers.config
        tiers.config = dataclasses.replace(saved, **setting)
        assert tiers.find(hashes, 0, len(hashes)).num_pages == 12, setting
        tiers.config = saved
    tiers._fetched[hashes[3]] = ("disk", b"")  # a group of the prefix read ahead: asked
    assert tiers.find(hashes, 0, len(hashes)).num_pages == 12
    tiers._fetched.clear()
    assert disk.skipped_lookups == 1
    # a tier whose last pages are dearer to compute than to load, but no run from the first:
    # computing page i costs 16 us + 0.01 us * 16 * (16 i + 8), its last (i = 11) 45.4 us; a
    # page's load 32 us, weighed at 40 (GROUP_LOAD_MARGIN). The whole run of 12 pages: 376 us to
    # compute, 480 to load; not asked
    tiers.estimates.prefill_s_per_pair = 1e-8
    tiers.estimates.bytes_per_s["disk"] = page_bytes / 32e-6
    tiers.estimates.call_seconds.clear()  # (the lookups' round trips, timed above, aside)
    assert tiers.find(hashes, 0, len(hashes)).num_pages == 0 and disk.skipped_lookups == 2
    # a run from page 8 (the pages before it in host memory, say): 4 pages, 166 us against 160
    assert tiers._cannot_pay("disk", 0, 12, hashes) and not tiers._cannot_pay("disk", 8, 12, hashes)
    # a lookup must repay itself: with a 4 us round trip that run saves 166.4 - 1.25 * (128 + 4)
    # = 1.4 us, less than asking costs (it paid, by 1.4 us, before the lookup was weighed); with
    # a 1 us one it saves 5.2
    tiers.estimates.call_seconds["disk"] = 4e-6
    assert tiers._cannot_pay("disk", 8, 12, hashes)
    tiers.estimates.call_seconds["disk"] = 1e-6
    assert not tiers._cannot_pay("disk", 8, 12, hashes)
    tiers.estimates.call_seconds.clear()
    del tiers.estimates.bytes_per_s["disk"]  # unmeasured: asked (then timed by the rule)
    assert tiers.find(hashes, 0, len(hashes)).num_pages == 12 and disk.skipped_lookups == 2
    (counts,) = tiers.counts()
    assert counts.skipped_lookups == 2
    engine.close()


def test_a_tier_measured_slow_once_is_measured_again(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Declined loads measure nothing: the writer reads a group back every RECALIBRATE_EVERY
    groups it writes, so a rate measured in a busy moment does not decline a tier for good."""
    from pdserve.engine import kv_write

    monkeypatch.setattr(kv_write, "RECALIBRATE_EVERY", 2)
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost", prefetch_bytes=0)
    assert engine.tiers is not None
    engine.tiers.estimates.bytes_per_s["disk"] = 1.0  # measured a byte a second, once
    serve(engine, [list(range(5, 205))])  # writes 3 groups
    engine.tiers.drain()
    assert engine.tiers.stats.tiers["disk"].calibrations == 1  # at the second write
    assert engine.tiers.estimates.bytes_per_s["disk"] > 1e3  # moved toward the disk's real rate
    engine.close()


def test_a_group_no_load_could_take_is_not_copied_or_written(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence's groups go only to the tiers from which a leading run of them could be worth
    loading: a disk measured slower takes none of a prompt's groups (not copied off the device
    either: nothing is queued), counted per tier; every RECALIBRATE_EVERY groups it takes one
    anyway and is measured again; measured fast, or with ``load='always'``, it takes them all."""
    from pdserve.engine import kv_write

    monkeypatch.setattr(kv_write, "RECALIBRATE_EVERY", 4)
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost", prefetch_bytes=0)
    tiers = engine.tiers
    assert tiers is not None
    disk = tiers.stats.tiers["disk"]
    queued: list[object] = []
    put = tiers._queue.put_nowait
    monkeypatch.setattr(tiers._queue, "put_nowait", lambda item: (queued.append(item), put(item)))
    tiers.estimates.bytes_per_s["disk"] = 1.0  # a byte a second: no load of a group could pay
    serve(engine, [list(range(5, 205))])  # 12 full pages: 3 groups
    tiers.drain()
    assert disk.unwritten_groups == 3 and disk.stored_pages == 0 and queued == []
    (counts,) = [c for c in tiers.counts() if c.tier == "disk"]
    assert counts.unwritten_groups == 3
    serve(engine, [list(range(300, 500))])  # 3 more: the fourth since the disk took one is written
    tiers.drain()
    assert disk.unwritten_groups == 5 and disk.stored_pages == 4 and len(queued) == 1
    assert disk.calibrations == 1 and tiers.estimates.bytes_per_s["disk"] > 1e3, "measured again"
    tiers.estimates.bytes_per_s["disk"] = 1e15  # fast: every group
    serve(engine, [list(range(600, 800))])
    tiers.drain()
    assert disk.unwritten_groups == 5 and disk.stored_pages == 4 + 12
    tiers.estimates.bytes_per_s["disk"] = 1.0
    tiers.config = dataclasses.replace(tiers.config, load="always")  # saves compute whatever it costs: every group
    serve(engine, [list(range(900, 1100))])
    tiers.drain()
    assert disk.unwritten_groups == 5 and disk.stored_pages == 4 + 24
    engine.close()


def test_a_group_whose_load_would_not_repay_its_lookup_is_not_written(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A load asks the tier first (a lookup's round trip), so groups whose load would save less
    than that are not written, as they would not be asked for: 3 groups of 64 tokens, a token a
    microsecond to compute, loaded in no time but for the round trip (weighed 1.25x): with a 30
    us lookup they save 154 us and are written, with a 120 us one 42, less than the lookup."""
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost", prefetch_bytes=0)
    tiers = engine.tiers
    assert tiers is not None
    tiers.estimates.clear_prefill()
    tiers.note_prefill(1000, 1e-3)
    tiers.estimates.bytes_per_s["disk"] = 1e15
    tiers.estimates.call_seconds["disk"] = 30e-6
    assert tiers._tiers_worth_writing(3) == {"disk"}
    tiers.estimates.call_seconds["disk"] = 120e-6
    assert tiers._tiers_worth_writing(3) == set()
    engine.close()


def test_a_tier_that_comes_to_pay_takes_the_sequence_s_earlier_groups_too(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The leading-run rule: a load takes a prefix's groups from the first, so where a longer
    prompt makes a tier pay, the groups of its start that a shorter one left unwritten are
    written then (a prefix with a gap could never be loaded past it)."""
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost", prefetch_bytes=0)
    tiers = engine.tiers
    assert tiers is not None
    disk = tiers.stats.tiers["disk"]
    tiers.estimates.clear_prefill()
    tiers.note_prefill(1000, 1e-3)  # a microsecond a token
    tiers.estimates.prefill_s_per_pair = 1e-7  # and a tenth of one a (query, key) pair
    group = 4 * tiers.pool.page_bytes
    # computing group i where it stands: 64 us + 0.1 us * 64 * (64 i + 32) = 269, 678, 1088 us;
    # a group's load 480 us, weighed at 600 (GROUP_LOAD_MARGIN): one group or two do not pay
    # (269 < 600, 947 < 1,200), three do
    tiers.estimates.bytes_per_s["disk"] = group / 4.8e-4
    assert tiers._tiers_worth_writing(1) == set() and tiers._tiers_worth_writing(2) == set()
    assert tiers._tiers_worth_writing(3) == {"disk"}
    short, long = list(range(5, 5 + 16 * 8)), list(range(5, 5 + 16 * 16))  # 2 groups, then 4 sharing them
    saved_rate = dict(tiers.estimates.bytes_per_s)

    def keep_estimates() -> None:  # the steps' own readings would move the rule; these are the test's
        tiers.estimates.clear_prefill()
        tiers.note_prefill(1000, 1e-3)
        tiers.estimates.prefill_s_per_pair = 1e-7
        tiers.estimates.bytes_per_s.update(saved_rate)

    original = tiers.note_prefill
    tiers.note_prefill = lambda *a, **k: None  # type: ignore[method-assign]
    serve(engine, [short])
    tiers.drain()
    assert disk.stored_pages == 0 and disk.unwritten_groups == 2
    keep_estimates()
    serve(engine, [long])
    tiers.drain()
    assert disk.stored_pages == 4 * 4, "all four, the two the short prompt left among them"
    tiers.note_prefill = original  # type: ignore[method-assign]
    engine.close()


def test_groups_every_tier_holds_are_not_copied_again(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that computes a prefix its disk already holds (declined as slower than
    computing) copies none of it off the device for the writer."""
    prompt = list(range(5, 205))
    computed, second = restarted_over_disk(tiny_model_dir, tmp_path, prompt)
    assert second.tiers is not None
    second.tiers.drain()
    second.tiers.estimates.bytes_per_s["disk"] = 1.0  # a byte a second (over its calibration): declined
    # (and, by that rate, not written either: here the groups are offered to it, to see them found held)
    monkeypatch.setattr(second.tiers, "_tiers_worth_writing", lambda groups: {"disk"})
    assert serve(second, [prompt], first=1) == computed
    second.tiers.drain()
    stats = second.tiers.stats
    assert stats.tiers["disk"].skipped_lookups == 1 and stats.tiers["disk"].hit_pages == 0  # not asked: computed
    assert stats.already_held == 200 // 16 // 4 and stats.tiers["disk"].stored_pages == 0
    second.close()


def test_a_worker_s_probes_keep_each_size_s_fastest_of_the_rounds_timed(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At start a worker whose disk decides by cost times its prefill probes in a first round
    (compiles, no reading) and then :data:`engine.PROBE_ROUNDS` rounds (here two on the CPU, as
    on a GPU): the rule keeps, for each size, the fastest of the timed rounds' readings."""
    from pdserve.engine import engine as engine_module

    monkeypatch.setitem(engine_module.PROBE_ROUNDS, "cpu", 2)
    noted: list[tuple[int, float, float]] = []
    note = CostEstimates.note_prefill

    def recorded(self: CostEstimates, tokens: int, seconds: float, pairs: float = 0.0) -> None:
        noted.append((tokens, seconds, pairs))
        note(self, tokens, seconds, pairs)

    monkeypatch.setattr(CostEstimates, "note_prefill", recorded)
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost")
    assert engine.tiers is not None
    readings = list(engine.tiers.estimates.prefill_readings)
    sizes = [(t, p) for t, _, p in readings]
    assert len(sizes) == len(set(sizes)) >= 2
    assert len(noted) == 3 * len(readings), "three rounds of the same steps"
    timed = noted[len(readings) :]
    for tokens, seconds, pairs in readings:
        assert seconds == min(sec for t, sec, p in timed if (t, p) == (tokens, pairs))
    engine.close()


def test_the_rule_is_fitted_as_a_step_launches_not_in_a_requests_lookup(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The prefill steps' readings are fitted once the next step is launched (while the device
    runs it), so a request's lookup finds the rule's line fitted and fits nothing before its
    own step; the line is the one a fit at the lookup would give."""
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path / "disk"), group_pages=4, load="cost")
    tiers = engine.tiers
    assert tiers is not None
    unfitted_at_lookup: list[bool] = []
    find = tiers.find

    def recorded(*args: Any) -> Any:
        unfitted_at_lookup.append(tiers.estimates._unfitted)
        return find(*args)

    tiers.find = recorded  # type: ignore[method-assign]
    prompts = random_prompts(4, 4000, seed=21, low=120, high=200)
    serve(engine, prompts)
    readings = list(tiers.estimates.prefill_readings)
    assert len(unfitted_at_lookup) == len(prompts) and len(readings) >= len(prompts)
    assert not any(unfitted_at_lookup), unfitted_at_lookup
    fitted = (tiers.estimates.prefill_fixed_s, tiers.estimates.prefill_s_per_token, tiers.estimates.prefill_s_per_pair)
    again = CostEstimates()
    for r in readings:
        again.note_prefill(*r)
    again._floor, again._floor_per_token = tiers.estimates._floor, tiers.estimates._floor_per_token
    assert (again.prefill_fixed_s, again.prefill_s_per_token, again.prefill_s_per_pair) == fitted
    engine.close()


def test_a_tier_a_round_trip_away_is_not_asked_on_the_engines_thread(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a tier that is not local (a store: its master a round trip away), the groups a
    step filled are not checked against the tiers on the engine's thread (that would delay
    the step's tokens): they are snapshotted, and the writer asks each tier before writing,
    so a group already held is still not written again."""
    import threading

    prompt = list(range(5, 205))
    computed, second = restarted_over_disk(tiny_model_dir, tmp_path, prompt)
    assert second.tiers is not None
    second.tiers.drain()
    second.tiers.estimates.bytes_per_s["disk"] = 1.0  # declined: computed
    # (and, by that rate, not written either: here every group is offered to it, as to a tier
    # that could pay for some, to see where the check is made)
    monkeypatch.setattr(second.tiers, "_tiers_worth_writing", lambda groups: {"disk"})
    (disk,) = second.tiers.groups
    disk.local = False  # type: ignore[misc]  # as a store is
    asked: list[str] = []
    contains_many = disk.contains_many

    def recorded(keys: list[bytes]) -> list[bool]:
        asked.append(threading.current_thread().name)
        return contains_many(keys)

    disk.contains_many = recorded  # type: ignore[method-assign]
    engine_thread = threading.current_thread().name
    assert serve(second, [prompt], first=1) == computed
    second.tiers.drain()
    stats = second.tiers.stats
    assert engine_thread not in asked  # the lookups the cost rule makes aside, none from offer
    assert stats.already_held == 0 and stats.tiers["disk"].stored_pages == 0  # the writer found them held
    assert stats.held_at_write == 200 // 16 // 4  # and counted the copies made for nothing
    second.close()


def test_a_tier_thread_bug_ends_the_engine_loudly(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the writer thread is counted, then raised on the engine's thread at its next
    step: the worker does not serve on with tiers that keep nothing."""
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)

    def broken(*args: object) -> tuple[bytes, memoryview]:
        raise TypeError("a bug in encoding")

    monkeypatch.setattr(kv_blob, "encode_parts", broken)
    serve(engine, [list(range(5, 205))])
    engine.tiers.drain()  # type: ignore[union-attr]
    assert engine.tiers.stats.write_errors == 200 // 16 // 4  # type: ignore[union-attr]
    engine.add_request("next", list(range(300, 340)), GREEDY)
    with pytest.raises(RuntimeError, match="KV tier thread failed") as raised:
        run_all(engine)
    assert isinstance(raised.value.__cause__, TypeError)


def test_a_queued_request_finds_its_prefix_read_ahead(
    tiny_model_dir: Path, prompts_and_expected, tmp_path: Path
) -> None:
    """The disk tier's groups of a queued request's prompt are read into memory while it
    waits behind another; its load then copies from memory, priced at that rate by the cost
    rule: a disk measured slower than computing is still used once its groups are in memory.
    A request nothing waits before is not read ahead (the read would race its own load), nor
    one whose disk loads read faster than loads take read-ahead groups."""
    prompts, expected = prompts_and_expected
    first = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)
    assert serve(first, prompts[:1]) == expected[:1]
    first.close()
    groups = 200 // 16 // 4

    alone = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost")
    assert alone.tiers is not None
    alone.tiers.estimates.bytes_per_s["disk"] = 1.0  # a byte a second: reading it on the step's path loses
    not_asked = keys_asked(alone.tiers.tier("disk"), "contains_many")
    alone.add_request("r1", prompts[1], GREEDY)
    alone.tiers.drain_prefetches()
    assert alone.tiers.stats.tiers["disk"].prefetched_groups == 0
    assert not_asked == []  # nor was the tier asked what it holds beside the engine's thread
    alone.close()

    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost")
    assert engine.tiers is not None
    engine.tiers.estimates.bytes_per_s["disk"] = 1.0
    tier = engine.tiers.tier("disk")
    asked = keys_asked(tier, "contains_many")
    engine.add_request("r0", [3, 1, 4, 1, 5], GREEDY)  # ahead of it (no full page: nothing to look up or write)
    engine.add_request("r1", prompts[1], GREEDY)
    engine.tiers.drain_prefetches()
    assert asked == [groups]  # the read-ahead asked the tier about the prefix's groups once
    disk = engine.tiers.stats.tiers["disk"]
    assert disk.prefetched_groups == groups and disk.hit_pages == 0  # read ahead, nothing loaded yet
    assert run_all(engine)["r1"] == expected[1]
    assert disk.prefetch_hits == groups and disk.hit_pages == groups * 4 and disk.declined_pages == 0
    assert engine.tiers.estimates.load_seconds("prefetched", 1) is not None  # its own rate, measured
    assert engine.stats.cached_tokens == groups * 4 * 16
    (counts,) = engine.tiers.counts()
    assert (counts.prefetched_groups, counts.prefetch_hits, counts.prefetch_wasted) == (groups, groups, 0)
    engine.close()

    # loads of this disk measured faster than loads of read-ahead groups: a waiting request is not read ahead
    direct = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost")
    assert direct.tiers is not None
    direct.tiers.estimates.bytes_per_s.update(disk=2e9, prefetched=1e9)
    direct.add_request("r0", [3, 1, 4, 1, 5], GREEDY)
    direct.add_request("r1", prompts[1], GREEDY)
    direct.tiers.drain_prefetches()
    assert direct.tiers.stats.tiers["disk"].prefetched_groups == 0
    assert run_all(direct)["r1"] == expected[1] and direct.tiers.stats.tiers["disk"].hit_pages == groups * 4
    direct.close()

    # the same slow disk without prefetch: declined, computed
    plain = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, load="cost", prefetch_bytes=0)
    assert plain.tiers is not None
    plain.tiers.estimates.bytes_per_s["disk"] = 1.0  # too slow to load even one page beside the computing
    plain.tiers.note_prefill(1024, 1e-3)
    assert serve(plain, [prompts[1]]) == [expected[1]]
    stats = plain.tiers.stats.tiers["disk"]
    assert stats.prefetched_groups == 0 and stats.hit_pages == 0 and stats.skipped_lookups == 1  # not asked
    plain.close()

    # prefetched memory beyond its limit: the oldest groups dropped, counted, the load reads the disk
    small = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4, prefetch_bytes=1)
    assert small.tiers is not None
    small.add_request("r0", [3, 1, 4, 1, 5], GREEDY)
    small.add_request("r2", prompts[1], GREEDY)
    small.tiers.drain_prefetches()
    assert run_all(small)["r2"] == expected[1]
    stats = small.tiers.stats.tiers["disk"]
    assert stats.prefetched_groups == stats.prefetch_wasted == groups and stats.prefetch_hits == 0
    assert stats.hit_pages == groups * 4
    small.close()


# ---- Mooncake Store ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def store_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreMaster]:
    """A real ``mooncake_master`` and a ``mooncake_client`` lending it 64 MiB (the Mooncake
    wheel's), on loopback."""
    with running_store(64 << 20, tmp_path_factory.mktemp("store")) as master:
        yield master


def test_store_tier_round_trips_and_refuses_corrupt_objects(
    store_master: StoreMaster, caplog: pytest.LogCaptureFixture
) -> None:
    from pdserve.engine.kv_store import StoreTier

    store = StoreTier(store_master.address, store_master.metadata_url, IDENT)
    pages = random_pool().tensor[:2].clone()
    assert not store.contains(key(7)) and store.get(key(7)) is None
    store.put(key(7), kv_blob.encode(IDENT, key(7), pages))
    assert store.contains(key(7))
    assert store.contains_many([key(6), key(7), key(9)]) == [False, True, False]  # one round trip
    assert store.contains_many([]) == []
    got = store.get(key(7))
    assert got is not None and torch.equal(kv_blob.decode(got, IDENT, key(7), LAYOUT), pages)
    # straight into a reused buffer of the blob's size; an object that does not fit: as get reads
    buffer = ReadBuffer(torch.zeros(len(got), dtype=torch.uint8))
    assert store.prepare([buffer, buffer]) == 1 and store.prepare([buffer]) == 0  # registered once, before reads
    into = store.get_into(key(7), buffer)
    assert isinstance(into, memoryview) and into.tobytes() == bytes(got) == bytes(buffer.data.numpy())
    with caplog.at_level("WARNING", logger="pdserve.engine.kv_store"):
        small = store.get_into(key(7), ReadBuffer(torch.zeros(len(got) - 1, dtype=torch.uint8)))
    assert isinstance(small, bytearray) and small == got
    assert [r.message for r in caplog.records] == ["Mooncake Store read into a buffer failed: read again"]
    assert store.get_into(key(6), buffer) is None
    # several in one call (the client's batch read): a missing one None, one that does not fit as get reads
    store.put(key(9), kv_blob.encode(IDENT, key(9), pages))
    other = ReadBuffer(torch.zeros(len(got), dtype=torch.uint8))
    tiny = ReadBuffer(torch.zeros(8, dtype=torch.uint8))
    many = store.get_many_into([key(7), key(6), key(9)], [buffer, other, tiny])
    assert isinstance(many[0], memoryview) and many[0].tobytes() == bytes(got) and many[1] is None
    assert isinstance(many[2], bytearray) and torch.equal(kv_blob.decode(many[2], IDENT, key(9), LAYOUT), pages)
    store.put(key(8), kv_blob.encode(IDENT, key(7), pages))  # stored under a key it does not belong to
    with pytest.raises(kv_blob.CorruptBlob):
        kv_blob.decode(store.get(key(8)) or b"", IDENT, key(8), LAYOUT)
    store.close()
    # the client let go of at close, its master still there (not by a later garbage collection,
    # where a closed tier's client hung a test run in its destructor once its master had gone)
    assert store._store is None
    store.close()  # twice: nothing more to do


def test_a_second_engine_serves_a_prompt_first_seen_by_another_from_the_store(
    tiny_model_dir: Path, prompts_and_expected, store_master: StoreMaster
) -> None:
    prompts, expected = prompts_and_expected
    tiers = dict(store_master=store_master.address, store_metadata=store_master.metadata_url)
    first = tiered_engine(tiny_model_dir, group_pages=4, **tiers)
    assert serve(first, prompts[:1]) == expected[:1]
    first.tiers.drain()  # type: ignore[union-attr]
    stored = first.tiers.stats.tiers["store"].stored_pages  # type: ignore[union-attr]
    assert stored == 200 // 16 // 4 * 4
    first.close()  # the objects live in the store server's memory: they outlive the first worker
    second = tiered_engine(tiny_model_dir, group_pages=4, **tiers)
    tier = second.tiers.tier("store")  # type: ignore[union-attr]
    reads = keys_asked(tier, "get_many_into")
    assert serve(second, [prompts[1]]) == [expected[1]]
    assert reads == [stored // 4]  # the prefix's groups read in one call to the client
    hits = second.tiers.stats.tiers["store"]  # type: ignore[union-attr]
    assert hits.hit_pages == stored and hits.corrupt == 0 and hits.unbuffered_reads == 0
    assert first.tiers.stats.write_errors == first.tiers.stats.write_drops == 0  # type: ignore[union-attr]
    assert second.stats.cached_tokens == stored * 16
    second.close()


def after_another_on_the_store(
    model_dir: Path, store_master: StoreMaster, prompt: list[int], expected: list[int], group_pages: int
) -> Engine:
    """An engine on ``store_master``'s store after another one (closed since) served ``prompt``
    there, its groups of ``group_pages`` pages written."""
    config = dict(store_master=store_master.address, store_metadata=store_master.metadata_url)
    first = tiered_engine(model_dir, group_pages=group_pages, **config)
    assert serve(first, [prompt]) == [expected]
    first.close()
    return tiered_engine(model_dir, group_pages=group_pages, **config)


def test_a_long_prefix_is_read_from_the_store_a_batch_of_groups_a_call(
    tiny_model_dir: Path, prompts_and_expected, store_master: StoreMaster
) -> None:
    """A load's store groups go to the client READ_BATCH at a call all the way through, not a
    group a call once the first reads' buffers come back one by one."""
    from pdserve.engine import kv_tiers

    prompts, expected = prompts_and_expected
    second = after_another_on_the_store(tiny_model_dir, store_master, prompts[0], expected[0], group_pages=1)
    tier = second.tiers.tier("store")  # type: ignore[union-attr]
    reads = keys_asked(tier, "get_many_into")
    assert serve(second, [prompts[1]]) == [expected[1]]
    assert reads == [kv_tiers.READ_BATCH] * (200 // 16 // kv_tiers.READ_BATCH)  # 12 groups of a page
    assert second.tiers.stats.tiers["store"].hit_pages == 200 // 16  # type: ignore[union-attr]
    second.close()


def test_a_batch_of_store_groups_takes_read_ahead_ones_from_memory_and_reads_the_rest(
    tiny_model_dir: Path, prompts_and_expected, store_master: StoreMaster
) -> None:
    """Of a batch of store groups, one read ahead comes from memory, one with a buffer is read in
    the batch's one call, one without (every buffer out) as ``get`` reads it: each checked and
    named by where it came from."""
    from pdserve.engine.kv_tiers import _Step
    from pdserve.engine.page_manager import page_hashes

    prompts, expected = prompts_and_expected
    engine = after_another_on_the_store(tiny_model_dir, store_master, prompts[0], expected[0], group_pages=4)
    tiers = engine.tiers
    assert tiers is not None
    tier = tiers.tier("store")
    assert tier is not None
    hashes = page_hashes(prompts[0], 16, None)
    keys = [hashes[end - 1] for end in (4, 8, 12)]
    blobs = [tier.get(k) for k in keys]
    assert all(b is not None for b in blobs)
    tiers._keep_prefetched(keys[1], "store", blobs[1])  # type: ignore[arg-type]
    reads = keys_asked(tier, "get_many_into")
    buffer = tiers._read_buffers.take()
    got = tiers._fetch_groups([(_Step("store", k, 0, 4), b) for k, b in zip(keys, (buffer, None, None), strict=True)])
    assert reads == [1] and [g.source for g in got] == ["store", "prefetched", "store"]
    for g, k, blob in zip(got, keys, blobs, strict=True):
        assert g.group is not None and torch.equal(g.group, kv_blob.decode(blob, tiers.ident, k, tiers.pool.layout))
    assert buffer is not None
    tiers._read_buffers.give(buffer)
    engine.close()


def test_a_store_is_measured_at_start_on_probe_groups_every_worker_shares(
    tiny_model_dir: Path, store_master: StoreMaster
) -> None:
    """A store cannot say what it holds, and a second worker's first lookup may find another's
    groups there: each worker measures it before taking a request, reading probe groups that
    the first one wrote (the same keys for every worker of the model: not one more object a
    worker; none of it counted as stored)."""
    import hashlib

    from pdserve.engine import kv_write

    keys = [hashlib.blake2b(b"pdserve-probe" + bytes([i]), digest_size=16).digest() for i in range(4)]
    tiers_config = dict(store_master=store_master.address, store_metadata=store_master.metadata_url)
    for _ in range(2):
        engine = tiered_engine(tiny_model_dir, group_pages=4, **tiers_config)
        tiers = engine.tiers
        assert tiers is not None
        store = tiers.stats.tiers["store"]
        assert store.calibrations == 1 and store.stored_pages == 0 and tiers._width["store"] == kv_write.LOAD_THREADS
        assert tiers.estimates.load_seconds("store", 1) is not None
        (counts,) = [c for c in tiers.counts() if c.tier == "store"]
        assert counts.load_s_per_page_one_call > 0  # a load of one call's groups is priced by it
        tier = tiers.tier("store")
        assert tier is not None and tier.contains_many(keys) == [True] * 4
        engine.close()


def test_a_store_is_measured_as_a_long_load_reads_it_two_batch_reads_at_once(
    tiny_model_dir: Path, store_master: StoreMaster
) -> None:
    """A load of a long prefix keeps two batch reads of the store in flight; a calibration
    reads the same way (its keys by each call, both calls at once: a barrier of two that a
    lone call would time out on, each call made several times), its reading every byte; then
    one call alone, a few times, as a load of no more groups reads (its rate prices such a
    load: ``CostEstimates.one_call``)."""
    import hashlib
    import threading

    from pdserve.engine import kv_write

    keys = [hashlib.blake2b(b"pdserve-probe" + bytes([i]), digest_size=16).digest() for i in range(4)]
    engine = tiered_engine(
        tiny_model_dir, group_pages=4, store_master=store_master.address, store_metadata=store_master.metadata_url
    )
    tiers = engine.tiers
    assert tiers is not None
    tier = tiers.tier("store")
    assert tier is not None
    both = threading.Barrier(kv_write.CALIBRATION_CALLS, timeout=10)
    wrapped = tier.get_many_into
    calls: list[int] = []

    made = kv_write.CALIBRATION_CALLS * kv_write.CALIBRATION_ROUNDS

    def at_once(asked: Sequence[bytes], buffers: Any) -> Any:
        calls.append(len(asked))
        if len(calls) <= made:
            both.wait()  # BrokenBarrierError (raised by calibrate) unless the other call is in flight
        return wrapped(asked, buffers)

    tier.get_many_into = at_once  # type: ignore[method-assign]
    noted: list[int] = []
    note_load = tiers.estimates.note_load

    def noting(name: str, nbytes: int, seconds: float) -> None:
        noted.append(nbytes)
        note_load(name, nbytes, seconds)

    tiers.estimates.note_load = noting  # type: ignore[method-assign]
    tiers.estimates.one_call.clear()
    assert tiers.calibrate(tier, keys)
    assert calls == [len(keys)] * (made + kv_write.CALIBRATION_ROUNDS)
    blob_bytes = len(tier.get(keys[0]) or b"")
    assert noted == [blob_bytes * len(keys) * made] and tiers._width["store"] == len(keys)
    one_bytes, one_seconds = tiers.estimates.one_call["store"]
    assert one_bytes == blob_bytes * len(keys) and one_seconds > 0
    engine.close()


def test_writes_a_store_cannot_take_are_counted_errors(
    tiny_model_dir: Path, prompts_and_expected, tmp_path: Path
) -> None:
    """A master with no memory lent to it (no store server): every put fails, is counted
    and logged, and the request is served all the same."""
    prompts, expected = prompts_and_expected
    master = plan_master()
    process = start(master, tmp_path / "master.log")
    try:
        engine = tiered_engine(
            tiny_model_dir, group_pages=4, store_master=master.address, store_metadata=master.metadata_url
        )
        assert serve(engine, prompts[:1]) == expected[:1]
        engine.close()
        stats = engine.tiers.stats  # type: ignore[union-attr]
        assert stats.write_errors == 200 // 16 // 4 and stats.tiers["store"].stored_pages == 0
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize("cut_runs", [False, True])
def test_with_cut_runs_the_leading_group_of_a_found_run_loads_where_the_whole_would_not_pay(
    tiny_model_dir: Path, tmp_path: Path, cut_runs: bool
) -> None:
    """A prompt whose step is little above its floor: a group of the disk's three saves more
    than it costs, the three do not. By default the run is declined whole (all 12 pages
    computed); with ``cut_runs`` its first group loads and the rest is computed. The output is
    the computed one either way."""
    prompt = list(range(5, 205))
    computed, engine = restarted_over_disk(tiny_model_dir, tmp_path, prompt, cut_runs=cut_runs)
    tiers = engine.tiers
    assert tiers is not None
    tiers.estimates.clear_prefill()
    tiers.note_prefill(1000, 0.1)  # 100 us a token: a group of 64 tokens 6.4 ms, the prompt 20 ms
    tiers.estimates._floor, tiers.estimates._floor_per_token = 0.01, 0.0  # 10 ms above the floor at most
    group_bytes = 4 * tiers.pool.page_bytes
    tiers.estimates.bytes_per_s["disk"] = group_bytes / 4e-3  # a group in 4 ms, weighed at 5: one pays, two do not
    tiers.estimates.call_seconds["disk"] = 0.0  # and no round trip priced (a loaded runner's would be noise here)
    tiers.estimates.note_call = lambda *args: None  # type: ignore[method-assign]
    assert serve(engine, [prompt], first=1) == computed
    disk = tiers.stats.tiers["disk"]
    assert (disk.hit_pages, disk.declined_pages) == ((4, 8) if cut_runs else (0, 12))
    assert engine.stats.cached_tokens == (4 * 16 if cut_runs else 0)
    engine.pages.check_invariants()
    engine.close()


def split_rates(engine: Engine, load_over_compute: float) -> None:
    """Price the disk's page at ``load_over_compute`` times the engine's measured cost of
    computing one (the prefill as the restarted engine measured it at start)."""
    tiers = engine.tiers
    assert tiers is not None
    compute = tiers.estimates.recompute_seconds(16)
    assert compute is not None
    tiers.estimates.bytes_per_s["disk"] = tiers.pool.page_bytes / (load_over_compute * compute)


def test_a_disk_slower_than_computing_loads_the_prefix_s_tail_while_its_head_is_computed(
    tiny_model_dir: Path, prompts_and_expected, tmp_path: Path
) -> None:
    """With ``overlap`` on, a page from the disk at twice the cost of computing it: of the 12
    cached pages the first 8 are computed while the last 4 (a group) load beside them, then the
    prompt's end is computed after both; the output is the computed one. Off (the default), the
    same disk is declined whole."""
    prompts, expected = prompts_and_expected
    _, plain = restarted_over_disk(tiny_model_dir, tmp_path / "plain", prompts[0])
    split_rates(plain, 2.0)
    assert serve(plain, [prompts[1]], first=1) == [expected[1]]
    disk = plain.tiers.stats.tiers["disk"]  # type: ignore[union-attr]
    # not even asked: a page of it loses against computing even the prompt's last page
    assert (disk.overlapped_pages, disk.hit_pages, disk.skipped_lookups) == (0, 0, 1)
    plain.close()
    _, engine = restarted_over_disk(tiny_model_dir, tmp_path, prompts[0], overlap=True)
    split_rates(engine, 2.0)
    engine.add_request("r1", prompts[1], GREEDY)
    (seq,) = engine.scheduler.waiting
    engine.step()  # the head, in one chunk; then the prefix waits for its tail
    assert seq.tail_load is not None and seq.tail_load.head_end == 8 * 16 and len(seq.tail_load.pages) == 4
    assert seq.num_computed == 8 * 16 and seq.num_cached == 0
    assert run_all(engine)["r1"] == expected[1]
    disk = engine.tiers.stats.tiers["disk"]  # type: ignore[union-attr]
    assert (disk.overlapped_pages, disk.hit_pages, disk.declined_pages) == (4, 4, 8)
    assert engine.stats.cached_tokens == 4 * 16 and engine.scheduler.num_tail_tokens == 4 * 16
    assert engine.pages.num_cached_pages >= 12  # the tail's pages are indexed like computed ones
    engine.pages.check_invariants()
    (counts,) = engine.tiers.counts()  # type: ignore[union-attr]
    assert counts.overlapped_pages == 4
    assert counts.saved_seconds > 0  # a third of the 12 pages' time, as estimated when they were split
    engine.close()


def test_a_request_let_go_of_while_its_tail_loads_waits_for_the_load_then_frees_every_page(
    tiny_model_dir: Path, prompts_and_expected, tmp_path: Path
) -> None:
    import threading
    import time

    prompts, _ = prompts_and_expected
    _, engine = restarted_over_disk(tiny_model_dir, tmp_path, prompts[0], overlap=True)
    split_rates(engine, 2.0)
    disk = engine.tiers.groups[0]  # type: ignore[union-attr]
    release = threading.Event()
    get, get_into = disk.get, disk.get_into  # type: ignore[attr-defined]

    def slow_get(key: bytes, *into: memoryview) -> object:
        release.wait(10)
        return get_into(key, *into) if into else get(key)

    disk.get = disk.get_into = slow_get  # type: ignore[method-assign, attr-defined]
    free = engine.pages.num_free_pages
    engine.add_request("r1", prompts[1], GREEDY)
    engine.step()  # the head's first chunk; the tail still loading
    (seq,) = engine.scheduler.waiting
    assert seq.tail_load is not None and not seq.tail_load.future.done()
    threading.Timer(0.3, release.set).start()
    began = time.monotonic()
    assert engine.abort("r1")
    assert time.monotonic() - began >= 0.2  # the pages were written until the load ended
    assert seq.tail_load is None and not engine.has_work()
    engine.pages.check_invariants()
    assert engine.pages.num_free_pages == free
    engine.close()


def test_read_buffers_are_allocated_once_and_lent_from_those() -> None:
    """A rate's measurement allocates every buffer before its clock starts (``allocate``);
    loads then take those same buffers, and none when all are out."""
    buffers = ReadBuffers(1024, 3, pin=False, offset=8)
    every = buffers.allocate()
    assert len(every) == 3 and [id(b) for b in buffers.allocate()] == [id(b) for b in every]
    assert all(b.size == 1024 and b.data.numel() == 1032 for b in every)
    taken = [buffers.take() for _ in range(4)]
    assert taken[3] is None and {id(b) for b in taken[:3]} == {id(b) for b in every}
    buffers.give(every[0])
    assert buffers.free == 1 and buffers.take() is every[0]


def test_a_prefill_s_pages_are_offered_while_its_step_runs_and_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The tiers are offered a prefill's full pages right after its step is launched (their
    snapshot queues on the device behind it: on a GPU the host's part of it runs while the
    device computes, not after the first token), and never again when the step is done; the
    decode steps' pages after them the usual way. What the disk then holds answers a restarted
    engine as the computing one answered."""
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)
    assert engine.tiers is not None
    events: list[tuple[str, int, int]] = []
    offer, collect = engine.tiers.offer, engine.collect

    def offered(hashes: Sequence[bytes], table: Sequence[int], old: int, new: int) -> None:
        events.append(("offer", old, new))
        offer(hashes, table, old, new)

    def collected(launched: Any) -> Any:
        events.append(("collect", len(launched.batch.prefills), 0))
        return collect(launched)

    engine.tiers.offer = offered  # type: ignore[method-assign]
    engine.collect = collected  # type: ignore[method-assign]
    prompt = list(range(5, 205))  # 12 full pages, then 8 tokens
    sampling = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    engine.add_request("r", prompt, sampling)
    out = run_all(engine)["r"]
    assert events[:2] == [("offer", 0, 12), ("collect", 1, 0)]  # before the prefill's tokens were collected
    ranges = [(old, new) for kind, old, new in events if kind == "offer"]
    assert ranges[0] == (0, 12) and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert ranges[-1][1] == (200 + 60 - 1) // 16  # the decode steps' pages after, each offered once
    engine.close()
    restarted = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)
    restarted.add_request("again", prompt, sampling)
    assert run_all(restarted)["again"] == out and restarted.stats.cached_tokens >= 12 * 16
    restarted.close()


def test_a_tier_not_asked_is_asked_again_and_re_timed_at_every_recheck(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A tier whose rate was read in a slow spell is skipped by the rule, and then never asked
    nor read, so nothing would correct it: at every RECHECK_EVERY-th skip in a row it is asked
    anyway (not counted skipped), and a group it holds is timed again on the writer's thread."""
    from pdserve.engine.kv_tiers import RECHECK_EVERY

    engine, tiers, hashes = over_a_slow_disk(tiny_model_dir, tmp_path)
    disk = tiers.stats.tiers["disk"]
    # a page in 100 ms: slower than any real read (at a page a millisecond, a re-timing on a
    # loaded 2-core machine once read 60 MB/s, below it, in a fresh clone's run)
    tiers.estimates.bytes_per_s["disk"] = tiers.pool.page_bytes / 0.1
    slow = tiers.estimates.bytes_per_s["disk"]
    for _ in range(RECHECK_EVERY - 1):
        assert tiers.find(hashes, 0, len(hashes)).num_pages == 0
    assert disk.skipped_lookups == RECHECK_EVERY - 1 and tiers.estimates.bytes_per_s["disk"] == slow
    assert tiers.find(hashes, 0, len(hashes)).num_pages == 12  # asked
    assert disk.skipped_lookups == RECHECK_EVERY - 1
    tiers.drain()  # the writer's thread timed a group
    assert tiers.estimates.bytes_per_s["disk"] > slow
    engine.close()


def test_a_worker_s_engine_thread_offers_a_prefill_s_pages_as_it_launches(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A worker schedules on its event loop and launches and collects on its engine thread:
    the prefill's pages are offered by the launch, on the thread (and so the stream) that
    queued the step, and not again when the step completes on the loop."""
    engine = tiered_engine(tiny_model_dir, disk_dir=str(tmp_path), group_pages=4)
    assert engine.tiers is not None
    offers: list[tuple[int, int, int]] = []
    offer = engine.tiers.offer

    def offered(hashes: Sequence[bytes], table: Sequence[int], old: int, new: int) -> None:
        offers.append((threading.get_ident(), old, new))
        offer(hashes, table, old, new)

    engine.tiers.offer = offered  # type: ignore[method-assign]
    engine.add_request("r", list(range(5, 205)), SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    with ThreadPoolExecutor(1) as thread:
        launcher = thread.submit(threading.get_ident).result()
        assert launcher != threading.get_ident()
        batch = engine.schedule()
        launched = thread.submit(engine.launch, batch).result()
        assert offers == [(launcher, 0, 12)]
        outputs = engine.complete(launched, thread.submit(engine.collect, launched).result())
    assert offers == [(launcher, 0, 12)] and [len(o.token_ids) for o in outputs] == [1]
    engine.close()


def test_groups_a_lookup_found_in_a_tier_are_not_snapshotted_for_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A worker that found a prefix's groups in a tier (a second worker on a shared store) and
    computed them anyway does not copy them off the device for that tier again; a group found
    missing when loaded (gone, or corrupt and removed) is written again."""
    prompt = list(range(5, 205))
    # every tier asked whatever the rule would make of this machine's rates (on a loaded CI
    # runner the rule once judged the disk not worth asking, and the lookup found nothing)
    _, second = restarted_over_disk(tiny_model_dir, tmp_path, prompt, load="always")
    tiers = second.tiers
    assert tiers is not None
    hashes = page_hashes(prompt, 16)
    plan = tiers.find(hashes, 0, len(hashes))
    assert plan.num_pages == 12 and all("disk" in tiers._written[hashes[e - 1]] for e in (4, 8, 12))
    assert tiers.estimates.call_seconds["disk"] > 0.0  # the lookup's round trip, a load's fixed part
    queued: list[int] = []
    enqueue = tiers._enqueue
    tiers._enqueue = lambda groups: (queued.append(len(groups)), enqueue(groups))[1]  # type: ignore[method-assign]
    tiers.offer(hashes, list(range(12)), 0, 12)
    assert sum(queued) == 0
    for f in Path(tmp_path).rglob("*.kv"):
        f.unlink()  # gone before the load
    assert tiers.load(plan, list(range(12))) == 0
    assert "disk" not in tiers._written[hashes[3]]
    tiers.offer(hashes, list(range(12)), 0, 12)
    assert sum(queued) == 1  # the first group again (the others stay marked as held)
    second.close()
