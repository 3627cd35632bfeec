"""What one step of pdserve's CPU pass (:mod:`.llama_cpu`) computes where: the projections
as oneDNN wants them (:func:`pack`), decodes in groups of similar length (:class:`DecodeGroup`),
prefill chunks (:class:`Chunk`), and what every layer of the step shares (:class:`Plan`): the
rows of the page pool each layer gathers (:func:`page_rows`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.engine.models.llama_weights import Weight

# Decodes attend in groups of similar length, each padded to its longest: a group takes
# sequences (longest first) while it has fewer than this many or padding stays under 2x.
MIN_GROUP = 8
# Decode groups of at least this many sequences over a bfloat16 pool attend as two matmuls
# (LlamaFamilyCPU.decode_matmuls): a SmolLM2 step at batch 8 35.0 ms against float32 SDPA's
# 51.7, at 16 50.8 against 55.0; at batch 1 and 4 SDPA is ahead by 1.0 and 0.7 ms (2026-12-04,
# bench/probes/cpu_decode_step.py on this 2-core machine).
MATMUL_MIN_BATCH = 8
# Prefill chunks whose context is at most this many tokens attend through the native kernel
# (native.paged_prefill, under --cpu-attention native/auto), longer ones through torch's SDPA:
# SmolLM2's heads, 2 cores (2026-12-04): a 256-token prompt 0.88 ms a layer against SDPA's
# 1.25, 512 3.1 against 4.8, 1,024 11.6 against 12.5, 2,048 45 against 42 (its rows stream
# the whole transposed K and V from L2 each).
NATIVE_PREFILL_MAX_CTX = 1024


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN serves matmuls of ``dtype`` from weights reordered once."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class Linear:
    """One projection: the weight as oneDNN wants it (or as it is) and its bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack(weight: Weight, bias: torch.Tensor | None = None) -> Linear:
    """``weight`` reordered for oneDNN where it can be (a copy: the stock modules keep theirs)."""
    if not isinstance(weight, torch.Tensor):  # the runner refuses --quantization fp8 on this pass
        raise ValueError("pdserve's CPU pass has no FP8 matmuls")
    if can_pack(weight.dtype):
        return Linear(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), bias, True)
    return Linear(weight, bias, False)


@dataclass
class Linears:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


@dataclass
class DecodeGroup:
    """Decodes attended together, padded to the longest: their rows in the step (``None``:
    all of them, in order) and, per layer, the page rows of their K then V blocks."""

    rows: torch.Tensor | None
    gather: torch.Tensor | None  # [L, rows] (:func:`page_rows`); None: the native kernel reads the pool
    pages: int
    length: int  # the longest context
    mask: torch.Tensor | None  # [B, 1, 1, W * page] additive, float32; None: one sequence, no window
    ctx_lens: torch.Tensor
    tables: torch.Tensor | None = None  # [B, W] int32 page ids, for the native kernel


@dataclass
class Chunk:
    """One prefill chunk's rows and, over a cached or earlier prefix, its pages."""

    rows: slice
    ctx_len: int
    gather: torch.Tensor | None  # page rows of every layer (:func:`page_rows`); None: fresh
    verify: bool = False  # a speculative verify: each row attends to its prefix as a decode would
    # A verify under the native kernel: each row's page table and length, as decodes have them.
    rows_native: tuple[torch.Tensor, torch.Tensor] | None = None
    # A prefill chunk under the native kernel: the sequence's page table (int32, its pages).
    table_native: torch.Tensor | None = None


@dataclass
class Plan:
    """What every layer of one step shares: rotary tables and pool indices of each layer."""

    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor
    store: torch.Tensor  # [L, T * 2 * H] rows (of head_dim) where each token's k, v go
    num_decodes: int
    groups: list[DecodeGroup]
    chunks: list[Chunk]
    masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)


def page_rows(pool: torch.Tensor, tables: torch.Tensor, blocks: bool) -> torch.Tensor:
    """The rows each layer gathers for pages ``tables [B, W]``. ``blocks``: ``[L, B * W]`` rows
    of ``pool.view(-1, 2 * heads * page * dim)``, each a page's K and V of every head in one
    layer; else ``[L, 2 * B * H * W]`` rows of ``pool.view(-1, page * dim)``, each one head's K
    or V block of a page, in ``[2, B, H, W]`` order."""
    _, layers, _, heads, _, _ = pool.shape
    tables = tables.to(torch.long)
    if blocks:
        return tables.reshape(1, -1) * layers + torch.arange(layers)[:, None]
    head = torch.arange(heads)[None, :, None]
    k = tables[:, None, :] * (layers * 2 * heads) + head  # [B, H, W]
    layer0 = torch.stack((k, k + heads)).view(1, -1)
    return layer0 + (torch.arange(layers) * (2 * heads))[:, None]


def length_groups(lens: list[int], page: int) -> list[list[int]]:
    """Decode indices grouped by context length (longest first): a group grows while it has
    fewer than :data:`MIN_GROUP` members or its padding to the longest stays under 2x."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            longest = -(-lens[group[0]] // page)
            if len(group) < MIN_GROUP or -(-lens[i] // page) * 2 > longest:
                group.append(i)
                continue
        groups.append([i])
    return groups
