"""pdserve's own forward pass (fused projections, Triton kernels) against ``transformers``.

On the CPU the kernels run in Triton's interpreter, so the model is small and the work
short; float32 throughout, so greedy output must equal ``generate`` token for token.
On a GPU the same tests run compiled (and ``tests/engine/test_gpu.py`` adds graphs);
there a float32 near tie may go either way (``tests/engine/reference.py``).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.bench import shapes
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.schemas import SamplingParams
from tests.engine.kernel_env import DEVICE, llama
from tests.engine.reference import assert_greedy_equal, hf_greedy, run

NEW = 6


def small_model(kind: str) -> torch.nn.Module:
    return shapes.small_model(kind, DEVICE)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("kind", "fused_merge"),
    [
        ("qwen2", False),
        ("llama", False),
        ("qwen3", False),
        ("llama3-rope", False),
        ("qwen2", True),
        # the default model's dimensions: 9 heads over 3 KV heads of 64, tied embeddings, 30
        # layers (2 in Triton's interpreter on the CPU, where 30 take many minutes)
        ("smollm2" if DEVICE.type == "cuda" else "smollm2-2l", False),
    ],
)
def test_fast_path_greedy_equals_transformers(kind: str, fused_merge: bool) -> None:
    quiet_transformers()
    model = small_model(kind)
    rng = random.Random(kind)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 23, 40)]
    prompts.append(prompts[2][:32] + [1, 2, 3])  # a cached prefix of two full pages
    # The cached prefix's request runs alone, so its decode steps are batch-1 GEMV steps:
    # interpreted at the default model's width (576) each takes seconds. Two tokens (one such
    # step) test the cached prefix and the GEMVs as six would (no page boundary is crossed).
    alone = 2 if kind == "smollm2-2l" else NEW
    expected = hf_greedy(model, prompts[:3], NEW) + hf_greedy(model, prompts[3:], alone)
    # small chunks: prompts are computed in pieces over a cached or earlier prefix
    config = EngineConfig(
        device=str(DEVICE), max_total_tokens=1024, model_impl="pdserve", chunked_prefill_size=16, cuda_graph_max_batch=0
    )
    runner = ModelRunner(ModelSpec(Path(kind)), config, model=model)
    assert runner.model_impl == "pdserve" and isinstance(runner.fast, llama.LlamaFamily)
    runner.fast.fused_merge = fused_merge
    engine = Engine(runner, config)
    ours = run(engine, prompts[:3], NEW) + run(engine, prompts[3:], alone)
    assert_greedy_equal(model, prompts, ours, expected)
    assert engine.stats.cached_tokens >= 32
    # the stock modules still work on views of the fused weights
    assert hf_greedy(model, prompts[:1], NEW) == expected[:1]


def test_decode_warm_up_leaves_the_pool_and_the_output_alone() -> None:
    quiet_transformers()
    model = small_model("qwen2")
    config = EngineConfig(device=str(DEVICE), max_total_tokens=256, model_impl="pdserve", cuda_graph_max_batch=0)
    runner = ModelRunner(ModelSpec(Path("w")), config, model=model)
    assert runner.fast is not None
    prompts = [[5, 9, 11, 200, 7]]
    engine = Engine(runner, config)
    first = run(engine, prompts, NEW)
    pool = runner.pool.tensor.clone()
    runner.fast.warm_up_decode([1, 2, 4])
    assert torch.equal(runner.pool.tensor, pool)
    assert run(engine, prompts, NEW) == first


def test_prefill_warm_ups_run_each_row_tile_and_length_and_leave_the_pool_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The paged prefill kernel once per row tile; a whole prompt's attention once per length
    it is padded to (:func:`sdpa_lengths`); neither touches the pool or what is served after."""
    import torch.nn.functional as F

    from pdserve.engine.kernels import paged_prefill
    from pdserve.engine.models import llama as fast

    quiet_transformers()
    model = small_model("qwen2")
    config = EngineConfig(device=str(DEVICE), max_total_tokens=256, model_impl="pdserve", cuda_graph_max_batch=0)
    runner = ModelRunner(ModelSpec(Path("w")), config, model=model)
    assert runner.fast is not None
    engine = Engine(runner, config)
    prompts = [[5, 9, 11, 200, 7]]
    first = run(engine, prompts, NEW)
    pool = runner.pool.tensor.clone()
    seen: list[int] = []
    real = paged_prefill.prefill_attention

    def spy(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(int(args[6]))  # type: ignore[call-overload]  # max_q_len
        out = real(q, *args, **kwargs)  # type: ignore[arg-type]
        assert torch.isfinite(out).all()
        return out

    monkeypatch.setattr(paged_prefill, "prefill_attention", spy)
    runner.fast.warm_up_prefill()
    assert sorted(seen) == [1, paged_prefill.SHORT_CHUNK + 1]  # both row tiles of the kernel
    met: list[int] = []
    library = F.scaled_dot_product_attention

    def sdpa(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        met.append(q.shape[2])
        out = library(q, *args, **kwargs)
        assert torch.isfinite(out).all()
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    runner.fast.warm_up_sdpa(300)
    assert met == fast.sdpa_lengths(300) == [64, 128, 192, 256, 320]
    assert torch.equal(runner.pool.tensor, pool)
    assert run(engine, prompts, NEW) == first


def test_whole_prompts_attend_at_few_lengths_and_the_padding_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole prompt's attention (the GPU's ``sdpa_prefill``) runs at :func:`sdpa_length`'s
    lengths only (cuDNN's attention builds a graph for each shape it meets first), and the
    rows it pads with change none of the prompt's: equal to the
    unpadded attention for prompts at, below and above a length, queries grouped over keys."""
    import torch.nn.functional as F

    from pdserve.engine.models import llama as fast

    lengths = fast.sdpa_lengths(2048)
    assert len(lengths) == 24 and lengths == sorted({fast.sdpa_length(n) for n in range(1, 2049)})
    for n in range(1, 9000):
        length = fast.sdpa_length(n)
        assert n <= length < n + (64 if n <= 1024 else n / 8) and fast.sdpa_length(length) == length
    met: list[tuple[int, int]] = []
    real = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        met.append((q.shape[2], q.data_ptr()))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(3)
    num_q, num_kv, dim = 4, 2, 16
    rows_at = []
    for n, extra in ((1, 0), (5, 0), (64, 0), (64, 8), (65, 0), (130, 8), (513, 0)):
        qkv = torch.randn(n, (num_q + 2 * num_kv) * dim + extra, generator=gen)  # a step's rows (or wider)
        rows_at.append(qkv.data_ptr())
        q = qkv[:, : num_q * dim].view(n, num_q, dim)
        k = qkv[:, num_q * dim : (num_q + num_kv) * dim].view(n, num_kv, dim)
        v = qkv[:, (num_q + num_kv) * dim : (num_q + 2 * num_kv) * dim].view(n, num_kv, dim)
        got = fast.causal_sdpa(qkv[:, : (num_q + 2 * num_kv) * dim], num_q, num_kv, dim, 0.25)
        want = real(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=0.25, enable_gqa=True,
        )  # fmt: skip
        assert got.shape == (1, num_q, n, dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert [length for length, _ in met] == [64, 64, 64, 64, 128, 192, 576]
    # read in place only where the prompt is a length's own and its q, k, v a step's rows
    assert [at == rows for (_, at), rows in zip(met, rows_at, strict=True)] == [False, False, True] + [False] * 4


def test_auto_keeps_transformers_for_unknown_architectures_and_pdserve_refuses_them() -> None:
    from transformers import GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with DEVICE:
        gpt2 = gpt2.to(DEVICE)
    auto = EngineConfig(device=str(DEVICE), max_total_tokens=256, model_impl="auto")
    runner = ModelRunner(ModelSpec(Path("g")), auto, gpt2)
    assert runner.model_impl == "transformers" and runner.fast is None
    config = EngineConfig(device=str(DEVICE), max_total_tokens=256, model_impl="pdserve")
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no fast path"):
        ModelRunner(ModelSpec(Path("g")), config, gpt2)


def collect_all(engine: Engine, requests: list[tuple[list[int], SamplingParams]], abort: str | None = None) -> dict:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    steps = 0
    while engine.has_work():
        steps += 1
        if abort is not None and steps == 6:
            assert engine.abort(abort)
        for o in engine.step():
            assert o.index == len(outs.get(o.rid, [])), "a token out of order"
            outs.setdefault(o.rid, []).extend(o.token_ids)
            reasons[o.rid] = o.finish_reason
    engine.pages.check_invariants()
    assert engine.pages.num_used_pages == 0
    return {"tokens": outs, "reasons": reasons}


def test_a_priority_preemption_of_a_row_with_a_token_on_the_device_changes_no_output() -> None:
    """Overlap on: a request of a higher priority takes the seat of a running one whose next
    token is still on the device (its step left queued); every output, the preempted one's
    too, is what plain steps of the same requests without priorities give."""
    model = small_model("qwen2")
    rng = random.Random(5)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(17, 30))] for _ in range(3)]
    greedy = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    results = []
    for overlap in (False, True):
        config = EngineConfig(
            device=str(DEVICE),
            max_total_tokens=4096,
            model_impl="pdserve",
            overlap_schedule=overlap,
            cuda_graph_max_batch=0,
            max_num_seqs=2,
        )
        engine = Engine(ModelRunner(ModelSpec(Path("m")), config, model=model), config)
        assert engine.overlap is overlap and engine.runner.fast is not None
        engine.runner.fast.use_gemv = False  # interpreted, it is slow; the greedy tests cover it
        urgent = dataclasses.replace(greedy, priority=-1 if overlap else 0)
        pending: list[int] = []  # each preempted row's tokens still on the device then

        def noted(seq: Any, preempt: Any = engine.scheduler.preempt, pending: list[int] = pending) -> None:
            pending.append(seq.num_pending)
            preempt(seq)

        engine.scheduler.preempt = noted  # type: ignore[method-assign]
        for i in range(2):
            engine.add_request(str(i), prompts[i], greedy)
        outs: dict[str, list[int]] = {}
        for step in range(40):
            if step == 4:
                engine.add_request("2", prompts[2], urgent)
            if not engine.has_work() and step > 4:
                break
            for o in engine.step():
                outs.setdefault(o.rid, []).extend(o.token_ids)
        assert not engine.has_work()
        engine.pages.check_invariants()
        assert (engine.scheduler.num_priority_preemptions == 1) is overlap
        assert pending == ([1] if overlap else [])
        results.append(outs)
    plain, preempted = results
    assert preempted == plain and all(len(t) == 14 for t in plain.values())


def test_overlapped_steps_equal_plain_steps() -> None:
    """Scheduling the next decode step before the current one's tokens are read changes
    nothing: greedy, seeded sampling, stop tokens, length limits, preemption with a token
    still on the device, prefix reuse after it, an abort. The reference: plain steps in a
    pool large enough that nothing is preempted."""
    model = small_model("qwen2")
    rng = random.Random(3)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(17, 30))] for _ in range(6)]
    params = [
        SamplingParams(max_new_tokens=18, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=18, temperature=1.0, seed=5, stop_token_ids=(7, 8, 9, 10, 11, 12)),
        SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=17, temperature=0.7, top_k=20, seed=2, ignore_eos=True),
    ]
    requests = list(zip(prompts, params, strict=True))
    results = []
    for overlap, tokens in ((False, 4096), (False, 80), (True, 80)):
        # 5 pages of 16 tokens: running sequences outgrow the pool and are preempted
        config = EngineConfig(
            device=str(DEVICE),
            max_total_tokens=tokens,
            model_impl="pdserve",
            overlap_schedule=overlap,
            cuda_graph_max_batch=0,
            chunked_prefill_size=32,
        )
        engine = Engine(ModelRunner(ModelSpec(Path("m")), config, model=model), config)
        assert engine.overlap is overlap and engine.runner.fast is not None
        engine.runner.fast.use_gemv = False  # interpreted, it is slow; the greedy tests cover it
        results.append(collect_all(engine, requests, abort=None if tokens == 4096 else "4"))
        assert (engine.scheduler.num_preemptions > 0) is (tokens == 80)
        assert (engine.stats.overlapped_steps > 0) is overlap
        assert engine.stats.history_unoverlapped_steps == 0  # no row reads its history here
    reference, plain, overlapped = results
    for result in (plain, overlapped):
        cut = result["tokens"].pop("4", [])  # aborted part way: what it got is the reference's start
        assert cut == reference["tokens"]["4"][: len(cut)]
        assert result["reasons"].pop("4", None) is None
    reference["tokens"].pop("4")
    reference["reasons"].pop("4")
    assert plain == reference
    assert overlapped == reference
    assert reference["reasons"]["2"] == "length" and len(reference["tokens"]["2"]) == 1


def test_speculation_keeps_the_overlap_unless_a_draft_is_due() -> None:
    """With speculation on, steps still overlap: a step is left queued on the device unless a
    sequence in it is due to draft after it (the draft needs its last token on the host).
    Where drafts never pay (a cost ratio no acceptance beats) every decode step overlaps and
    nothing is verified; where every match drafts, the steps before the verifies are not left
    queued and counted. Greedy tokens equal ``generate``'s either way."""
    quiet_transformers()
    model = small_model("qwen2")
    rng = random.Random("overlap")
    prompts = [[rng.randrange(300) for _ in range(8)] * 3, [rng.randrange(300) for _ in range(16)]]
    expected = hf_greedy(model, prompts, 8)
    for ratio in (100.0, 0.0):
        config = EngineConfig(
            device=str(DEVICE),
            max_total_tokens=1024,
            model_impl="pdserve",
            cuda_graph_max_batch=0,
            speculative_algorithm="ngram",
            speculative_cost_ratio=ratio,
        )
        runner = ModelRunner(ModelSpec(Path("overlap")), config, model=model)
        assert runner.fast is not None
        runner.fast.use_gemv = False  # interpreted, it is slow; the greedy tests cover it
        engine = Engine(runner, config)
        assert engine.overlap and engine.speculator is not None
        ours = run(engine, prompts, 8)
        assert_greedy_equal(model, prompts, ours, expected)
        spec = engine.stats.spec
        assert spec is not None
        if ratio:
            assert engine.stats.overlapped_steps > 0 and spec.verifies == spec.unoverlapped_steps == 0
        else:
            assert spec.verifies > 0 and spec.accepted > 0 and spec.unoverlapped_steps > 0


def test_speculative_verifies_run_as_decode_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of decodes and verifies runs as decode rows (each draft token a row over its own
    prefix, K/V stored first): what the GPU's verify graphs replay. Greedy tokens equal
    ``generate``'s, drafts were verified that way and never as prefill chunks, and every layer
    of such a step stored its rows' K/V before attending (the interpreter runs programs one
    after another, so a row reading a K/V another program has yet to store would pass here)."""
    quiet_transformers()
    model = small_model("qwen2")
    rng = random.Random("rows")
    prompts = [[rng.randrange(300) for _ in range(12)] * 3, [rng.randrange(300) for _ in range(20)]]
    expected = hf_greedy(model, prompts, 10)
    config = EngineConfig(
        device=str(DEVICE),
        max_total_tokens=1024,
        model_impl="pdserve",
        cuda_graph_max_batch=0,
        speculative_algorithm="ngram",
        speculative_cost_ratio=0.0,  # draft whenever there is a match
    )
    runner = ModelRunner(ModelSpec(Path("rows")), config, model=model)
    assert isinstance(runner.fast, llama.LlamaFamily)
    runner.verify_as_rows = True  # the GPU's default
    engine = Engine(runner, config)
    kinds: list[bool] = []  # each forward pass: rows of one sequence side by side?
    stores: list[bool] = []  # each separate K/V store: in such a pass?
    forward, store = runner.fast.forward, llama.rope.rope_store

    def tracked_forward(step: Any) -> torch.Tensor:
        kinds.append(step.kv_first)
        return forward(step)

    def tracked_store(*args: Any, **kwargs: Any) -> None:
        stores.append(kinds[-1])
        store(*args, **kwargs)

    monkeypatch.setattr(runner.fast, "forward", tracked_forward)
    monkeypatch.setattr(llama.rope, "rope_store", tracked_store)
    ours = run(engine, prompts, 10)
    assert kinds.count(True) == runner.verify_paths["rows"] > 0
    assert stores.count(True) == kinds.count(True) * len(runner.fast.layers)
    assert_greedy_equal(model, prompts, ours, expected)
    spec = engine.stats.spec
    assert spec is not None and spec.verifies > 0 and spec.accepted > 0
    assert runner.verify_paths["rows"] > 0 and runner.verify_paths["chunks"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32])
def test_prefixed_sdpa_attends_as_the_paged_prefill_kernel(dtype: torch.dtype) -> None:
    """A chunk after a prefix, over its pages gathered (flash attention in 16 bits on a GPU),
    equals the paged prefill kernel's output for it: query heads grouped over key heads, a
    context that ends inside a page, pages out of order."""
    from pdserve.engine.attention import page_rows
    from pdserve.engine.kernels import paged_prefill

    gen = torch.Generator().manual_seed(5)
    pages, layers, kv_heads, page, dim, heads = 12, 2, 2, 16, 64, 4
    pool = torch.randn((pages, layers, 2, kv_heads, page, dim), generator=gen).to(DEVICE, dtype)
    table = torch.tensor([[7, 2, 9, 0, 5]], dtype=torch.int32, device=DEVICE)
    for n, ctx in ((40, 75), (75 - 64, 75), (16, 80)):
        q = torch.randn((n, heads, dim), generator=gen).to(DEVICE, dtype)
        want = torch.zeros_like(q)
        lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
        for layer in range(layers):
            paged_prefill.prefill_attention(
                q, pool, layer, table, torch.zeros(1, dtype=torch.int32, device=DEVICE), lens,
                torch.tensor([ctx], dtype=torch.int32, device=DEVICE), n, 0.125, want,
            )  # fmt: skip
            rows = page_rows(pool, table[:, : -(-ctx // page)].long())
            got = llama.prefixed_sdpa(q, pool, layer, rows, ctx, 0.125)
            assert got.shape == (1, heads, n, dim)
            tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
            torch.testing.assert_close(got[0].transpose(0, 1), want, **tol)


def test_long_chunks_after_a_prefix_take_the_gathered_attention_and_equal_transformers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of at least ``prefixed_sdpa_rows`` rows after a cached or earlier prefix attend
    through :func:`llama.prefixed_sdpa`, shorter ones (and fresh ones) through the paged
    kernel, in the same step where both come: greedy output equal to transformers'."""
    from pdserve.engine.kernels import paged_prefill

    quiet_transformers()
    model = small_model("qwen2")
    rng = random.Random(11)
    first = [rng.randrange(300) for _ in range(40)]
    prompts = [first, first[:32] + [rng.randrange(300) for _ in range(30)]]
    expected = hf_greedy(model, prompts, NEW)
    config = EngineConfig(
        device=str(DEVICE), max_total_tokens=1024, model_impl="pdserve", chunked_prefill_size=24, cuda_graph_max_batch=0
    )
    runner = ModelRunner(ModelSpec(Path("w")), config, model=model)
    assert isinstance(runner.fast, llama.LlamaFamily)
    assert runner.fast.prefixed_sdpa_rows == (llama.PREFIXED_SDPA_ROWS if DEVICE.type == "cuda" else 0)
    runner.fast.prefixed_sdpa_rows = 12
    gathered: list[tuple[int, int]] = []
    paged: list[int] = []
    real_gathered, real_paged = llama.prefixed_sdpa, paged_prefill.prefill_attention

    def spy_gathered(q: torch.Tensor, *args: Any) -> torch.Tensor:
        gathered.append((q.shape[0], args[3]))  # rows, context
        return real_gathered(q, *args)

    def spy_paged(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        paged.append(int(args[6]))  # max_q_len
        return real_paged(q, *args, **kwargs)

    monkeypatch.setattr(llama, "prefixed_sdpa", spy_gathered)
    monkeypatch.setattr(paged_prefill, "prefill_attention", spy_paged)
    engine = Engine(runner, config)
    ours = run(engine, prompts[:1], NEW) + run(engine, prompts[1:], NEW)
    assert_greedy_equal(model, prompts, ours, expected)
    assert engine.stats.cached_tokens == 32
    layers = len(runner.fast.layers)
    # the first prompt: 24 fresh rows (paged), then 16 after them (gathered); the second: 32
    # cached, then 24 rows (gathered) and 6 (paged)
    assert gathered == [(16, 40)] * layers + [(24, 56)] * layers
    # (on a GPU a fresh chunk attends through the library's SDPA: sdpa_prefill)
    assert paged == ([] if DEVICE.type == "cuda" else [24] * layers) + [6] * layers
