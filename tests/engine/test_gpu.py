"""On a CUDA device: graph-replayed decoding against eager decoding, and pdserve's fast
path against ``transformers`` in float32 at Qwen2.5-7B dimensions. ``make test-gpu``."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch

from pdserve.bench.shapes import QWEN2_5_7B
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.schemas import SamplingParams
from tests.engine.handoff import mooncake_pair, pull
from tests.engine.reference import assert_greedy_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def build(dims: dict, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    quiet_transformers()
    torch.manual_seed(seed)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(Qwen2Config(**dims), dtype=dtype, attn_implementation="sdpa").eval()


def run(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    tag = str(random.random())
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    outs: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
    return [outs[f"{tag}{i}"] for i in range(len(prompts))]


def engine_for(model: torch.nn.Module, graphs: int, tokens: int = 16384) -> Engine:
    config = EngineConfig(device="cuda", max_total_tokens=tokens, cuda_graph_max_batch=graphs, max_num_seqs=64)
    runner = ModelRunner(ModelSpec(Path("m")), config, model=model)
    assert runner.model_impl == "pdserve"
    assert (runner.graphs is not None) == (graphs > 0)
    return Engine(runner, config)


SMALL = dict(QWEN2_5_7B, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8)
SMALL.update(num_key_value_heads=2, vocab_size=5000)


@pytest.mark.parametrize(("dtype", "sizes"), [(torch.bfloat16, (1, 8)), (torch.float32, (3, 17))])
def test_graph_replay_equals_eager_decoding(dtype: torch.dtype, sizes: tuple[int, ...]) -> None:
    """bf16 at bucket sizes (the same kernels run); float32 also at padded sizes."""
    model = build(SMALL, dtype)
    graphed, eager = engine_for(model, 32), engine_for(model, 0)
    rng = random.Random(5)
    for n in sizes:
        prompts = [[rng.randrange(5000) for _ in range(rng.randint(5, 300))] for _ in range(n)]
        assert run(graphed, prompts, 40) == run(eager, prompts, 40), n


def test_speculative_verifies_replay_as_graphs_with_the_tokens_of_plain_decoding() -> None:
    """float32: with n-gram speculation the verifies replay as graphs of decode rows (K/V
    stored first) and the greedy tokens are those of plain graph-replayed decoding."""
    model = build(SMALL, torch.float32)
    rng = random.Random(7)
    prompts = [[rng.randrange(5000) for _ in range(16)] * 4 for _ in range(3)]
    prompts += [[rng.randrange(5000) for _ in range(rng.randint(5, 200))] for _ in range(5)]
    plain = run(engine_for(model, 32), prompts, 40)
    config = EngineConfig(
        device="cuda",
        max_total_tokens=16384,
        cuda_graph_max_batch=32,
        max_num_seqs=64,
        speculative_algorithm="ngram",
        speculative_cost_ratio=0.0,
    )
    runner = ModelRunner(ModelSpec(Path("m")), config, model=model)
    assert runner.verify_graphs is not None and runner.verify_as_rows
    engine = Engine(runner, config)
    assert run(engine, prompts, 40) == plain
    assert engine.stats.spec is not None and engine.stats.spec.accepted > 0
    assert runner.verify_paths["graph"] > 0 and runner.verify_paths["chunks"] == 0


@pytest.mark.parametrize("option", ["pdl", "l2_prefetch"])
def test_batch_one_options_decode_the_same_tokens(option: str) -> None:
    """Programmatic dependent launches and the L2 prefetch change when kernels start, not
    what they compute: replayed single-sequence decoding is the same token for token."""
    from pdserve.engine.cuda_graph import DecodeGraphs

    model = build(SMALL, torch.bfloat16)
    plain, other = engine_for(model, 8), engine_for(model, 8)
    runner = other.runner
    assert runner.fast is not None and runner.graphs is not None
    setattr(runner.fast, option, True)
    old = runner.graphs
    runner.graphs = DecodeGraphs(
        runner.fast.forward, old.max_batch, old._tables.shape[1], old.page_size, old.scratch_page, old.splits_for,
        runner.device,
    )  # fmt: skip
    runner.graphs.capture()
    rng = random.Random(11)
    for _ in range(3):
        prompt = [[rng.randrange(5000) for _ in range(rng.randint(5, 300))]]
        assert run(other, prompt, 40) == run(plain, prompt, 40)


def test_float32_greedy_equals_transformers_at_7b_dimensions() -> None:
    model = build(QWEN2_5_7B, torch.float32)
    rng = random.Random(7)
    prompts = [[rng.randrange(100_000) for _ in range(n)] for n in (7, 130, 511)]
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(p) :].tolist())
    assert_greedy_equal(model, prompts, run(engine_for(model, 8, tokens=4096), prompts, 24), expected)


def test_prompt_logprobs_and_min_new_tokens_on_the_fast_path() -> None:
    """float32, CUDA graphs and the overlap on: a prompt scored over prefill chunks of 64 (the
    rows past the last layer beside the sampled ones) equals ``transformers``' log-softmax; a
    stop token held off by ``min_new_tokens`` as ``generate`` holds it off."""
    model = build(SMALL, torch.float32)
    config = EngineConfig(device="cuda", max_total_tokens=16384, cuda_graph_max_batch=8, chunked_prefill_size=64)
    engine = Engine(ModelRunner(ModelSpec(Path("m")), config, model=model), config)
    assert engine.overlap
    rng = random.Random(13)
    prompts = [[rng.randrange(5000) for _ in range(n)] for n in (3, 100, 300)]
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, SamplingParams(max_new_tokens=20, temperature=0.0, prompt_logprobs=3))
    scores = {}
    while engine.has_work():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                scores[o.rid] = o.prompt_logprobs
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            ref = torch.log_softmax(model(torch.tensor([p], device="cuda")).logits[0].float(), dim=-1).cpu()
            want = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])]
            assert torch.allclose(torch.tensor(scores[f"s{i}"].logprobs), want, atol=2e-3), i
            assert torch.equal(torch.tensor(scores[f"s{i}"].top_ids).view(-1, 3), ref[:-1].topk(3).indices), i
        p = prompts[1]
        free = run(engine, [p], 12)[0]
        stop = free[0]
        params = SamplingParams(max_new_tokens=12, min_new_tokens=5, temperature=0.0, stop_token_ids=(stop,))
        engine.add_request("floor", p, params)
        got: list[int] = []
        while engine.has_work():
            got += [t for o in engine.step() for t in o.token_ids]
        g = model.generate(
            torch.tensor([p], device="cuda"), max_new_tokens=12, min_new_tokens=5, do_sample=False,
            eos_token_id=[stop], pad_token_id=0,
        )[0, len(p) :].tolist()  # fmt: skip
    assert got == g and stop not in got[:5]


def test_kv_tiers_on_the_gpu_serve_evicted_prefixes_with_equal_output(tmp_path: Path) -> None:
    """Host slots (pinned, copies on the stream) and disk files (snapshots behind an event)
    under the fast path with overlap: hits from either equal a run without tiers."""
    from pdserve.engine.config import KVTierConfig

    model = build(SMALL, torch.float32)

    def tiered(tiers: KVTierConfig, tokens: int = 512) -> Engine:
        config = EngineConfig(device="cuda", max_total_tokens=tokens, max_num_seqs=8, kv_tiers=tiers)
        return Engine(ModelRunner(ModelSpec(Path("m")), config, model=model), config)

    rng = random.Random(9)
    base = [rng.randrange(5000) for _ in range(300)]
    fillers = [[rng.randrange(5000) for _ in range(320)] for _ in range(2)]
    prompts = [base, *fillers, base + [1, 2, 3]]
    reference = [run(engine_for(model, 0), [p], 12)[0] for p in prompts]
    disk = KVTierConfig(disk_dir=str(tmp_path), group_pages=4, load="always")
    engine = tiered(KVTierConfig(host_bytes=64 << 20, disk_dir=str(tmp_path), group_pages=4, load="always"))
    assert [run(engine, [p], 12)[0] for p in prompts] == reference
    assert engine.tiers is not None and engine.tiers.stats.tiers["host"].hit_pages >= 300 // 16 - 2
    assert engine.tiers.stats.snapshot_allocations == 0  # the snapshots pinned at start sufficed
    engine.close()
    restarted = tiered(disk)
    assert run(restarted, [prompts[-1]], 12)[0] == reference[-1]
    assert restarted.tiers is not None and restarted.tiers.stats.tiers["disk"].hit_pages == 300 // 16 // 4 * 4
    restarted.close()


def test_kv_tiers_copies_queued_off_the_engine_thread_run_on_the_steps_stream(tmp_path: Path) -> None:
    """A worker schedules and postprocesses on its event loop and launches on its engine
    thread, whose stream is its own in a co-located prefill. The tiers' device work queued
    from the loop (host-memory demotions and loads while scheduling, write snapshots after a
    step) goes on the steps' stream, ordered with them: here the loop thread's own stream is
    held busy before each step, and copies queued on it would land after the steps that read
    or overwrite their pages."""
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.engine.config import KVTierConfig

    model = build(SMALL, torch.float32)
    rng = random.Random(11)
    base = [rng.randrange(5000) for _ in range(300)]
    prompts = [base, *([rng.randrange(5000) for _ in range(320)] for _ in range(2)), base + [1, 2, 3]]
    reference = [run(engine_for(model, 0), [p], 12)[0] for p in prompts]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

    def own_stream() -> torch.cuda.Stream:
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
        return stream

    def make() -> Engine:
        tiers = KVTierConfig(host_bytes=64 << 20, disk_dir=str(tmp_path), group_pages=4, load="always")
        config = EngineConfig(device="cuda", max_total_tokens=512, max_num_seqs=8, kv_tiers=tiers)
        return Engine(ModelRunner(ModelSpec(Path("m")), config, model=model), config)

    with ThreadPoolExecutor(1) as thread:
        stream = thread.submit(own_stream).result()
        engine = thread.submit(make).result()
        assert engine.stream == stream and torch.cuda.current_stream() != stream
        got = []
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
            tokens: list[int] = []
            while engine.has_work():
                torch.cuda._sleep(20_000_000)  # this thread's stream busy for ~10 ms
                batch = engine.schedule()
                launched = thread.submit(engine.launch, batch).result()
                result = thread.submit(engine.collect, launched).result()
                tokens += [t for o in engine.complete(launched, result) for t in o.token_ids]
            got.append(tokens)
        torch.cuda.synchronize()
    assert got == reference
    assert engine.tiers is not None and engine.tiers.stats.tiers["host"].hit_pages >= 300 // 16 - 2
    engine.close()


def test_a_kv_tier_write_s_snapshot_does_not_make_the_host_wait_for_the_device(tmp_path: Path) -> None:
    """A step's group snapshots are queued, their page index included: built from pageable memory the
    index's copy waited until all the work queued before it had run, holding the step of a
    first process's prompt until its whole prefill was done (1.6x a cold one at 2,048 tokens
    on an H100, 2026-12-05). CUDA's sync check raises on that old way and not on this one."""
    from pdserve.engine.config import KVTierConfig
    from pdserve.engine.kv_pool import page_index

    model = build(SMALL, torch.float32)
    tiers = KVTierConfig(disk_dir=str(tmp_path), group_pages=4, load="always")
    config = EngineConfig(device="cuda", max_total_tokens=512, max_num_seqs=8, kv_tiers=tiers)
    engine = Engine(ModelRunner(ModelSpec(Path("m")), config, model=model), config)
    run(engine, [list(range(5, 105))], 4)
    assert engine.tiers is not None
    engine.tiers.drain()
    written = engine.tiers.stats.tiers["disk"].stored_pages
    queued: list[object] = []
    put = engine.tiers._queue.put_nowait
    engine.tiers._queue.put_nowait = queued.append  # type: ignore[method-assign]  # the writer waits outside the check
    try:
        with warnings.catch_warnings():  # "a prototype feature" (a UserWarning, an error under pytest's filters)
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.tensor([1, 2, 3], device="cuda")
        assert page_index([1, 2, 3], torch.device("cuda")).device.type == "cuda"
        engine.tiers._enqueue(
            [(bytes(range(16)), [0, 1, 2, 3], ("disk",)), (bytes(range(1, 17)), [4, 5, 6, 7], ("disk",))]
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
        engine.tiers._queue.put_nowait = put  # type: ignore[method-assign]
    assert len(queued) == 2, "a group each, from one gather"
    for item in queued:
        put(item)  # type: ignore[arg-type]
    engine.tiers.drain()
    assert engine.tiers.stats.tiers["disk"].stored_pages == written + 8 and engine.tiers.stats.write_errors == 0
    engine.close()


def test_the_kv_tiers_recompute_rate_on_the_gpu_is_each_prefill_chunk_s_device_time(tmp_path: Path) -> None:
    """A prompt of four equal chunks at 7B layer widths: each chunk is a reading of the cost
    rule's recompute rate, timed on the device. A chunk that samples no token returns before
    the device has run it: timed on the host, the first three read their launches alone and the
    last the whole prompt (which made a disk 2x faster than computing look slower on an H200)."""
    import time

    from pdserve.engine.config import KVTierConfig

    model = build(dict(QWEN2_5_7B, num_hidden_layers=4), torch.bfloat16)
    config = EngineConfig(
        device="cuda", max_total_tokens=8192, chunked_prefill_size=1024, kv_tiers=KVTierConfig(disk_dir=str(tmp_path))
    )
    engine = Engine(ModelRunner(ModelSpec(Path("m")), config, model=model), config)
    assert engine.tiers is not None
    rng = random.Random(3)
    prompts = [[rng.randrange(100_000) for _ in range(4096)] for _ in range(2)]
    run(engine, prompts[:1], 1)  # compiles the kernels of a chunk after others (0.9 s on an H200)
    readings = engine.tiers.estimates.prefill_readings
    readings.clear()
    torch.cuda.synchronize()
    began = time.perf_counter()
    run(engine, prompts[1:], 1)
    wall = time.perf_counter() - began
    assert [t for t, _, _ in readings] == [1024] * 4
    seconds = [s for _, s, _ in readings]
    assert max(seconds) < 2.5 * min(seconds), seconds
    assert 0.3 * wall < sum(seconds) <= wall
    engine.close()


def test_pd_handoff_between_gpu_pools_over_mooncake_equals_one_engine() -> None:
    """Two pools in GPU memory registered with Mooncake's CUDA build (TCP on loopback): the
    prefill engine holds each prompt's KV, the decode engine pulls it with one batched read
    into its own pages and decodes what one engine decodes alone, token for token."""
    pytest.importorskip("mooncake.engine", reason="needs Mooncake's CUDA build (mooncake-transfer-engine)")
    prefill, decode, alone = (engine_for(build(SMALL, torch.bfloat16), graphs=8) for _ in range(3))
    assert prefill.runner.pool.tensor.is_cuda and decode.runner.pool.tensor.is_cuda
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 5000) for _ in range(n)] for n in (5, 40, 300)]
    expected = run(alone, prompts, 12)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with mooncake_pair(prefill, decode) as ends:
        for i, p in enumerate(prompts):
            prefill.add_request(f"r{i}", p, params, prefill_only=True)
        firsts = {}
        while prefill.has_work():
            firsts.update({o.rid: o for o in prefill.step()})
        for i, p in enumerate(prompts):
            pull(ends, prefill, decode, f"r{i}", p, firsts[f"r{i}"].token_ids, params)
        outs: dict[str, list[int]] = {}
        while decode.has_work():
            for o in decode.step():
                outs.setdefault(o.rid, []).extend(o.token_ids)
        assert [firsts[f"r{i}"].token_ids + outs[f"r{i}"] for i in range(len(prompts))] == expected


def test_split_k_gemvs_on_two_streams_at_once_each_sum_their_own_parts() -> None:
    """The two engines of a co-located process launch split-K GEMVs on two streams at once:
    each stream has its own counters (sharing one set summed row blocks before their parts
    were in: a co-located FP8 pair once failed with garbage token ids)."""
    from pdserve.engine.kernels import gemv

    torch.manual_seed(0)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    xs = [torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16) for _ in streams]
    w = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    refs = [(x.float() @ w.float().T) for x in xs]
    outs: list[list[torch.Tensor]] = [[], []]
    for stream in streams:  # counters for each stream, before the race
        with torch.cuda.stream(stream):
            gemv.reserve_counters("cuda")
    torch.cuda.synchronize()
    for _ in range(50):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[i].append(gemv.gemv(xs[i], w, block_n=8, block_k=256, split_k=4))
    torch.cuda.synchronize()
    assert len({k for k in gemv._COUNTERS if k[0] == "cuda"}) >= 2  # a set per stream
    for i in range(2):
        for out in outs[i]:
            err = (out.float() - refs[i]).abs().max() / refs[i].abs().max()
            assert err < 2e-2, (i, float(err))
