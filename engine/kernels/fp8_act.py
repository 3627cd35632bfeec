"""The MLP's FP8 decode batches with down's input quantized where gate/up computes it.

In :func:`pdserve.engine.kernels.fp8.linear`'s W8A8 path (2 to 128 rows) a layer's MLP is
gate/up's product written in bf16 (``[M, 2I]``), then :func:`.fp8_quant.quantize_rows` reading
it back to quantize ``silu(gate) * up`` per row (two launches at 7B: a row of 18,944 columns is
cut in chunks), then down's product. On an H200 at 64 rows those quantizations (o's and down's
inputs) took 12 us a layer of a 3.73 ms step (2026-12-04, ``docs/data/fp8_probe.json``).

Here (:data:`FUSED`, off until measured on a GPU): :func:`gate_up_act` computes a tile of
:data:`GROUP` gate channels and the same up channels in one program (two products over the
same rows of ``x``), and its epilogue writes ``silu(gate) * up`` as FP8 with a scale per row
per :data:`GROUP` columns (DeepSeek-V3's 1 x 128 activation blocks: no pass over a whole row
first, and each block rounded to its own range, finer than one scale a row); down's product
then multiplies each K tile by its block's scales (:func:`.fp8.matmul` with ``x_group_scale``).
The bf16 ``[M, 2I]`` is never written or read again. Bits: those of gate/up's product rounded
to bf16, :func:`.elementwise.silu_mul`, then :func:`pdserve.engine.quant.quantize_groups_fp8`.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import elementwise, fp8, interpreting
from pdserve.engine.quant import FP8, GROUP, Fp8Weight

# Whether the model's MLP takes this path for W8A8 decode batches (not yet timed on a GPU:
# `PROBES=mlp_act bash bench/gpu.sh probes` reads it against the two-launch path, then
# `python bench/gpu_engine.py --quantization fp8 --fp8-fused-act` the engine).
FUSED = False

_round_e4m3 = elementwise.round_e4m3
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _gate_up_act_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    q_ptr,
    s_ptr,
    M,
    N,
    K,
    stride_xm,
    ACT: tl.constexpr,
    WIDEN: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (row block, channel block): gate channels ``rn`` and up channels ``N + rn``
    over rows ``rm``, then ``silu(gate) * up`` quantized per row over these ``BLOCK_N``
    columns (one scale each: ``BLOCK_N`` is the group)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    gate_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    up_rows = w_ptr + (rn + N).to(tl.int64)[:, None] * K
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # channels by rows, as fp8.matmul's
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        wg = tl.load(gate_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wu = tl.load(up_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if WIDEN:  # the interpreter (its FP8 products): FP8 values are exact in float32
            xt = tl.trans(x.to(tl.float32))
            acc_g = tl.dot(wg.to(tl.float32), xt, acc_g)
            acc_u = tl.dot(wu.to(tl.float32), xt, acc_u)
        elif PRECISE:
            acc_g = tl.dot(wg, tl.trans(x), acc_g, max_num_imprecise_acc=BLOCK_K)
            acc_u = tl.dot(wu, tl.trans(x), acc_u, max_num_imprecise_acc=BLOCK_K)
        else:
            acc_g = tl.dot(wg, tl.trans(x), acc_g)
            acc_u = tl.dot(wu, tl.trans(x), acc_u)
    xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[None, :]
    # as fp8.matmul's epilogue writes gate/up (channel scale, then row scale, in the model's
    # dtype ACT) ...
    gate = (acc_g * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[:, None] * xs).to(ACT).to(tl.float32)
    up = (acc_u * tl.load(ws_ptr + N + rn, mask=n_ok, other=0.0)[:, None] * xs).to(ACT).to(tl.float32)
    # ... and elementwise.silu_mul rounds silu(gate), then its product with up
    act = (gate / (1.0 + tl.exp(-gate))).to(ACT).to(tl.float32)
    act = (act * up).to(ACT).to(tl.float32)
    # quant.quantize_groups_fp8: each row's amax over the group mapped to 448
    amax = tl.maximum(tl.max(tl.abs(act), 0), 1e-12)
    q = tl.minimum(tl.maximum(act * tl.math.div_rn(amax * 0.0 + 448.0, amax)[None, :], -448.0), 448.0)
    if WIDEN:
        q = _round_e4m3(q)
    keep = n_ok[:, None] & m_ok[None, :]
    tl.store(
        q_ptr + rm.to(tl.int64)[None, :] * N + rn[:, None],
        q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=keep,
    )
    tl.store(s_ptr + rm.to(tl.int64) * tl.num_programs(1) + pid_n, tl.math.div_rn(amax, 448.0), mask=m_ok)


def act_tiles(rows: int) -> dict[str, Any]:
    """:func:`gate_up_act`'s tiles for ``rows`` of input: rows in one block up to 64 (16 at
    least: the MMA's short side), :data:`GROUP` channels of each of gate and up, K tiles of 128;
    8 warps (two accumulators of 128 by up to 64 rows), 3 stages."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    return {"block_m": block_m, "block_k": 128, "num_warps": 8, "num_stages": 3}


def down_tiles(rows: int, n: int, k: int) -> dict[str, Any]:
    """Down's tiles over :func:`gate_up_act`'s blocks: :func:`.fp8.matmul_tiles`' for its rows
    and shape, K tiles one block wide (:data:`GROUP`), never TMA."""
    tiles = fp8.matmul_tiles(rows, n, k)
    tiles.pop("tma", None)
    return tiles | {"block_k": GROUP}


def gate_up_act(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    w: Fp8Weight,
    block_m: int = 16,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    precise: bool = True,
    act_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` of gate/up's product over rows ``x [M, K]`` (FP8, row scales
    ``x_scale [M]``, as :func:`.elementwise.add_rms_norm_fp8` hands them over) and ``w [2I, K]``
    (gate's channels, then up's), as FP8 blocks: ``q [M, I]`` float8_e4m3fn and ``scale
    [M, ceil(I / GROUP)]`` float32, the bits of :func:`pdserve.engine.quant.quantize_groups_fp8`
    over :func:`.elementwise.silu_mul` of that product in ``act_dtype`` (the model's: the
    two-launch path writes gate/up in it). ``precise``: as :func:`.fp8.matmul`'s."""
    m, k = x.shape
    two_i, kw = w.shape
    assert kw == k and two_i % 2 == 0 and x.dtype == FP8 and x.stride(1) == 1
    assert x_scale.dtype == torch.float32 and x_scale.shape == (m,)
    assert block_m >= 16 and block_k >= 32, "tl.dot's smallest FP8 tiles"
    i = two_i // 2
    groups = triton.cdiv(i, GROUP)
    q = torch.empty((m, i), dtype=FP8, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    _gate_up_act_kernel[(triton.cdiv(m, block_m), groups)](
        x,
        x_scale,
        w.q,
        w.scale,
        q,
        scale,
        m,
        i,
        k,
        x.stride(0),
        ACT=_TL_DTYPES[act_dtype],
        WIDEN=interpreting(),
        PRECISE=precise,
        BLOCK_M=block_m,
        BLOCK_N=GROUP,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return q, scale
