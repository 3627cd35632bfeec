"""The FP8 kernels of :mod:`pdserve.engine.kernels.fp8` against plain torch: the per-row
quantization bit for bit (:func:`pdserve.engine.quant.quantize_rows_fp8`), the batched W8A8
product against float64 over the same FP8 values, and :func:`fp8.linear`'s choice by rows.

On the CPU they run in Triton's interpreter (tiny shapes); on a GPU compiled (bf16 too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import quant
from pdserve.engine.kernels import fp8
from tests.engine.kernel_env import DEVICE, elementwise, gemv

DTYPES = [torch.float32, torch.bfloat16]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "k", "block_k"), [(1, 17, None), (3, 100, None), (5, 300, 64), (2, 64, 64)])
def test_quantize_rows_is_the_reference_bit_for_bit(dtype: torch.dtype, rows: int, k: int, block_k: int | None) -> None:
    # rows of very different magnitudes (a row's small values fall into e4m3's subnormals),
    # one of zeros; in one pass or two (block_k below the row: the amax first, then the values)
    x = torch.randn((rows, k), device=DEVICE) * torch.logspace(-6, 3, rows, device=DEVICE)[:, None]
    x = x.to(dtype)
    x[rows // 2] = 0
    q, scale = fp8.quantize_rows(x, block_k=block_k)
    q_ref, scale_ref = quant.quantize_rows_fp8(x)
    assert q.shape == (rows, k) and scale.shape == (rows,) and scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref)
    assert same_bits(q, q_ref)
    assert (q[rows // 2].float() == 0).all() and scale[rows // 2] > 0


def test_quantize_rows_rounds_ties_to_even_and_keeps_subnormals() -> None:
    # amax 448 gives a scale of exactly 1: the values themselves are rounded to e4m3
    vals = [448.0, 1.0625, 1.1875, 17.0, 19.0, 0.0009765625 * 1.5, 0.0009765625 * 0.5, 2.0**-9, -1.0625, 447.9, 300.0]
    x = torch.tensor([vals + [0.0] * (32 - len(vals))], device=DEVICE)
    q, scale = fp8.quantize_rows(x)
    assert scale.item() == 1.0
    assert same_bits(q, x.to(quant.FP8))  # torch's conversion: round to nearest even
    assert q[0, :8].float().tolist() == [448.0, 1.0, 1.25, 16.0, 20.0, 2.0**-9, 0.0, 2.0**-9]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "k", "block_k"), [(3, 40, None), (2, 200, 64)])
def test_quantize_rows_reads_silu_times_up(dtype: torch.dtype, rows: int, k: int, block_k: int | None) -> None:
    # fused: the very bits of quantizing elementwise.silu_mul's output (rounded alike)
    gate_up = (torch.randn((rows, 2 * k), device=DEVICE) * 3).to(dtype)
    q, scale = fp8.quantize_rows(gate_up, silu_mul_input=True, block_k=block_k)
    q_ref, scale_ref = quant.quantize_rows_fp8(elementwise.silu_mul(gate_up))
    if DEVICE.type == "cpu":
        # the interpreter's exp is numpy's, whose vector and scalar code differ in the last bit
        # (blocks of other widths here and in silu_mul), which can round a bf16 SiLU the other
        # way: at most a neighbouring FP8 code
        assert torch.allclose(scale, scale_ref, rtol=1e-6, atol=0)
        codes = (q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()
        codes[(q.float() == 0) & (q_ref.float() == 0)] = 0  # and a SiLU of -0 against +0
        assert codes.max() <= 1 and (codes > 0).float().mean() < 0.05
    else:
        assert torch.equal(scale, scale_ref) and same_bits(q, q_ref)
    # and close to torch's own SiLU (exp differs in the last bits)
    act = F.silu(gate_up[:, :k].double()) * gate_up[:, k:].double()
    assert rel_err(q.double() * scale.double()[:, None], act) < 0.05


def test_quantize_rows_of_no_rows() -> None:
    q, scale = fp8.quantize_rows(torch.empty((0, 64), device=DEVICE))
    assert q.shape == (0, 64) and q.dtype == quant.FP8 and scale.shape == (0,)


def w8a8_reference(xq: torch.Tensor, xs: torch.Tensor, w: quant.Fp8Weight, b: torch.Tensor | None) -> torch.Tensor:
    ref = (xq.double() * xs.double()[:, None]) @ w.dequantize(torch.float64).T
    return ref if b is None else ref + b.double()


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles"),
    [
        (1, 40, 96, {"block_m": 16, "block_n": 16, "block_k": 32}),  # N and K not multiples of the tile
        (5, 48, 128, {"block_m": 16, "block_n": 16, "block_k": 64}),  # even tiles: no masks on w
        (17, 33, 160, {"block_m": 16, "block_n": 32, "block_k": 32}),  # two row blocks, the second of one row
        (3, 130, 64, {"block_m": 16, "block_n": 128, "block_k": 32}),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tma", [False, True])
def test_matmul_matches_float64_on_the_same_fp8_values(
    rows: int, n: int, k: int, tiles: dict, bias: bool, tma: bool
) -> None:
    """W8A8 against float64 over the same FP8 values, split along K or not, the tiles read by
    per-thread loads or by TMA (zeros past the rows, channels and columns the tensors have)."""
    tiles = {**tiles, "tma": tma}
    x = torch.randn((rows, k), device=DEVICE)
    w = quant.quantize_fp8(torch.randn((n, k), device=DEVICE) * torch.rand((n, 1), device=DEVICE) * 4)
    b = torch.randn(n, device=DEVICE) if bias else None
    xq, xs = fp8.quantize_rows(x)
    ref = w8a8_reference(xq, xs, w, b)
    # float32 sums: the interpreter's; a GPU's FP8 MMA rounds products no further
    tol = 2e-5 if DEVICE.type == "cpu" else 1e-3
    counters = gemv.split_counters(torch.device(DEVICE), 64)
    for split in (1, 2, 3):  # k=96, 3 splits of 32: every split full; k=160: the last one short
        out = fp8.matmul(xq, w, b, xs, torch.float32, split_k=split, **tiles)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        assert rel_err(out, ref) < tol, split
        assert not counters.any(), "split-K counters left at zero"
    out16 = fp8.matmul(xq, w, b, xs, torch.bfloat16, split_k=2, **tiles)
    assert out16.dtype == torch.bfloat16 and rel_err(out16, ref) < 1e-2


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles"),
    [
        (2, 40, 96, {"block_m": 16, "block_n": 16, "block_k": 32}),
        (17, 33, 160, {"block_m": 16, "block_n": 32, "block_k": 64}),
    ],
)
def test_matmul_on_16_bit_activations_matches_the_dequantized_weights(rows: int, n: int, k: int, tiles: dict) -> None:
    # W8A16: x as it is (SiLU·up read on the fly for down), the weights converted in registers
    w = quant.quantize_fp8(torch.randn((n, k), device=DEVICE) * torch.rand((n, 1), device=DEVICE) * 4)
    b = torch.randn(n, device=DEVICE)
    dense = w.dequantize(torch.float64)
    x = torch.randn((rows, k), device=DEVICE)
    gate_up = torch.randn((rows, 2 * k), device=DEVICE)
    ref = F.linear(x.double(), dense, b.double())
    ref_act = F.linear(elementwise.silu_mul(gate_up).double(), dense)
    tol = 2e-5 if DEVICE.type == "cpu" else 2e-2  # tf32 on a GPU
    for split in (1, 3):
        assert rel_err(fp8.matmul(x, w, b, split_k=split, **tiles), ref) < tol, split
        got = fp8.matmul(gate_up, w, silu_mul_input=True, split_k=split, **tiles)
        assert got.dtype == torch.float32 and rel_err(got, ref_act) < tol, split
    assert not gemv.split_counters(torch.device(DEVICE), 1).any()


def test_quantize_groups_fp8_is_per_row_per_128_columns() -> None:
    x = torch.randn((3, 300), dtype=torch.float64) * torch.logspace(-3, 2, 300)[None, :]
    x[1, 128:256] = 0
    q, scale = quant.quantize_groups_fp8(x)
    assert q.shape == (3, 300) and q.dtype == quant.FP8 and scale.shape == (3, 3)
    for g in range(3):
        cols = slice(g * 128, (g + 1) * 128)
        amax = x[:, cols].abs().amax(dim=1).float().clamp_min(1e-12)
        assert torch.equal(scale[:, g], amax / torch.full_like(amax, 448.0))
        assert (q[:, cols].float().abs().amax(dim=1)[amax > 1e-12] == 448.0).all()
    assert (q[1, 128:256].float() == 0).all()
    back = q.double() * scale.double().repeat_interleave(128, dim=1)[:, :300]
    assert rel_err(back, x) < 0.05
    # one group of outliers (1e5 times the rest): the other groups keep scales of their own, where
    # a scale per row pushes them towards e4m3's subnormals
    x = torch.randn((4, 384), dtype=torch.float64)
    x[:, :128] *= 1e5
    q, scale = quant.quantize_groups_fp8(x)
    by_group = q.double() * scale.double().repeat_interleave(128, dim=1)
    q_row, scale_row = quant.quantize_rows_fp8(x)
    by_row = q_row.double() * scale_row.double()[:, None]
    assert rel_err(by_group[:, 128:], x[:, 128:]) < 0.5 * rel_err(by_row[:, 128:], x[:, 128:])


@pytest.mark.parametrize(("rows", "n", "k"), [(3, 40, 300), (17, 33, 256)])
@pytest.mark.parametrize("silu", [False, True])
def test_matmul_quantizes_each_tile_of_x_in_registers(rows: int, n: int, k: int, silu: bool) -> None:
    # tile_quant: the very FP8 values and scales of quant.quantize_groups_fp8, K tiles of 128
    w = quant.quantize_fp8(torch.randn((n, k), device=DEVICE) * torch.rand((n, 1), device=DEVICE) * 4)
    b = torch.randn(n, device=DEVICE)
    x = (torch.randn((rows, 2 * k if silu else k), device=DEVICE) * 3).to(torch.bfloat16)
    act = elementwise.silu_mul(x) if silu else x
    q, scale = quant.quantize_groups_fp8(act)
    ref = (q.double() * scale.double().repeat_interleave(quant.GROUP, dim=1)[:, :k]) @ w.dequantize(torch.float64).T
    ref = ref + b.double()
    tol = 2e-5 if DEVICE.type == "cpu" else 1e-3
    tiles = {"block_m": 16, "block_n": 16, "block_k": quant.GROUP}
    for split in (1, 2):
        out = fp8.matmul(x, w, b, out_dtype=torch.float32, silu_mul_input=silu, split_k=split, tile_quant=True, **tiles)
        assert out.shape == (rows, n) and rel_err(out, ref) < tol, split
    assert not gemv.split_counters(torch.device(DEVICE), 1).any()
    with pytest.raises(AssertionError, match="tile_quant"):
        fp8.matmul(x, w, tile_quant=True, silu_mul_input=silu, block_k=64)


def test_matmul_of_no_rows_and_its_tiles() -> None:
    w = quant.quantize_fp8(torch.randn((32, 64), device=DEVICE))
    xq, xs = fp8.quantize_rows(torch.empty((0, 64), device=DEVICE))
    assert fp8.matmul(xq, w, x_scale=xs).shape == (0, 32)
    assert fp8.matmul(torch.empty((0, 64), device=DEVICE), w).shape == (0, 32)
    # the table at 7B's shapes: one row block up to 64 rows, split-K within one wave of the SMs
    # where the tiles are few (o and down: 56 tiles of 64 channels), as many stages as fit
    assert fp8.matmul_tiles(2, 4608, 3584) == {
        "block_m": 16, "block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 5, "split_k": 1,
    }  # fmt: skip
    assert fp8.matmul_tiles(64, 3584, 18944)["split_k"] == 2
    assert fp8.matmul_tiles(64, 3584, 3584)["split_k"] == 2
    assert fp8.matmul_tiles(64, 37888, 3584)["num_stages"] == 3  # 592 tiles: two programs an SM
    assert fp8.matmul_tiles(128, 3584, 18944)["split_k"] == 2  # two row blocks: fill the SMs once
    assert fp8.matmul_tiles(128, 3584, 18944)["block_k"] == 128
    assert fp8.matmul_tiles(2, 4608, 3584, x_bytes=2) == {  # 16-bit activations: as before
        "block_m": 16, "block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 3, "split_k": 2,
    }  # fmt: skip
    assert fp8.matmul_tiles(2, 3584, 18944, tile_quant=True)["block_k"] == quant.GROUP
    assert fp8.matmul_tiles(64, 37888, 3584)["split_k"] == 1
    assert fp8.matmul_tiles(100, 37888, 3584)["block_m"] == 64


def test_the_earlier_tile_rule_stays_selectable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8, "MATMUL_RULE", "fill")
    assert fp8.matmul_tiles(2, 4608, 3584) == {
        "block_m": 16, "block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 3, "split_k": 2,
    }  # fmt: skip
    assert fp8.matmul_tiles(64, 3584, 18944)["split_k"] == 4 and fp8.matmul_tiles(64, 3584, 18944)["block_k"] == 128


def test_matmul_stages_fit_the_gpu_s_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # an Ada GPU (99 KiB a program): 2 stages of 64 + 64 rows by 256 columns fit, 5 would not
    monkeypatch.setattr(fp8, "shared_memory", lambda: 101376)
    assert fp8.matmul_tiles(64, 3584, 3584)["num_stages"] == 2
    assert fp8.matmul_tiles(16, 3584, 3584)["num_stages"] == 4
    monkeypatch.setattr(fp8, "shared_memory", lambda: fp8.HOPPER_SHARED_MEMORY)
    assert fp8.matmul_tiles(64, 3584, 3584)["num_stages"] == 5


@pytest.mark.parametrize("silu", [False, True])
def test_linear_takes_gemv_then_batched_then_scaled_mm_by_rows(monkeypatch: pytest.MonkeyPatch, silu: bool) -> None:
    n, k = 48, 64
    w = quant.quantize_fp8(torch.randn((n, k), device=DEVICE))
    b = torch.randn(n, dtype=torch.bfloat16, device=DEVICE)
    taken: list[str] = []
    for name in ("gemv", "matmul", "scaled_mm"):
        fn = getattr(fp8.gemv if name == "gemv" else fp8, name)

        def spy(*args: object, _fn: object = fn, _name: str = name, **kwargs: object) -> torch.Tensor:
            taken.append(_name)
            return _fn(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(fp8.gemv if name == "gemv" else fp8, name, spy)
    for rows, path in ((0, None), (1, "gemv"), (2, "matmul"), (5, "matmul"), (6, "scaled_mm"), (9, "scaled_mm")):
        taken.clear()
        x = torch.randn((rows, 2 * k if silu else k), dtype=torch.bfloat16, device=DEVICE)
        out = fp8.linear(x, w, b, silu_mul_input=silu, gemv_max_rows=1, batched_max_rows=5)
        assert out.shape == (rows, n) and out.dtype == torch.bfloat16
        assert taken == ([path] if path else []), rows
        if rows == 0:
            continue
        act = elementwise.silu_mul(x) if silu else x
        if path == "gemv":  # activations as they are
            ref = F.linear(act.double(), w.dequantize(torch.float64), b.double())
        else:  # quantized per row first
            ref = w8a8_reference(*quant.quantize_rows_fp8(act), w, b)
        assert rel_err(out, ref) < 1e-2, rows
    assert fp8.GEMV_MAX_ROWS < fp8.BATCHED_MAX_ROWS
    # the other batched modes: no quantize_rows launch
    monkeypatch.setattr(fp8, "quantize_rows", None)
    x = torch.randn((4, 2 * k if silu else k), dtype=torch.bfloat16, device=DEVICE)
    act = elementwise.silu_mul(x) if silu else x
    dense = F.linear(act.double(), w.dequantize(torch.float64), b.double())
    for mode in ("a16", "tile"):
        monkeypatch.setattr(fp8, "BATCHED_MODE", mode)
        taken.clear()
        out = fp8.linear(x, w, b, silu_mul_input=silu, gemv_max_rows=1, batched_max_rows=5)
        assert taken == ["matmul"]
        assert rel_err(out, dense) < (1e-2 if mode == "a16" else 5e-2), mode
    monkeypatch.setattr(fp8, "BATCHED_MODE", "per-row")
    with pytest.raises(ValueError, match="BATCHED_MODE"):
        fp8.linear(x, w, b, silu_mul_input=silu, gemv_max_rows=1, batched_max_rows=5)


def test_gemv_takes_measured_tiles_and_silu_first_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 48, 64
    w = quant.quantize_fp8(torch.randn((n, k), device=DEVICE))
    tiles = {"block_n": 16, "block_k": 32, "split_k": 2, "num_warps": 4, "num_stages": 3}
    monkeypatch.setitem(fp8.GEMV_TILES, (n, k), tiles)
    assert fp8.gemv_tiles(1, n, k) == tiles and fp8.gemv_tiles(2, n, k) != tiles
    seen: list[tuple[bool, int]] = []
    real = fp8.gemv.gemv

    def spy(x: torch.Tensor, *args: object, silu_mul_input: bool = False, **kwargs: object) -> torch.Tensor:
        seen.append((silu_mul_input, kwargs["block_n"]))  # type: ignore[arg-type]
        return real(x, *args, silu_mul_input=silu_mul_input, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fp8.gemv, "gemv", spy)
    gate_up = torch.randn((1, 2 * k), dtype=torch.bfloat16, device=DEVICE)
    ref = F.linear(elementwise.silu_mul(gate_up).double(), w.dequantize(torch.float64))
    for fused in (True, False):
        monkeypatch.setattr(fp8, "GEMV_SILU_FUSED", fused)
        assert rel_err(fp8.linear(gate_up, w, silu_mul_input=True), ref) < 1e-2
    taken = fp8.gemv.model_tiles(tiles)["block_n"]  # the measured tiles (widened in the interpreter)
    assert seen == [(True, taken), (False, taken)]


def test_matmul_takes_measured_tiles_for_their_row_block_only(monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 48, 128
    w = quant.quantize_fp8(torch.randn((n, k), device=DEVICE))
    tiles = {"block_n": 16, "block_k": 32, "split_k": 2, "num_warps": 4, "num_stages": 2}
    rule = fp8.matmul_tiles(3, n, k)
    monkeypatch.setitem(fp8.MATMUL_TILES, (16, n, k), tiles)
    assert fp8.matmul_tiles(3, n, k) == {"block_m": 16, **tiles} != rule
    assert fp8.matmul_tiles(40, n, k)["block_m"] == 64 and fp8.matmul_tiles(40, n, k)["block_n"] == 64
    assert fp8.matmul_tiles(3, n, k, tile_quant=True)["block_k"] == quant.GROUP  # its own tiles
    launched: list[dict] = []
    real = fp8._launch

    def spy(*args: object) -> torch.Tensor:
        launched.append(dict(args[7]))  # type: ignore[call-overload]
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(fp8, "_launch", spy)
    x = torch.randn((3, k), dtype=torch.bfloat16, device=DEVICE)
    out = fp8.linear(x, w, gemv_max_rows=1, batched_max_rows=8)
    assert launched == [{"block_m": 16, **tiles}]
    assert rel_err(out, w8a8_reference(*quant.quantize_rows_fp8(x), w, None)) < 1e-2


def test_tma_is_a_tile_setting_of_w8a8_asked_for_and_refused_where_rows_are_not_aligned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fp8.MATMUL_TMA`` (off by default) makes the rule's W8A8 tiles read by TMA where each
    row is whole 16-byte units; 16-bit activations and ``tile_quant`` keep their loads; a
    product asked for TMA over rows that are not aligned is refused, not read another way."""
    assert "tma" not in fp8.matmul_tiles(64, 4608, 3584)
    monkeypatch.setattr(fp8, "MATMUL_TMA", True)
    assert fp8.matmul_tiles(64, 4608, 3584)["tma"] and fp8.matmul_tiles(3, 48, 128)["tma"]
    assert "tma" not in fp8.matmul_tiles(64, 4608, 3584, x_bytes=2)
    assert "tma" not in fp8.matmul_tiles(64, 4608, 3584, tile_quant=True)
    assert "tma" not in fp8.matmul_tiles(3, 48, 100)  # rows of 100 bytes
    w = quant.quantize_fp8(torch.randn((48, 128), device=DEVICE))
    xq, xs = fp8.quantize_rows(torch.randn((3, 129), device=DEVICE))
    with pytest.raises(ValueError, match="16-byte aligned"):
        fp8.matmul(xq[:, 1:], w, None, xs, tma=True, block_k=32)  # rows 129 bytes apart
    x = torch.randn((3, 128), dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(AssertionError, match="TMA reads FP8 rows"):
        fp8.matmul(x, w, tma=True, block_k=32)
    out = fp8.linear(x, w, gemv_max_rows=1, batched_max_rows=8)  # the rule's tiles, by TMA
    assert rel_err(out, w8a8_reference(*quant.quantize_rows_fp8(x), w, None)) < 1e-2


def test_the_probe_s_swept_tiles_become_the_table_only_where_faster() -> None:
    from bench.gpu_engine_fp8 import measured_mm_tiles

    def row(shape: str, rows: int, tiles: str, us: float, bn: int) -> dict:
        cfg = {"block_m": 64, "block_n": bn, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 3}
        return {"shape": shape, "rows": rows, "variant": "batched_mm", "tiles": tiles, "us": us, **cfg}

    probe = {
        "rows": [
            row("qkv", 64, "table", 11.4, 64),
            row("qkv", 64, "sweep", 9.0, 32),
            row("qkv", 64, "sweep", 12.0, 128),
            row("o", 64, "table", 10.8, 64),
            row("o", 64, "sweep", 11.0, 32),  # slower than the rule: not taken
            row("down", 64, "table", 27.0, 64),  # not swept
            row("gate_up", 64, "table", 56.0, 64),
            row("gate_up", 64, "sweep", 55.0, 64),
            {**row("gate_up", 64, "sweep", 50.0, 64), "tma": True},  # read by TMA: kept so
            {"shape": "gate_up", "rows": 64, "variant": "cublas", "us": 1.0},
        ]
    }
    tiles = {"block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 3}
    assert measured_mm_tiles(probe) == {
        (64, 4608, 3584): {"block_n": 32, **tiles},
        (64, 37888, 3584): {"block_n": 64, **tiles, "tma": True},
    }


def test_a_model_s_gemv_tiles_are_widened_only_in_the_interpreter() -> None:
    tiles = {"block_n": 8, "block_k": 512, "split_k": 2, "num_warps": 4}
    widened = fp8.gemv.model_tiles(tiles)
    if DEVICE.type == "cuda":
        assert widened == tiles
    else:
        assert widened == {**tiles, "block_n": 128} and tiles["block_n"] == 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_hands_over_rows_quantized(dtype: torch.dtype, residual: bool) -> None:
    # the norm's very output quantized per row in the same pass, and the product taking it
    x = (torch.randn((5, 96), device=DEVICE) * 3).to(dtype)
    res = torch.randn((5, 96), device=DEVICE).to(dtype) if residual else None
    weight = torch.rand(96, device=DEVICE).to(dtype) + 0.5
    (q, scale), res_out = elementwise.add_rms_norm_fp8(x, res, weight, 1e-6)
    out_ref, res_ref = elementwise.add_rms_norm(x, res, weight, 1e-6)
    q_ref, scale_ref = quant.quantize_rows_fp8(out_ref)
    assert torch.equal(res_out, res_ref) and torch.equal(scale, scale_ref) and same_bits(q, q_ref)
    w = quant.quantize_fp8(torch.randn((48, 96), device=DEVICE))  # _scaled_mm on a GPU: multiples of 16
    assert fp8.takes_quantized_rows(5, gemv_max_rows=1, batched_max_rows=4)  # _scaled_mm's rows
    assert fp8.takes_quantized_rows(3, gemv_max_rows=1, batched_max_rows=4) == (fp8.BATCHED_MODE == "row")
    assert not fp8.takes_quantized_rows(1, gemv_max_rows=1)
    bias = torch.randn(48, device=DEVICE).to(torch.bfloat16)
    for batched in (8, 4):  # the batched kernel, then _scaled_mm (the bias in its epilogue)
        out = fp8.linear(q, w, x_scale=scale, gemv_max_rows=1, batched_max_rows=batched)
        assert out.dtype == torch.bfloat16
        assert rel_err(out, w8a8_reference(q_ref, scale_ref, w, None)) < 1e-2
        out = fp8.linear(q, w, bias, x_scale=scale, gemv_max_rows=1, batched_max_rows=batched)
        assert rel_err(out, w8a8_reference(q_ref, scale_ref, w, bias)) < 1e-2
    with pytest.raises(AssertionError, match="not quantized per row"):
        fp8.linear(q[:1], w, x_scale=scale[:1])


def test_the_probe_s_table_variant_times_the_rule_s_own_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/probes/fp8_probe.py re-splits other tiles along K as the rule would; its ``table``
    variant, the sweep's yardstick, must then be the tiles the engine runs (it split W8A8 decode
    batches by the rule before the one-wave one: qkv in 2, o in 4, where the engine runs 1, 2)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench" / "probes"))
    from fp8_probe import SHAPES, with_split

    for rule in fp8.MATMUL_RULES:
        monkeypatch.setattr(fp8, "MATMUL_RULE", rule)
        for n, k in SHAPES.values():
            for rows in (16, 64, 128):
                tiles = fp8.matmul_tiles(rows, n, k)
                assert with_split(rows, n, k, tiles) == tiles, (rule, n, k, rows)
                grouped = fp8.matmul_tiles(rows, n, k, tile_quant=True)
                assert with_split(rows, n, k, grouped, w8a8=False) == grouped, (rule, n, k, rows)
