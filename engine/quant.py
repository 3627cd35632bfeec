"""FP8 (float8_e4m3fn) weights: one scale per output channel, computed from the weights.

A weight ``w [N, K]`` is held as ``q [N, K]`` in float8_e4m3fn and ``scale [N]`` in float32
with ``w ~= q * scale[:, None]``; each row's largest magnitude maps to e4m3's largest finite
value, 448. Plain torch: the kernels that read ``q`` in place live in
:mod:`pdserve.engine.kernels`, and the quality script (``bench/fp8_quality.py``) runs the
same rounding on the CPU.

Also here: the KV cache's FP8 scheme (:func:`quantize_kv_fp8`, one power-of-two float32 scale
per (page, layer, K|V, head) block) and FP8 checkpoints' weights turned into :class:`Fp8Weight`
(:func:`fp8_weight_from_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# A row of zeros keeps a scale of 1 (any scale reproduces it); this floor keeps 1 / scale finite.
_MIN_AMAX = 1e-12


@dataclass(frozen=True)
class Fp8Weight:
    """``q`` float8_e4m3fn ``[N, K]`` and ``scale`` float32 ``[N]``: ``w ~= q * scale[:, None]``."""

    q: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.q.dtype != FP8:
            raise ValueError(f"an FP8 weight is float8_e4m3fn, not {self.q.dtype}")
        if self.q.dim() != 2 or self.scale.shape != (self.q.shape[0],) or self.scale.dtype != torch.float32:
            raise ValueError(
                f"scale must be float32 [{self.q.shape[0]}], got {self.scale.dtype} {list(self.scale.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """``w [N, K]`` (any float dtype) as FP8 with per-output-channel scales (round to nearest even,
    no saturation needed: every value is at most its row's amax)."""
    if w.dim() != 2:
        raise ValueError(f"FP8 weights are matrices, got shape {list(w.shape)}")
    w32 = w.detach().to(torch.float32)
    amax = w32.abs().amax(dim=1).clamp_min(_MIN_AMAX)
    scale = _over_fp8_max(amax)
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q=q.contiguous(), scale=scale.contiguous())


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x [M, K]`` as FP8 with one float32 scale per row (per token): ``q [M, K]``
    float8_e4m3fn and ``scale [M]`` with ``x ~= q * scale[:, None]``, each row's amax mapped to
    448 (a row of zeros keeps the floor's scale). The scheme of the W8A8 products; the kernel
    that does it in one pass is :func:`pdserve.engine.kernels.fp8.quantize_rows`, and this is
    its reference (plain torch: every rounding the same)."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"activations to quantize per row are [rows, K > 0], got shape {list(x.shape)}")
    scale = _over_fp8_max(x.detach().abs().amax(dim=1).to(torch.float32).clamp_min(_MIN_AMAX))
    q = (x.detach().to(torch.float32) / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), scale.contiguous()


def _over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` correctly rounded on every device: on CUDA, torch divides by a Python
    scalar as a product with its reciprocal (a last-bit difference from the kernels'
    ``div_rn`` for about half of all values); a tensor divisor takes the true division."""
    return amax / torch.full_like(amax, FP8_MAX)


# The columns of a group in :func:`quantize_groups_fp8`: one K tile of the batched kernel.
GROUP = 128


def quantize_groups_fp8(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x [M, K]`` as FP8 with one float32 scale per row per ``group`` columns
    (DeepSeek-V3's 1 x 128 activation blocks): ``q [M, K]`` float8_e4m3fn and ``scale
    [M, ceil(K / group)]``, ``x[:, j] ~= q[:, j] * scale[:, j // group]``, each group's amax
    mapped to 448 (a group of zeros keeps the floor's scale). No pass over a whole row comes
    first, so the batched kernel quantizes each K tile of ``x`` in registers as it loads it
    (:func:`pdserve.engine.kernels.fp8.matmul` without ``x_scale``, ``tile_quant``): this
    is that kernel's reference, every rounding the same (values times ``448 / amax``, both
    correctly rounded in float32; the scale ``amax / 448``)."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"activations to quantize per group are [rows, K > 0], got shape {list(x.shape)}")
    rows, k = x.shape
    groups = -(-k // group)
    x32 = torch.zeros((rows, groups * group), dtype=torch.float32, device=x.device)
    x32[:, :k] = x.detach().to(torch.float32)
    blocks = x32.view(rows, groups, group)
    amax = blocks.abs().amax(dim=2).clamp_min(_MIN_AMAX)
    inv = torch.full_like(amax, FP8_MAX) / amax
    q = (blocks * inv[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, groups * group)[:, :k]
    return q.contiguous(), _over_fp8_max(amax).contiguous()


# --- The KV cache: one power-of-two scale per (page, layer, K|V, head) block ---------------

# The dtype of the KV scales; each block of a page holds one after its values (see quantize_kv_fp8).
KV_SCALE_DTYPE = torch.float32


def kv_block_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale of a KV block whose largest magnitude is ``amax`` (float32): ``amax / 448``
    (correctly rounded, floored at 1e-12 / 448) rounded up to a power of two, so that every value
    of the block divided by it lies within e4m3's +-448. The kernels compute the same bits
    (``bits + 0x7FFFFF`` with the mantissa cleared: the next power of two of a positive normal)."""
    t = _over_fp8_max(amax.to(torch.float32).clamp_min(_MIN_AMAX))
    return ((t.view(torch.int32) + 0x7FFFFF) & -0x800000).view(torch.float32)


def quantize_kv_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of keys (after rotary) or values ``x [..., tokens, head_dim]``, each stored at once
    into an empty block, as ``(q, scale)``: ``q`` float8_e4m3fn of ``x``'s shape and ``scale``
    float32 ``x.shape[:-2]``, one per block, ``x ~= q * scale[..., None, None]``, the scale
    :func:`kv_block_scale` of the block's amax.

    Why one scale per (page, layer, K|V, head) and a power of two: a block of ``page_size``
    tokens takes ``page_size * head_dim`` bytes and one 4-byte scale, 1.996x bf16's tokens per
    byte at head_dim 128, 1.992x at 64 (a scale per token: 1.94x and 1.88x). A page fills a token (or
    a chunk) at a time, so its scale grows as larger tokens arrive: the store takes the larger
    of the block's scale and the new tokens' (:func:`store_kv_fp8_blocks`) and re-encodes the
    tokens already there by the ratio, a power of two: an exponent shift, exact while a value
    stays in e4m3's normal range (only values that fall below 2^-6 of the new scale round
    again). The quality equals a scale per token's: e4m3's relative step is the same in every
    binade, and a block of one head's tokens spans far less than the normal range's 2^15
    (``bench/fp8_quality.py``). A block of a page shared by prefix caching is full and never
    changes; a partly filled one belongs to one sequence."""
    if x.dim() < 2 or x.shape[-1] == 0:
        raise ValueError(f"KV blocks need [..., tokens, head_dim], got shape {list(x.shape)}")
    x32 = x.detach().to(torch.float32)
    scale = kv_block_scale(x32.abs().amax(dim=(-2, -1)))
    q = (x32 / scale[..., None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), scale.contiguous()


def dequantize_kv_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q * scale[..., None, None]`` in ``dtype``: the inverse of :func:`quantize_kv_fp8`
    (``q [..., tokens, head_dim]``, ``scale [...]``, one per block)."""
    if q.dtype != FP8:
        raise ValueError(f"FP8 KV is float8_e4m3fn, not {q.dtype}")
    if scale.dtype != KV_SCALE_DTYPE or scale.shape != q.shape[:-2]:
        raise ValueError(f"KV scales must be float32 {list(q.shape[:-2])}, got {scale.dtype} {list(scale.shape)}")
    return (q.to(torch.float32) * scale[..., None, None]).to(dtype)


def store_kv_fp8_blocks(
    values: torch.Tensor, scales: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor
) -> None:
    """Vectors ``x [N, head_dim]`` stored into FP8 KV blocks, row ``i`` at ``offsets[i]`` of block
    ``blocks[i]`` of ``values [num_blocks, page_size, head_dim]`` (float8_e4m3fn, or its bytes)
    with ``scales [num_blocks]`` (float32): what the Triton stores write, bit for bit.

    A block's rows in one call are consecutive offsets from its first, ``f``; the tokens at
    offsets below ``f`` are the block's (a block written from offset 0 has none, whatever its
    scale held). The block's scale becomes the larger of its scale (when it has tokens) and
    :func:`kv_block_scale` of the new rows' amax; where that grew, the tokens below ``f`` are
    re-encoded, ``q * old / new`` rounded to e4m3 (exact but for values that turn subnormal),
    then the new rows are quantized by it."""
    if x.dim() != 2 or blocks.shape != offsets.shape or blocks.shape[0] != x.shape[0]:
        raise ValueError(f"rows [N, head_dim] with N blocks and offsets, got {list(x.shape)}")
    if x.shape[0] == 0:
        return
    q_all = values.view(torch.uint8)
    page = q_all.shape[1]
    uniq, inv = torch.unique(blocks, return_inverse=True)
    n = uniq.shape[0]
    first = torch.full((n,), page, dtype=offsets.dtype, device=x.device).scatter_reduce(0, inv, offsets, "amin")
    x32 = x.detach().to(torch.float32)
    amax = torch.zeros(n, dtype=torch.float32, device=x.device).scatter_reduce(0, inv, x32.abs().amax(1), "amax")
    had = first > 0
    old = torch.where(had, scales[uniq], torch.zeros_like(amax))
    new = torch.maximum(kv_block_scale(amax), old)
    grow = (had & (new > old)).nonzero().view(-1)
    if grow.numel():
        ids = uniq[grow]
        held = q_all[ids]  # [G, page, dim] bytes
        below = (torch.arange(page, device=x.device)[None, :] < first[grow][:, None])[:, :, None]
        f = old[grow][:, None, None]
        t = new[grow][:, None, None]
        again = ((held.view(FP8).to(torch.float32) * f) / t).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
        q_all[ids] = torch.where(below, again, held)
    q = (x32 / new[inv][:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q_all[blocks, offsets] = q.view(torch.uint8)
    scales[uniq] = new


_ROTATIONS: dict[tuple[int, torch.dtype, str], tuple[torch.Tensor, int]] = {}


def kv_key_rotation(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, int]:
    """``(H, p)``: the rotation of queries and keys before an FP8 pool: ``H [head_dim, head_dim]``
    of +-1 (Sylvester Hadamard blocks of size ``p``, the largest power of two dividing
    ``head_dim``), symmetric with ``H @ H = p * I``. Keys are stored as ``k @ H`` and queries
    attend as ``q @ H / p``: every score ``q . k`` is unchanged, and a key's outlier channels are
    spread over all of them, so a block's one power-of-two scale rounds every value alike
    (without it a per-block scale costs the keys' largest values their exactness: on the
    default model the KV's KL against bf16 0.0170 nats against 0.0081 rotated, 0.0108 for a
    float32 scale per token; ``bench/fp8_quality.py``)."""
    key = (head_dim, dtype, str(device))
    if key not in _ROTATIONS:
        p = head_dim & -head_dim
        h = torch.ones(1, 1)
        while h.shape[0] < p:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        _ROTATIONS[key] = (torch.block_diag(*[h] * (head_dim // p)).to(dtype=dtype, device=device), p)
    return _ROTATIONS[key]


def rotate_queries_keys(
    q: torch.Tensor | None, k: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(q @ H / p, k @ H)`` of :func:`kv_key_rotation` over the last dimension, in their dtype
    (the product accumulated in float32, then rounded once; ``1 / p`` a power of two)."""
    ref = q if q is not None else k
    assert ref is not None
    h, p = kv_key_rotation(ref.shape[-1], ref.dtype, ref.device)
    return (None if q is None else (q @ h) * (1.0 / p)), (None if k is None else k @ h)


def rotate_qk_(qk: torch.Tensor, num_q: int) -> None:
    """:func:`rotate_queries_keys` in place on ``qk [tokens, num_q + num_kv, head_dim]`` (a view
    of the fused qkv projection's rows): the queries' heads first, then the keys'."""
    h, p = kv_key_rotation(qk.shape[-1], qk.dtype, qk.device)
    rotated = qk @ h
    rotated[:, :num_q] *= 1.0 / p
    qk.copy_(rotated)


def kv_bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, fp8: bool) -> int:
    """Bytes of the pool one page of ``page_size`` tokens takes, all layers' K and V: bf16, or FP8
    values with a 4-byte scale per (layer, K|V, head) block."""
    per_block = page_size * head_dim + KV_SCALE_DTYPE.itemsize if fp8 else 2 * page_size * head_dim
    return num_layers * 2 * num_kv_heads * per_block


# --- FP8 checkpoints: their scales as per-output-channel ones ---------------------------------

# config.json's quantization_config ``quant_method`` values read by fp8_weight_from_checkpoint.
CHECKPOINT_FORMATS = ("fp8", "compressed-tensors")


def fp8_weight_from_scaled(
    q: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None = None
) -> Fp8Weight:
    """An FP8 checkpoint's weight ``q [N, K]`` with ``w = q * scale`` as an :class:`Fp8Weight`.

    ``scale`` is per tensor (one value: shape ``[]``, ``[1]`` or ``[1, 1]``) or per output
    channel (``[N]`` or ``[N, 1]``): both exact, ``q`` kept and the scale broadcast to float32
    ``[N]``. With ``block_size (bn, bk)`` it is per block, ``[ceil(N / bn), ceil(K / bk)]``: each
    row takes the largest scale of its blocks and every value is rounded again to that grid
    (``q * block_scale / row_scale``). The blocks holding that largest scale, and so every row
    whose blocks share one scale, come back unchanged, as do blocks whose scale is the row's
    over a power of two (subnormals aside); the others lose resolution: at most half an e4m3 step (6.25% relative) more
    where a value stays in e4m3's normal range at the row's scale, more for values below it.
    (Quantizing the dequantized row afresh, amax / 448, would round every block again whenever
    the row's largest ``q`` is not 448.)"""
    if q.dtype != FP8:
        hint = " (float8_e5m2 weights are not supported)" if q.dtype == torch.float8_e5m2 else ""
        raise ValueError(f"an FP8 checkpoint weight is float8_e4m3fn, not {q.dtype}{hint}")
    if q.dim() != 2:
        raise ValueError(f"FP8 weights are matrices, got shape {list(q.shape)}")
    n, k = q.shape
    scale32 = scale.detach().to(torch.float32)
    if block_size is not None:
        bn, bk = block_size
        blocks = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != blocks:
            raise ValueError(
                f"a block-scaled [{n}, {k}] weight with blocks of {list(block_size)} needs scales "
                f"{list(blocks)}, got {list(scale.shape)}"
            )
        full = scale32.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        row_scale = full.amax(dim=1).clamp_min(_MIN_AMAX / FP8_MAX)
        requantized = (q.to(torch.float32) * (full / row_scale[:, None])).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return Fp8Weight(q=requantized.contiguous(), scale=row_scale.contiguous())
    if scale.numel() == 1 and scale.dim() <= 2:
        return Fp8Weight(q=q.contiguous(), scale=scale32.reshape(1).expand(n).contiguous())
    if tuple(scale.shape) in ((n,), (n, 1)):
        return Fp8Weight(q=q.contiguous(), scale=scale32.reshape(n).contiguous())
    raise ValueError(
        f"a [{n}, {k}] FP8 weight needs a scale per tensor ([1]) or per channel ([{n}] or [{n}, 1]), "
        f"or a block_size, got {list(scale.shape)}"
    )


def fp8_weight_from_checkpoint(
    tensors: Mapping[str, torch.Tensor], prefix: str, quantization_config: Mapping[str, Any]
) -> Fp8Weight:
    """The linear layer ``prefix`` (``"model.layers.0.mlp.up_proj"``) of an FP8 checkpoint as an
    :class:`Fp8Weight`, from its tensors by name and config.json's ``quantization_config``.

    - ``quant_method: "fp8"`` (transformers' fine-grained FP8: DeepSeek-V3, Qwen3-FP8):
      ``weight_scale_inv`` per block of ``weight_block_size`` (default ``[128, 128]``), the
      multiplier despite its name; or ``weight_scale`` per tensor or channel (AutoFP8, vLLM's).
    - ``quant_method: "compressed-tensors"`` with 8-bit float weights: ``weight_scale`` per
      tensor (``strategy: tensor``), channel (``channel``) or block (``block``,
      ``block_structure``).

    Activation scales (``input_scale``) are not read: activations are scaled per token at run
    time. Layers the checkpoint leaves unquantized (its ``ignore`` / ``modules_to_not_convert``
    list, the LM head) are the caller's to skip; asking for one raises ``ValueError``."""
    method = quantization_config.get("quant_method")
    weight = _tensor(tensors, f"{prefix}.weight")
    if weight.dtype != FP8:
        raise ValueError(f"{prefix}.weight is {weight.dtype}, not float8_e4m3fn: not an FP8 layer of this checkpoint")
    if method == "fp8":
        if f"{prefix}.weight_scale_inv" in tensors:
            block = quantization_config.get("weight_block_size") or (128, 128)
            return fp8_weight_from_scaled(weight, tensors[f"{prefix}.weight_scale_inv"], (int(block[0]), int(block[1])))
        return fp8_weight_from_scaled(weight, _tensor(tensors, f"{prefix}.weight_scale"))
    if method == "compressed-tensors":
        scheme = _compressed_tensors_weights(quantization_config)
        scale = _tensor(tensors, f"{prefix}.weight_scale")
        if scheme.get("strategy") == "block":
            block = scheme.get("block_structure") or (128, 128)
            return fp8_weight_from_scaled(weight, scale, (int(block[0]), int(block[1])))
        return fp8_weight_from_scaled(weight, scale)
    raise ValueError(f"quant_method {method!r} is not an FP8 checkpoint format ({', '.join(CHECKPOINT_FORMATS)})")


def _tensor(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise ValueError(f"the checkpoint has no tensor {name}") from None


def _compressed_tensors_weights(quantization_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The weights scheme of a compressed-tensors config's (single) group; it must be FP8."""
    groups = list((quantization_config.get("config_groups") or {}).values())
    if len(groups) != 1 or not isinstance(groups[0].get("weights"), Mapping):
        raise ValueError(f"a compressed-tensors config with one weights scheme is supported, got {len(groups)} groups")
    weights: Mapping[str, Any] = groups[0]["weights"]
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(
            f"compressed-tensors weights of type {weights.get('type')!r} with {weights.get('num_bits')} bits are not FP8"
        )
    return weights
