"""Linear layers over FP8 weights (:class:`pdserve.engine.quant.Fp8Weight`).

Three products, by rows of input (:func:`linear`):

- up to ``GEMV_MAX_ROWS`` (batch 1): the GEMV kernel (:mod:`.gemv`) reads the FP8 weights in
  place, converts them in registers and applies each output channel's scale to the sum;
  activations stay as they are (W8A16).
- up to ``BATCHED_MAX_ROWS`` (decode batches): activations quantized per row to FP8 by
  :func:`quantize_rows` (one pass, SiLU·up fused for the down projection), then
  :func:`matmul`, a Triton kernel with wide tiles of output channels that loads its few rows
  of ``x`` once per K tile and multiplies FP8 by FP8 on the tensor cores with float32
  accumulation (W8A8); row scale times column scale in the epilogue. It is written "swapped":
  a program's tile is ``w_tile [BLOCK_N, BLOCK_K] @ x_tile.T``, so the weights' 64
  channels are the MMA's long side and the 16-64 rows its short one. Cut along K when the
  output tiles are too few for the SMs (down: 56 tiles of 64 channels at 7B). The same
  kernel also reads 16-bit activations as they are (W8A16) or quantizes each K tile in
  registers: ``BATCHED_MODE`` picks. The quantization itself: :mod:`.fp8_quant`.
- above (prefill): the same quantization, then ``torch._scaled_mm`` with row-wise scales and
  Hopper's fast accumulation.

Thresholds and tiles as measured by bench/probes/fp8_probe.py on one H200 (2026-12-04).
Nothing falls back: where Triton cannot run, these raise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.engine.kernels import elementwise, gemv, interpreting
from pdserve.engine.kernels.fp8_quant import quantize_rows
from pdserve.engine.quant import FP8, GROUP, Fp8Weight

# On one H200 (bench/probes/fp8_probe.py, 2026-12-04, docs/data/fp8_probe.json): the FP8 GEMV
# is the fastest product at one row and loses from two; the batched W8A8 kernel wins up to 128
# rows (at 128 and more, _scaled_mm, cuBLAS, catches up on gate/up and o).
GEMV_MAX_ROWS = 1
BATCHED_MAX_ROWS = 128
# The batched kernel's activations (the probe times each; "row" was the fastest from 16 rows,
# "tile" 1.9x slower at 64 rows on gate/up: converting x's tiles in every channel tile costs):
# - "tile": W8A8, each K tile of x quantized in registers as the kernel loads it, a scale per
#   row per 128 columns (no launch, no pass over whole rows first; down's SiLU·up computed
#   once by elementwise.silu_mul before, unless TILE_SILU_FUSED: then by every channel tile);
# - "row": W8A8, x quantized per row by quantize_rows first (one more launch, SiLU·up fused);
# - "a16": W8A16, x as it is and each weight converted in registers.
BATCHED_MODES = ("tile", "row", "a16")
BATCHED_MODE = "row"
TILE_SILU_FUSED = False
# The FP8 GEMV at one row: tiles measured per weight shape ``(n, k)`` (bench/probes/fp8_probe.py's
# gemv sweep), else gemv_tiles' rule; and down's SiLU·up read on the fly (else silu_mul first).
GEMV_TILES: dict[tuple[int, int], dict[str, int]] = {}
# The batched kernel's tiles measured per row block and weight shape ``(block_m, n, k)``
# (bench/probes/fp8_probe.py --mm-sweep), else matmul_tiles' rule.
MATMUL_TILES: dict[tuple[int, int, int], dict[str, int]] = {}
# matmul_tiles' rule for W8A8 decode batches: "one-wave" (deep pipelines, split-K within one
# wave of the SMs) or "fill" (the first guess before 2026-12-05: 3-4 stages, split-K until the
# programs fill the SMs), kept so that a benchmark can read both in one run
MATMUL_RULES = ("one-wave", "fill")
MATMUL_RULE = "one-wave"
GEMV_SILU_FUSED = True
# Whether the batched W8A8 kernel reads its weight and activation tiles through Hopper's tensor
# memory accelerator (TMA: one bulk copy a tile, no per-thread addresses or masks) rather than
# per-thread loads: off, measured no faster (an H100 at 64 rows, 2026-12-06: the four products
# within 3% either way, the engine +0.7%, docs/data/fp8_mm_tma_h100.json; Triton's warp
# specialization of the K loop slower with it and not compiled without it).
MATMUL_TMA = False
_SMS = 132
HOPPER_SHARED_MEMORY = 232448
_SHARED_MEMORY: dict[int, int] = {}


def gemv_tiles(rows: int, n: int, k: int) -> dict[str, int]:
    """Tiles of the FP8 GEMV for ``rows`` of input against an ``[n, k]`` weight (at one row:
    :data:`GEMV_TILES`' where it has the shape)."""
    if rows == 1 and (n, k) in GEMV_TILES:
        return dict(GEMV_TILES[(n, k)])
    # One row on an H200 (fp8_probe's sweep, 2026-12-04): 8 channels by 2,048 columns a step,
    # 2.0-3.8 TB/s against 1.7-3.5 at 1,024; a long row (down, 18,944) in steps of 1,024 and cut
    # in four (24.7 us against 31.3 uncut).
    long_k = k > 8192
    if rows < gemv.DOT_FROM_ROWS:
        tiles = {"block_n": 8, "block_k": 1024 if long_k or rows > 1 else 2048, "num_warps": 4, "num_stages": 3}
    else:
        tiles = {"block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 3}
    programs = -(-n // tiles["block_n"])
    target = (8 if long_k and rows == 1 else 2) * _SMS
    split = 1
    while programs * split < target and split < 8 and k // (split * 2) >= tiles["block_k"]:
        split *= 2
    tiles["split_k"] = split
    return tiles


_round_e4m3 = elementwise.round_e4m3


# --- The batched product -----------------------------------------------------------------------


@triton.jit
def _x_tile(x_rows, rk, mask, K, SILU_MUL: tl.constexpr):
    """A ``[BLOCK_M, BLOCK_K]`` tile of ``x`` (``silu(gate) * up``, rounded as
    :func:`.elementwise.silu_mul` rounds it, with ``SILU_MUL``)."""
    if SILU_MUL:
        gate = tl.load(x_rows + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_rows.dtype.element_ty).to(tl.float32)
        return (act * up).to(x_rows.dtype.element_ty)
    return tl.load(x_rows + rk[None, :], mask=mask, other=0.0)


@triton.jit
def _matmul_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    x_desc,
    w_desc,
    ws_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    X_FP8: tl.constexpr,
    TILE_QUANT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    WIDEN: tl.constexpr,
    PRECISE: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    TMA: tl.constexpr,
):
    # axis 0: row blocks, so that the programs sharing a tile of weights run side by side
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    k_start = 0
    k_end = K
    if SPLIT_K > 1:
        per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_start = tl.program_id(2) * per_split
        k_end = tl.minimum(k_start + per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # out.T: channels by rows
    for k0 in tl.range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if TMA:  # whole tiles, zeros past the tensors' ends (a split's range is whole K tiles)
            w = w_desc.load([pid_n * BLOCK_N, k0])
            x = x_desc.load([pid_m * BLOCK_M, k0])
        elif EVEN_K:
            if EVEN_N:
                w = tl.load(w_rows + rk[None, :])
            else:
                w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None], other=0.0)
            x = _x_tile(x_rows, rk, m_ok[:, None], K, SILU_MUL)
        else:
            k_ok = rk < k_end
            w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = _x_tile(x_rows, rk, m_ok[:, None] & k_ok[None, :], K, SILU_MUL)
        if TILE_QUANT:  # x quantized here, a scale per row of this K tile (quant.quantize_groups_fp8)
            xf = x.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xf), 1), 1e-12)
            xq = tl.minimum(tl.maximum(xf * tl.math.div_rn(amax * 0.0 + 448.0, amax)[:, None], -448.0), 448.0)
            if WIDEN:
                part = tl.dot(w.to(tl.float32), tl.trans(_round_e4m3(xq).to(w_ptr.dtype.element_ty).to(tl.float32)))
            else:
                part = tl.dot(w, tl.trans(xq.to(w_ptr.dtype.element_ty, fp_downcast_rounding="rtne")))
            acc += part * tl.math.div_rn(amax, 448.0)[None, :]
        elif WIDEN:  # the interpreter (its bf16 products are wrong); FP8 values are exact in float32
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc)
        elif not X_FP8:  # W8A16: the weights converted in registers
            acc = tl.dot(w.to(x_ptr.dtype.element_ty), tl.trans(x), acc)
        elif PRECISE:  # Hopper's FP8 MMA accumulates in fewer bits: into float32 each tile
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    keep = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K > 1:
        # [SPLIT_K, M, N] partial sums; the last program of this tile adds them (as gemv.py)
        part = part_ptr + rm[None, :] * N + rn[:, None]
        tl.store(part + tl.program_id(2) * M * N, acc, mask=keep)
        tl.debug_barrier()
        counter = counter_ptr + pid_n * tl.num_programs(0) + pid_m
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for j in tl.static_range(SPLIT_K):  # in split order: the sum does not depend on who came last
                acc += tl.load(part + j * M * N, mask=keep, other=0.0, cache_modifier=".cg")
            _matmul_store(
                acc, xs_ptr, ws_ptr, b_ptr, out_ptr, rm, rn, m_ok, n_ok, keep, stride_om, X_FP8, HAS_BIAS, HAS_SCALE
            )
            tl.atomic_xchg(counter, 0)  # ready for the next launch (and the next graph replay)
    else:
        _matmul_store(
            acc, xs_ptr, ws_ptr, b_ptr, out_ptr, rm, rn, m_ok, n_ok, keep, stride_om, X_FP8, HAS_BIAS, HAS_SCALE
        )


@triton.jit
def _matmul_store(
    acc,
    xs_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    rm,
    rn,
    m_ok,
    n_ok,
    keep,
    stride_om,
    X_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    """``out[rm, rn] = acc.T * channel scale (* row scale) (+ bias)``."""
    if HAS_SCALE:
        acc = acc * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[:, None]
    if X_FP8:
        acc = acc * tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=keep)


def matmul_tiles(rows: int, n: int, k: int, tile_quant: bool = False, x_bytes: int = 1) -> dict[str, int]:
    """Tiles of :func:`matmul` for ``rows`` of input against an ``[n, k]`` weight
    (:data:`MATMUL_TILES`' where it has the row block and shape). One block of rows up to 64
    (16 at least: the MMA's short side), two or more of 64 above; 64 channels a program.
    W8A8 in one row block (``x_bytes`` 1, decode batches): K tiles of 256 in as many stages
    as shared memory holds, up to 5, where the programs are one wave of the SMs, cut along K
    only while they stay within it (qkv at 7B: 72 tiles, no split; o and down 56, 2 splits);
    3 stages where there are more (gate/up: 592 tiles). On an H100 (bench/probes/fp8_probe.py
    --mm-sweep, 2026-12-05, docs/data/fp8_mm_sweep_h100.json, ..._rows_h100.json) the tiles
    of this rule took a 7B layer's four products at 64 rows from 115 to 107 us (the best swept:
    106; at 16 and 32 rows 96 and 99 against 99 and 104), qkv and o most (split-K's partial
    sums and shallow pipelines cost them 20-30 %). Else
    (16-bit activations ``x_bytes`` 2, more rows, ``tile_quant``: K tiles of
    :data:`quant.GROUP`): K tiles of 256 while the row tile is small, 128 above, and cut along
    K until the programs fill the SMs once. With :data:`MATMUL_TMA`, W8A8's tiles are read by
    TMA where the rows are whole 16-byte units (``k`` a multiple of 16)."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    # TMA where asked (MATMUL_TMA) for W8A8 over rows of whole 16-byte units (a tile setting)
    tma = {"tma": True} if MATMUL_TMA and x_bytes == 1 and not tile_quant and k % 16 == 0 else {}
    if not tile_quant and (block_m, n, k) in MATMUL_TILES:
        return {"block_m": block_m, **tma, **MATMUL_TILES[(block_m, n, k)]}
    block_n = 64  # 64 beat 128 and 256 from 1 to 128 rows on every 7B projection (fp8_probe, 2026-12-04)
    programs = -(-rows // block_m) * -(-n // block_n)
    if rows <= 64 and not tile_quant and x_bytes == 1 and MATMUL_RULE == "one-wave":
        block_k = 256
        split = split_k(programs, k, block_k, one_wave=True)
        # one wave: a program an SM, its pipeline as deep as shared memory holds; more (gate/up):
        # 3 stages, two programs an SM
        most = 5 if programs * split <= _SMS else 3
        stages = max(2, min(most, (shared_memory() - 16384) // ((block_m + block_n) * 256)))
        tiles = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": stages}
        return tiles | {"split_k": split} | tma
    block_k = GROUP if tile_quant else 256 if block_m <= 32 else 128
    tiles = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4}
    tiles["num_stages"] = 3 if block_k == 256 else 4
    return tiles | {"split_k": split_k(programs, k, block_k)} | tma


def split_k(programs: int, k: int, block_k: int, one_wave: bool = False) -> int:
    """Splits along K for ``programs`` output tiles, each split at least two K tiles: doubled
    until the programs fill the SMs once (``one_wave``: while they stay within one wave)."""
    split = 1
    while (programs * split * 2 <= _SMS if one_wave else programs * split < _SMS) and split < 8:
        if k // (split * 2) < 2 * block_k:
            break
        split *= 2
    return split


def shared_memory() -> int:
    """Bytes of shared memory a program may use on the current GPU (an H100's or H200's where
    there is none: the interpreter's tiles do not matter)."""
    if not torch.cuda.is_available():
        return HOPPER_SHARED_MEMORY
    device = torch.cuda.current_device()
    if device not in _SHARED_MEMORY:
        props = torch.cuda.get_device_properties(device)
        _SHARED_MEMORY[device] = int(getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block))
    return _SHARED_MEMORY[device]


def matmul(
    x: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    silu_mul_input: bool = False,
    block_m: int = 16,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    split_k: int = 1,
    precise: bool = True,
    tile_quant: bool = False,
    tma: bool = False,
) -> torch.Tensor:
    """``x @ (w.q * w.scale[:, None]).T (+ bias)`` for a few to a few hundred rows, one program
    per tile of ``block_n`` output channels and ``block_m`` rows (``x``'s tile loaded once per
    K tile), on the tensor cores with float32 sums. Tiles: :func:`matmul_tiles`.

    W8A8, with ``x_scale``: ``x [M, K]`` float8_e4m3fn and ``x_scale [M]`` float32 from
    :func:`quantize_rows` (the product of ``x * x_scale[:, None]``), FP8 by FP8; ``precise``:
    the sums go into a float32 accumulator every K tile (off: Hopper's FP8 MMA accumulates a
    whole split in its narrower format, faster, as ``_scaled_mm``'s ``use_fast_accum``).
    Without: ``x [M, K]`` in 16 bits (``[M, 2K]`` read as ``silu(gate) * up`` with
    ``silu_mul_input``). ``tile_quant``: each ``[block_m, block_k]`` tile of ``x`` quantized
    to FP8 in registers as it is loaded, one scale per row of the tile (``block_k`` is
    :data:`quant.GROUP`; the reference is :func:`quant.quantize_groups_fp8`), FP8 by FP8
    into a fresh float32 sum each tile, times those scales: W8A8 with no quantization launch
    and no pass over whole rows first. Otherwise W8A16: the weights converted to ``x``'s
    dtype in registers.
    ``out_dtype``: by default ``x``'s (bf16 for FP8 ``x``). ``tma`` (W8A8 only): the tiles of
    ``w`` and ``x`` read by the tensor memory accelerator (:data:`MATMUL_TMA`); both need rows
    16-byte aligned."""
    m = x.shape[0]
    k = w.shape[1]
    fp8_x = x_scale is not None
    assert x.stride(1) == 1 and x.shape[1] == (2 * k if silu_mul_input else k)
    if fp8_x:
        assert x.dtype == FP8 and not silu_mul_input, "W8A8 reads quantized rows (quantize_rows fuses SiLU·up)"
        assert x_scale.dtype == torch.float32 and x_scale.shape == (m,)  # type: ignore[union-attr]
    else:
        assert x.dtype != FP8, "FP8 activations need their row scales"
    assert not tile_quant or (not fp8_x and block_k == GROUP), f"tile_quant: 16-bit x, block_k {GROUP}"
    assert block_m >= 16 and block_n >= 16 and block_k >= 32, "tl.dot's smallest FP8 tiles"
    if out_dtype is None:
        out_dtype = torch.bfloat16 if fp8_x else x.dtype
    if tma:
        assert fp8_x, "TMA reads FP8 rows (W8A8)"
        for t, name in ((x, "x"), (w.q, "w")):
            if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
                raise ValueError(f"TMA needs {name}'s rows 16-byte aligned: stride {t.stride(0)}, at {t.data_ptr():#x}")
    tiles = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "split_k": split_k}
    tiles |= {"num_warps": num_warps, "num_stages": num_stages}
    if tma:
        tiles["tma"] = True
    return _launch(x, x_scale, w.q, w.scale, bias, out_dtype, silu_mul_input, tiles, precise, tile_quant)


def _launch(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    silu_mul_input: bool,
    t: dict[str, int],
    precise: bool = True,
    tile_quant: bool = False,
) -> torch.Tensor:
    """:func:`_matmul_kernel` over ``x [M, K]`` and ``w [N, K]`` at tiles ``t`` (scales where given)."""
    m, (n, k) = x.shape[0], w.shape
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, t["block_m"]), triton.cdiv(n, t["block_n"]), t["split_k"])
    if t["split_k"] > 1:
        part = torch.empty((t["split_k"], m, n), dtype=torch.float32, device=x.device)
        counters = gemv.split_counters(x.device, grid[0] * grid[1])
    else:
        part, counters = out, out
    x_desc: object = x
    w_desc: object = w
    if t.get("tma"):  # (built a call: a descriptor holds its tensor's address)
        x_desc = TensorDescriptor.from_tensor(x, [t["block_m"], t["block_k"]])
        w_desc = TensorDescriptor.from_tensor(w, [t["block_n"], t["block_k"]])
    _matmul_kernel[grid](
        x,
        x_scale if x_scale is not None else out,
        w,
        x_desc,
        w_desc,
        w_scale if w_scale is not None else out,
        bias if bias is not None else out,
        out,
        part,
        counters,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        X_FP8=x_scale is not None,
        TILE_QUANT=tile_quant,
        SILU_MUL=silu_mul_input,
        HAS_BIAS=bias is not None,
        HAS_SCALE=w_scale is not None,
        WIDEN=interpreting(),
        PRECISE=precise,
        EVEN_N=n % t["block_n"] == 0,
        EVEN_K=k % (t["block_k"] * t["split_k"]) == 0,
        BLOCK_M=t["block_m"],
        BLOCK_N=t["block_n"],
        BLOCK_K=t["block_k"],
        SPLIT_K=t["split_k"],
        TMA=bool(t.get("tma")),
        num_warps=t["num_warps"],
        num_stages=t["num_stages"],
    )
    return out


# Prefill's GEMMs with Hopper's fast FP8 accumulation (partial sums kept in the tensor cores'
# narrower accumulator across K, as vLLM's CUTLASS FP8 kernels do). On one H200 (2026-12-04,
# docs/data/fp8_probe.json, gpu_engine_fp8.json): a 4,096-token prefill 60.6 ms against 68.9,
# for 0.12% more relative error (0.38% for down's 18,944 columns) beside the 2.6% of the FP8
# rounding itself.
SCALED_MM_FAST_ACCUM = True


def scaled_mm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool | None = None,
) -> torch.Tensor:
    """The library's W8A8 GEMM (cuBLAS on a GPU) over :func:`quantize_rows`' output
    (``fast_accum``: default :data:`SCALED_MM_FAST_ACCUM`; a GPU only). A bias in the output's
    dtype is added in the GEMM's epilogue (a separate add read and wrote qkv's whole output
    again: 1.4 ms of a 4,096-token prefill at 7B, 28 launches of 50 us on an H200)."""
    fast = SCALED_MM_FAST_ACCUM if fast_accum is None else fast_accum
    fused = bias is not None and bias.dtype == out_dtype
    out = torch._scaled_mm(
        xq,
        w.q.t(),
        bias=bias if fused else None,
        scale_a=x_scale[:, None],
        scale_b=w.scale[None, :],
        out_dtype=out_dtype,
        use_fast_accum=fast and xq.is_cuda,
    )
    return out if bias is None or fused else out + bias


def takes_quantized_rows(
    rows: int, gemv_max_rows: int = GEMV_MAX_ROWS, batched_max_rows: int = BATCHED_MAX_ROWS
) -> bool:
    """Whether :func:`linear` quantizes ``rows`` of input per row (FP8 with a scale each):
    then a producer that holds whole rows (the RMSNorm: ``elementwise.add_rms_norm_fp8``) may
    hand them over quantized, and the launch of :func:`quantize_rows` is saved."""
    return rows > gemv_max_rows and (rows > batched_max_rows or BATCHED_MODE == "row")


def linear(
    x: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None = None,
    silu_mul_input: bool = False,
    gemv_max_rows: int = GEMV_MAX_ROWS,
    batched_max_rows: int = BATCHED_MAX_ROWS,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``x @ (w.q * w.scale).T + bias`` in ``x``'s dtype (``x`` read as ``silu(gate) * up``
    with ``silu_mul_input``: ``[M, 2K]``). Up to ``gemv_max_rows`` rows the FP8 GEMV
    (activations as they are); up to ``batched_max_rows`` rows :func:`matmul` (activations
    quantized as :data:`BATCHED_MODE` says); above, quantized per row by :func:`quantize_rows`
    and ``torch._scaled_mm``. With ``x_scale``, ``x`` is already quantized per row (FP8, where
    :func:`takes_quantized_rows`) and the product is in ``out_dtype``."""
    rows = x.shape[0]
    n, k = w.shape
    if x_scale is not None:
        assert x.dtype == FP8 and not silu_mul_input, "quantized rows are FP8 with SiLU·up applied"
        assert takes_quantized_rows(rows, gemv_max_rows, batched_max_rows), f"{rows} rows are not quantized per row"
        if rows <= batched_max_rows:
            return matmul(x, w, bias, x_scale, out_dtype, **matmul_tiles(rows, n, k))  # type: ignore[arg-type]
        return scaled_mm(x, x_scale, w, bias, out_dtype)
    if rows == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if rows <= gemv_max_rows:
        if silu_mul_input and not GEMV_SILU_FUSED:
            x, silu_mul_input = elementwise.silu_mul(x), False
        return gemv.gemv(
            x, w.q, bias, silu_mul_input=silu_mul_input, scale=w.scale, **gemv.model_tiles(gemv_tiles(rows, n, k))
        )
    if BATCHED_MODE not in BATCHED_MODES:
        raise ValueError(f"fp8.BATCHED_MODE is {BATCHED_MODE!r}, not one of {BATCHED_MODES}")
    if rows <= batched_max_rows and BATCHED_MODE == "a16":
        tiles = matmul_tiles(rows, n, k, x_bytes=x.element_size())
        return matmul(x, w, bias, silu_mul_input=silu_mul_input, **tiles)  # type: ignore[arg-type]
    if rows <= batched_max_rows and BATCHED_MODE == "tile":
        if silu_mul_input and not TILE_SILU_FUSED:
            x, silu_mul_input = elementwise.silu_mul(x), False
        tiles = matmul_tiles(rows, n, k, tile_quant=True)
        return matmul(x, w, bias, silu_mul_input=silu_mul_input, tile_quant=True, **tiles)  # type: ignore[arg-type]
    xq, x_scale = quantize_rows(x, silu_mul_input)
    if rows <= batched_max_rows:
        return matmul(xq, w, bias, x_scale, x.dtype, **matmul_tiles(rows, n, k))  # type: ignore[arg-type]
    return scaled_mm(xq, x_scale, w, bias, x.dtype)
