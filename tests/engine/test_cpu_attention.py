"""The CPU pass's native decode attention (``engine/kernels/cpu_attention.c``), built here
with the machine's C compiler, against float64 and torch's bfloat16 SDPA kernel (the stock
code's), and how the pass chooses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.bench import shapes
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kernels import native
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.models.batch import StepBatch
from pdserve.engine.models.cpu_plan import NATIVE_PREFILL_MAX_CTX, Plan
from pdserve.engine.models.llama_cpu import LlamaFamilyCPU
from pdserve.schemas import SamplingParams

CPU = torch.device("cpu")


def case(
    rows: int, heads: int, group: int, dim: int, page: int, lens: list[int], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bfloat16 pool of 3 layers, each row's pages scattered in it, its query a strided row."""
    gen = torch.Generator().manual_seed(seed)
    widest = -(-max(lens) // page)
    num_pages = rows * widest + 5
    pool = torch.randn(num_pages, 3, 2, heads, page, dim, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(num_pages, generator=gen)[: rows * widest].view(rows, widest).to(torch.int32)
    width = heads * group * dim
    qkv = torch.randn(rows, width + 2 * heads * dim, generator=gen).to(torch.bfloat16)
    return pool, qkv[:, :width], tables, torch.tensor(lens, dtype=torch.int32)


def reference(
    pool: torch.Tensor, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, layer: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: attention in float64, and torch's bfloat16 SDPA kernel on the same values."""
    _, _, _, heads, page, dim = pool.shape
    exact, stock = [], []
    for r in range(q.shape[0]):
        n = int(lens[r])
        first = max(0, n - window) if window else 0
        kv = pool[tables[r, : -(-n // page)].long(), layer]  # [pages, 2, heads, page, dim]
        k = kv[:, 0].permute(1, 0, 2, 3).reshape(heads, -1, dim)[:, first:n]
        v = kv[:, 1].permute(1, 0, 2, 3).reshape(heads, -1, dim)[:, first:n]
        qg = q[r].view(heads, -1, dim)
        exact.append(F.scaled_dot_product_attention(qg.double(), k.double(), v.double(), scale=dim**-0.5).reshape(-1))
        stock.append(F.scaled_dot_product_attention(qg, k, v, scale=dim**-0.5).reshape(-1))
    return torch.stack(exact), torch.stack(stock)


@pytest.mark.parametrize(
    ("heads", "group", "dim", "page", "lens", "window"),
    [
        (3, 3, 64, 16, [1, 17, 130, 64, 5, 33, 90, 16], None),  # SmolLM2's heads; lengths across pages
        (2, 2, 128, 16, [300, 7, 48], None),
        (1, 4, 80, 4, [9, 1, 23], None),  # a head size with no specialised loop
        (3, 3, 64, 16, [200, 40, 12], 32),  # a sliding window
        (4, 1, 32, 8, [50], None),  # one query head per KV head, one row
    ],
)
def test_native_decode_attention_is_within_the_stock_kernels_error(
    heads: int, group: int, dim: int, page: int, lens: list[int], window: int | None
) -> None:
    """Against float64 the kernel's error stays within that of torch's bfloat16 SDPA kernel on
    the same values (on average well under it: it rounds once, at the end), row by row over
    each row's own length and window, from query rows that are strided views."""
    pool, q, tables, lengths = case(len(lens), heads, group, dim, page, lens)
    assert q.stride(0) > q.shape[1]  # rows of a wider qkv
    for layer in (0, 2):
        ours = native.paged_decode(pool, q, tables, lengths, layer, dim**-0.5, window)
        assert ours.dtype == torch.bfloat16 and ours.shape == q.shape
        exact, stock = reference(pool, q, tables, lengths, layer, window)
        ours_error, stock_error = (ours.double() - exact).abs(), (stock.double() - exact).abs()
        assert ours_error.max() <= stock_error.max() and ours_error.mean() <= stock_error.mean()
        # within one rounding to bfloat16 of the exact value (its spacing there)
        spacing = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2**-60))) - 7)
        assert bool((ours_error <= spacing).all())


def test_native_decode_attention_refuses_what_it_cannot_read() -> None:
    pool, q, tables, lens = case(2, 3, 3, 64, 16, [5, 9])
    scale = 0.125
    with pytest.raises(ValueError, match="bfloat16"):
        native.paged_decode(pool.float(), q, tables, lens, 0, scale)
    with pytest.raises(ValueError, match="int32"):
        native.paged_decode(pool, q, tables.long(), lens, 0, scale)
    with pytest.raises(ValueError, match="one table and one length per row"):
        native.paged_decode(pool, q, tables, lens[:1], 0, scale)
    with pytest.raises(ValueError, match="query shape"):
        native.paged_decode(pool, q[:, :100], tables, lens, 0, scale)
    assert native.paged_decode(pool, q[:0], tables[:0], lens[:0], 0, scale).shape == (0, q.shape[1])


def prefill_case(
    heads: int, group: int, dim: int, page: int, ctx: int, n: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bfloat16 pool of 3 layers holding one sequence's ``ctx`` tokens in scattered pages, and
    the queries of its last ``n`` as strided rows."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-ctx // page)
    pool = torch.randn(pages + 4, 3, 2, heads, page, dim, generator=gen).to(torch.bfloat16)
    table = torch.randperm(pages + 4, generator=gen)[:pages].to(torch.int32)
    width = heads * group * dim
    qkv = torch.randn(n, width + 2 * heads * dim, generator=gen).to(torch.bfloat16)
    return pool, qkv[:, :width], table


def prefill_reference(
    pool: torch.Tensor, q: torch.Tensor, table: torch.Tensor, ctx: int, layer: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the rows at positions ctx - n .. ctx - 1 in float64, and torch's
    bfloat16 SDPA kernel (the stock code's) on the same values; ``[n, heads * group * dim]``."""
    _, _, _, heads, _, dim = pool.shape
    n = q.shape[0]
    kv = pool[table.long(), layer]  # [pages, 2, heads, page, dim]
    k = kv[:, 0].permute(1, 0, 2, 3).reshape(heads, -1, dim)[:, :ctx]
    v = kv[:, 1].permute(1, 0, 2, 3).reshape(heads, -1, dim)[:, :ctx]
    qpos, kpos = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    qs = q.view(n, -1, dim).transpose(0, 1)

    def attend(dtype: torch.dtype) -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            qs.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask, scale=dim**-0.5, enable_gqa=True
        )
        return o.transpose(0, 1).reshape(n, -1)

    return attend(torch.float64), attend(torch.bfloat16)


@pytest.mark.parametrize(
    ("heads", "group", "dim", "page", "ctx", "n", "window"),
    [
        (3, 3, 64, 16, 130, 130, None),  # SmolLM2's heads, a whole prompt
        (3, 3, 64, 16, 300, 77, None),  # a chunk over a cached prefix
        (2, 2, 128, 16, 200, 200, None),
        (1, 4, 80, 4, 37, 10, None),  # a head size with no specialised loop
        (3, 3, 64, 16, 300, 120, 32),  # a sliding window
        (4, 1, 32, 8, 50, 50, None),  # one query head per KV head
        (3, 3, 64, 16, 1, 1, None),  # one token
    ],
)
def test_native_prefill_attention_is_within_the_stock_kernels_error(
    heads: int, group: int, dim: int, page: int, ctx: int, n: int, window: int | None
) -> None:
    """Against float64 the causal prefill kernel's error stays within that of torch's bfloat16
    SDPA kernel on the same values (max; mean within 5 %), and within one bfloat16 spacing of
    the exact value but for outputs near zero (after cancellation), where torch's kernel also
    strays: at most one in 10,000."""
    pool, q, table = prefill_case(heads, group, dim, page, ctx, n)
    assert q.stride(0) > q.shape[1]
    for layer in (0, 2):
        ours = native.paged_prefill(pool, q, table, ctx, layer, dim**-0.5, window)
        assert ours.dtype == torch.bfloat16 and ours.shape == q.shape
        exact, stock = prefill_reference(pool, q, table, ctx, layer, window)
        ours_error, stock_error = (ours.double() - exact).abs(), (stock.double() - exact).abs()
        assert ours_error.max() <= stock_error.max() and ours_error.mean() <= stock_error.mean() * 1.05
        spacing = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2**-60))) - 7)
        assert int((ours_error > spacing).sum()) <= ours_error.numel() // 10_000


def test_native_prefill_attention_refuses_what_it_cannot_read() -> None:
    pool, q, table = prefill_case(3, 3, 64, 16, 40, 8)
    with pytest.raises(ValueError, match="bfloat16"):
        native.paged_prefill(pool.float(), q, table, 40, 0, 0.125)
    with pytest.raises(ValueError, match="int32"):
        native.paged_prefill(pool, q, table.long(), 40, 0, 0.125)
    with pytest.raises(ValueError, match="rows over a context"):
        native.paged_prefill(pool, q, table, 4, 0, 0.125)  # fewer keys than rows
    with pytest.raises(ValueError, match="rows over a context"):
        native.paged_prefill(pool, q, table[:2], 40, 0, 0.125)  # pages for 32 tokens
    with pytest.raises(ValueError, match="query shape"):
        native.paged_prefill(pool, q[:, :100], table, 40, 0, 0.125)


def test_the_cpu_pass_prefills_short_chunks_natively_and_long_ones_through_sdpa() -> None:
    """Under ``auto`` a bfloat16 prompt's chunk of up to NATIVE_PREFILL_MAX_CTX tokens of context
    is read in place by the kernel (no page gather); a longer one goes through torch's SDPA,
    where that measured faster; both give the stock code's greedy tokens
    (tests/engine/test_cpu_fast_model.py)."""
    model = shapes.small_model("smollm2", CPU).to(torch.bfloat16)
    config = EngineConfig(device="cpu", max_total_tokens=4096, chunked_prefill_size=4096)
    engine = Engine(ModelRunner(ModelSpec(Path("m")), config, model=model), config)
    fast = engine.runner.fast
    assert isinstance(fast, LlamaFamilyCPU) and fast.native
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("short", list(range(100, 100 + 300)), params)
    engine.add_request("long", list(range(100, 100 + NATIVE_PREFILL_MAX_CTX + 5)), params)
    batch = engine.schedule()
    plans = []
    original = fast.plan

    def recording(step: StepBatch) -> Plan:  # the pass's own plan of the step it runs
        plans.append(original(step))
        return plans[-1]

    fast.plan = recording  # type: ignore[method-assign]
    engine.postprocess(batch, engine.execute(batch))
    (plan,) = plans
    assert [c.ctx_len for c in plan.chunks] == [300, NATIVE_PREFILL_MAX_CTX + 5]
    short, long = plan.chunks
    assert short.table_native is not None and short.gather is None
    assert long.table_native is None


def test_the_cpu_pass_reads_a_bfloat16_pool_natively_by_default() -> None:
    """The normal path on a machine with a C compiler (``make install`` sees to one): ``auto``
    takes the kernel for a bfloat16 model; a float32 one keeps torch's ops; ``native`` on a
    float32 pool is refused."""
    model = shapes.small_model("smollm2", CPU).to(torch.bfloat16)
    runner = ModelRunner(ModelSpec(Path("m")), EngineConfig(device="cpu", max_total_tokens=256), model=model)
    assert isinstance(runner.fast, LlamaFamilyCPU) and runner.fast.native
    runner = ModelRunner(
        ModelSpec(Path("m")), EngineConfig(device="cpu", max_total_tokens=256, cpu_attention="torch"), model=model
    )
    assert isinstance(runner.fast, LlamaFamilyCPU) and not runner.fast.native
    float32 = shapes.small_model("smollm2", CPU)
    runner = ModelRunner(ModelSpec(Path("m")), EngineConfig(device="cpu", max_total_tokens=256), model=float32)
    assert isinstance(runner.fast, LlamaFamilyCPU) and not runner.fast.native
    with pytest.raises(ValueError, match="cpu_attention 'native'"):
        ModelRunner(
            ModelSpec(Path("m")),
            EngineConfig(device="cpu", max_total_tokens=256, cpu_attention="native"),
            model=shapes.small_model("smollm2", CPU),
        )


PROBE = """
import json, logging, sys
import torch
from pathlib import Path
from pdserve.bench import shapes
from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels import native
from pdserve.engine.model_runner import ModelRunner, ModelSpec
records = []
handler = logging.Handler()
handler.emit = lambda r: records.append({"message": r.getMessage(), "level": r.levelname, **{
    k: str(v) for k, v in r.__dict__.items() if k in ("path", "reason")}})
logging.getLogger("pdserve").addHandler(handler)
logging.getLogger("pdserve").setLevel(logging.INFO)
model = shapes.small_model("smollm2-2l", torch.device("cpu")).to(torch.bfloat16)
attention = sys.argv[1]
try:
    runner = ModelRunner(ModelSpec(Path("m")), EngineConfig(device="cpu", max_total_tokens=256,
                         cpu_attention=attention), model=model)
    native_path = runner.fast.native
    error = None
except ValueError as exc:
    native_path, error = None, str(exc)
print(json.dumps({"reason": native.unavailable_reason(), "native": native_path, "error": error,
                  "logged": [r for r in records if r["message"] == "cpu decode attention"]}))
"""


def probe(tmp_path: Path, attention: str, **env: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, attention],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "PDSERVE_KERNEL_CACHE": str(tmp_path / "kernels"), **env},
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_fresh_cache_builds_the_kernel_and_a_missing_compiler_is_said(tmp_path: Path) -> None:
    """In a new process with an empty cache the kernel is built there and taken; with no
    compiler (or no cache it can write) ``auto`` decodes through torch's ops and says why at
    WARNING, ``native`` refuses."""
    built = probe(tmp_path, "auto")
    assert built["reason"] is None and built["native"] is True
    assert [p.name.startswith("cpu_kernels-") for p in (tmp_path / "kernels").iterdir()] == [True]
    missing = str(tmp_path / "no-such-cc")
    fallen = probe(tmp_path / "other", "auto", CC=missing)
    assert fallen["native"] is False and missing in str(fallen["reason"])
    assert fallen["logged"] == [
        {"message": "cpu decode attention", "level": "WARNING", "path": "torch", "reason": fallen["reason"]}
    ]
    refused = probe(tmp_path / "other", "native", CC=missing)
    assert refused["native"] is None and "cpu_attention 'native'" in str(refused["error"])
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    unwritable = probe(tmp_path / "third", "auto", PDSERVE_KERNEL_CACHE=str(blocker / "kernels"))
    assert unwritable["native"] is False and "cannot write the kernel cache" in str(unwritable["reason"])


def test_the_build_key_follows_the_sources_their_header_and_the_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = native.build_key("cc 1")
    assert native.build_key("cc 1") == key and native.build_key("cc 2") != key
    assert all('#include "cpu_common.h"' in source.read_text() for source in native.SOURCES)
    (header,) = native.HEADERS
    changed = tmp_path / header.name
    changed.write_text(header.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "HEADERS", (changed,))
    assert native.build_key("cc 1") != key  # a change to the shared header builds anew
