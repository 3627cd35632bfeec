"""FP8 quality measured, not assumed: perplexity and next-token KL against bf16 on the CPU.

The real default model (SmolLM2-135M-Instruct, as ``pdserve up`` serves it) reads a fixed
text shipped with the repo (``engine/data/tiny_corpus.txt``, its first ``--tokens`` tokens,
in windows of ``--window`` tokens fed ``--chunk`` at a time through the KV cache, as chunked
prefill does) in five variants, each with exact float8_e4m3fn rounding (``engine/quant.py``):

  * ``float32``: the full-precision model, to show bf16's own distance from it;
  * ``bf16``: the reference;
  * ``fp8_weights``: every linear layer of the decoder as FP8 with per-output-channel scales
    (:func:`quantize_fp8`), computed as ``--quantization fp8`` computes every product of more
    than one row (prefill chunks, batched decode): W8A8, each row of the input rounded to FP8
    with its own scale (:func:`quantize_rows_fp8`), the FP8 products accumulated in float32,
    then both scales, then the bias; the embedding and the LM head (tied here) stay bf16;
  * ``fp8_weights_a16``: the same weights as the batch-1 GEMV computes them (W8A16: the bf16
    activations as they are);
  * ``fp8_kv``: keys (after rotary, and rotated by :func:`kv_key_rotation` as the engine stores
    them) and values stored through the KV scheme chunk by chunk into pages as the pool stores
    them (:func:`store_kv_fp8_blocks`: blocks of a page's tokens per KV head, one power-of-two
    scale each that grows as larger tokens arrive): every
    attention read, the chunk's own tokens included, sees the FP8 values, as a paged kernel
    reading the pool does;
  * ``fp8_both`` (W8A8 and the KV), ``fp8_both_a16`` (W8A16 and the KV);
  * asked for by name: ``fp8_k_only``, ``fp8_v_only`` (the keys alone, the values alone) and
    ``fp8_weights_g128``, ``fp8_both_g128`` (activation scales per 128 columns of a row, as the
    batched kernel's ``tile`` mode computes them: a lever measured, not the default), and
    ``fp8_weights_down_g128``, ``fp8_both_down_g128`` (down's input alone so).

Per variant: perplexity and its ratio to bf16, mean KL(bf16 || variant) of the next-token
distributions in nats (and against float32), the max and mean absolute logit error against
bf16 and how often the top token agrees. Also the KV pages per GiB of FP8 against bf16 at the
default page size (arithmetic, scales included; a scale per token, the scheme before, beside it). Writes ``docs/data/fp8_quality.json``.

    python bench/fp8_quality.py                          # 3 minutes on 2 idle cores
    python bench/fp8_quality.py --tokens 512 --out /tmp/fp8_quality.json
    # which layers hurt: leave some in bf16 (layers by index, kinds by name), K against V
    python bench/fp8_quality.py --variants fp8_weights fp8_both --keep-bf16 0 29 --out docs/data/fp8_quality_0_29.json
    python bench/fp8_quality.py --variants fp8_k_only fp8_v_only --out docs/data/fp8_quality_k_v.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.shapes import QWEN2_5_7B  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.quant import (  # noqa: E402
    FP8,
    GROUP,
    dequantize_kv_fp8,
    kv_bytes_per_page,
    kv_key_rotation,
    quantize_fp8,
    quantize_groups_fp8,
    quantize_rows_fp8,
    rotate_queries_keys,
    store_kv_fp8_blocks,
)

TEXT = ROOT / "engine" / "data" / "tiny_corpus.txt"
OUT = ROOT / "docs" / "data" / "fp8_quality.json"
# name -> (dtype, FP8 weights' activations: "" (no FP8 weights), "token" (W8A8, a scale per
# row), "group" (W8A8, a scale per GROUP columns of a row) or "none" (W8A16), what of the KV
# is FP8: "", "kv", "k" or "v"); bf16 is the reference the others are measured against. Those
# not in DEFAULT_VARIANTS tell which part hurts, or measure a lever.
VARIANTS: dict[str, tuple[torch.dtype, str, str]] = {
    "float32": (torch.float32, "", ""),
    "bf16": (torch.bfloat16, "", ""),
    "fp8_weights": (torch.bfloat16, "token", ""),
    "fp8_weights_a16": (torch.bfloat16, "none", ""),
    "fp8_kv": (torch.bfloat16, "", "kv"),
    "fp8_both": (torch.bfloat16, "token", "kv"),
    "fp8_both_a16": (torch.bfloat16, "none", "kv"),
    "fp8_k_only": (torch.bfloat16, "", "k"),
    "fp8_v_only": (torch.bfloat16, "", "v"),
    "fp8_weights_g128": (torch.bfloat16, "group", ""),
    "fp8_both_g128": (torch.bfloat16, "group", "kv"),
    "fp8_weights_down_g128": (torch.bfloat16, "down_group", ""),
    "fp8_both_down_g128": (torch.bfloat16, "down_group", "kv"),
    # W8A8 and FP8 KV but one product's input left in 16 bits (W8A16 there): which activations'
    # rounding costs the most
    "fp8_both_a16_qkv": (torch.bfloat16, "a16:q_proj,k_proj,v_proj", "kv"),
    "fp8_both_a16_o": (torch.bfloat16, "a16:o_proj", "kv"),
    "fp8_both_a16_gate_up": (torch.bfloat16, "a16:gate_proj,up_proj", "kv"),
    "fp8_both_a16_down": (torch.bfloat16, "a16:down_proj", "kv"),
}
DEFAULT_VARIANTS = ["float32", "bf16", "fp8_weights", "fp8_weights_a16", "fp8_kv", "fp8_both", "fp8_both_a16"]
REFERENCE = "bf16"


class Fp8Linear(torch.nn.Module):
    """A linear layer with FP8 weights as the kernels compute it: ``x @ q.T`` accumulated in
    float32 (each product exact), times the channel's scale, plus the bias, in ``x``'s dtype.
    ``activations``: "none" takes ``x`` as it is (W8A16, the batch-1 GEMV); "token" first rounds
    each row of ``x`` to FP8 with its own scale (:func:`quantize_rows_fp8`, the W8A8 products of
    prefill and batched decode); "group" with a scale per :data:`GROUP` columns of a row
    (:func:`quantize_groups_fp8`, the batched kernel's ``tile`` mode)."""

    def __init__(self, linear: torch.nn.Linear, activations: str = "token") -> None:
        super().__init__()
        if activations not in ("none", "token", "group"):
            raise ValueError(f"activations: none, token or group, not {activations!r}")
        w = quantize_fp8(linear.weight)
        self.activations = activations
        self.register_buffer("q", w.q.to(torch.float32))
        self.register_buffer("scale", w.scale)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(self._input(x), self.q) * self.scale
        return (out if self.bias is None else out + self.bias).to(x.dtype)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in float32 as the product reads it (rounded to FP8 and scaled back, but W8A16)."""
        if self.activations == "none":
            return x.to(torch.float32)
        rows = x.reshape(-1, x.shape[-1])
        if self.activations == "token":
            q, scale = quantize_rows_fp8(rows)
            return (q.to(torch.float32) * scale[:, None]).view(x.shape)
        q, scales = quantize_groups_fp8(rows, GROUP)
        per_column = scales.repeat_interleave(GROUP, dim=1)[:, : rows.shape[1]]
        return (q.to(torch.float32) * per_column).view(x.shape)


# ``--fp8-lm-head``: the LM head in FP8 too (a lever measured, not what --quantization fp8 does).
QUANTIZE_LM_HEAD = False


def quantize_weights(model: torch.nn.Module, keep: Sequence[str] = (), activations: str = "token") -> int:
    """Every ``nn.Linear`` under the decoder's layers (``model.model.layers``) as an
    :class:`Fp8Linear` computing with ``activations``, in place, but those whose name under the
    layers (``0.mlp.down_proj``) holds one of ``keep`` as whole dotted parts (``down_proj``,
    ``0``, ``29.mlp``), and the LM head with :data:`QUANTIZE_LM_HEAD` (untied from the
    embeddings); returns how many."""
    layers = model.get_decoder().layers
    names = [name for name, m in layers.named_modules() if isinstance(m, torch.nn.Linear)]
    count = 0
    for name in names:
        if any(f".{k}." in f".{name}." for k in keep):
            continue
        parent, _, attr = name.rpartition(".")
        owner = layers.get_submodule(parent)
        mode = activations
        if activations == "down_group":  # down's input by blocks, the others per row
            mode = "group" if attr == "down_proj" else "token"
        elif activations.startswith("a16:"):  # those projections' inputs as they are, the others per row
            mode = "none" if attr in activations.removeprefix("a16:").split(",") else "token"
        setattr(owner, attr, Fp8Linear(getattr(owner, attr), mode))
        count += 1
    if QUANTIZE_LM_HEAD:
        head = model.get_output_embeddings()
        untied = torch.nn.Linear(head.in_features, head.out_features, bias=False)
        untied.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.lm_head = Fp8Linear(untied, "token" if activations not in ("none", "token", "group") else activations)
        count += 1
    return count


class Fp8KVCache(DynamicCache):
    """transformers' dynamic cache whose every read returns the keys and values (``fp8`` "kv";
    "k" or "v": only those) as an FP8 page pool of ``page_size``-token pages holds them: each
    update stored into the pages after the ones before (:class:`Fp8Pages`), read back in the
    model's dtype."""

    def __init__(self, config: Any, fp8: str = "kv", page_size: int = EngineConfig.page_size) -> None:
        super().__init__(config=config)
        self.fp8 = fp8
        self.page_size = page_size
        self.pages: dict[tuple[int, str], Fp8Pages] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        out = []
        for kind, new, full in (("k", key_states, keys), ("v", value_states, values)):
            if kind in self.fp8:
                pages = self.pages.setdefault((layer_idx, kind), Fp8Pages(self.page_size, rotate=kind == "k"))
                full = pages.append(new)
            out.append(full)
        return out[0], out[1]


class Fp8Pages:
    """One layer's keys or values ``[batch, heads, tokens, dim]`` in FP8 blocks of ``page_size``
    tokens per (sequence, head), stored as the pool stores them; ``rotate`` (keys): stored as
    ``k @ H`` (:func:`kv_key_rotation`) and read back as ``(k @ H) @ H / p``, so that a query
    unrotated sees the scores a rotated one sees in the engine."""

    def __init__(self, page_size: int, rotate: bool = False) -> None:
        self.page_size = page_size
        self.rotate = rotate
        self.tokens = 0
        self.values = torch.zeros(0, dtype=torch.uint8)
        self.scales = torch.zeros(0)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Store ``x``'s tokens after the ones held; all of them back in ``x``'s dtype."""
        batch, heads, n, dim = x.shape
        page = self.page_size
        pages = -(-(self.tokens + n) // page)
        if self.values.numel() == 0 or self.values.shape[1] < pages:
            grown = torch.zeros((batch * heads, 2 * pages, page, dim), dtype=torch.uint8)
            scales = torch.zeros((batch * heads, 2 * pages))
            if self.values.numel():
                grown[:, : self.values.shape[1]] = self.values
                scales[:, : self.scales.shape[1]] = self.scales
            self.values, self.scales = grown, scales
        width = self.values.shape[1]
        pos = torch.arange(self.tokens, self.tokens + n)
        blocks = torch.arange(batch * heads)[:, None] * width + pos[None, :] // page
        offsets = (pos % page)[None, :].expand(batch * heads, n)
        rows = x.reshape(batch * heads * n, dim)
        if self.rotate:
            rows = rotate_queries_keys(None, rows)[1]
            assert rows is not None
        store_kv_fp8_blocks(self.values.view(-1, page, dim), self.scales.view(-1), blocks.reshape(-1),
                            offsets.reshape(-1), rows)  # fmt: skip
        self.tokens += n
        held = dequantize_kv_fp8(self.values[:, :pages].view(FP8), self.scales[:, :pages], torch.float32)
        if self.rotate:
            h, p = kv_key_rotation(dim, torch.float32, held.device)
            held = (held @ h) / p
        return held.to(x.dtype).reshape(batch, heads, pages * page, dim)[:, :, : self.tokens]


@dataclass
class Stats:
    """One variant's sums over the scored positions."""

    nll: float = 0.0
    kl: float = 0.0
    kl_float32: float = 0.0
    abs_err: float = 0.0
    max_abs_err: float = 0.0
    top1_same: int = 0
    positions: int = 0
    logits: int = 0
    seconds: float = 0.0

    def add(self, logp: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor | None) -> None:
        """``logp`` this variant's log-probabilities ``[T, V]``; ``ref``/``ref32`` bf16's and
        float32's logits ``[T, V]`` (float32)."""
        ref_logp = ref.log_softmax(-1)
        self.nll -= float(logp.gather(1, targets[:, None]).sum())
        self.kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
        if ref32 is not None:
            ref32_logp = ref32.log_softmax(-1)
            self.kl_float32 += float((ref32_logp.exp() * (ref32_logp - logp)).sum())
        self.top1_same += int((logp.argmax(-1) == ref.argmax(-1)).sum())
        self.positions += targets.numel()

    def add_logits(self, logits: torch.Tensor, ref: torch.Tensor) -> None:
        err = (logits - ref).abs()
        self.abs_err += float(err.sum(dtype=torch.float64))
        self.max_abs_err = max(self.max_abs_err, float(err.max()))
        self.logits += err.numel()

    def summary(self, reference_ppl: float | None) -> dict[str, Any]:
        ppl = math.exp(self.nll / self.positions)
        return {
            "perplexity": round(ppl, 4),
            "ppl_ratio_to_bf16": round(ppl / reference_ppl, 5) if reference_ppl else None,
            "mean_kl_nats_vs_bf16": round(self.kl / self.positions, 6),
            "mean_kl_nats_vs_float32": round(self.kl_float32 / self.positions, 6) if self.kl_float32 else None,
            "max_abs_logit_err_vs_bf16": round(self.max_abs_err, 4),
            "mean_abs_logit_err_vs_bf16": round(self.abs_err / self.logits, 5),
            "top1_agreement_vs_bf16": round(self.top1_same / self.positions, 5),
            "seconds": round(self.seconds, 1),
        }


def build_variants(
    model: torch.nn.Module, names: Sequence[str], keep_bf16: Sequence[str] = ()
) -> dict[str, tuple[torch.nn.Module, str]]:
    """Each variant's model (the float32 ``model`` copied, cast, its weights quantized) and
    what of its KV is FP8; variants that differ only in KV share one model."""
    models: dict[tuple[torch.dtype, str], torch.nn.Module] = {}
    out = {}
    for name in names:
        dtype, activations, fp8_kv = VARIANTS[name]
        if (dtype, activations) not in models:
            m = copy.deepcopy(model).to(dtype).eval()
            if activations:
                quantize_weights(m, keep_bf16, activations)
            models[dtype, activations] = m
        out[name] = (models[dtype, activations], fp8_kv)
    return out


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module,
    tokens: Sequence[int],
    window: int,
    chunk: int,
    names: Sequence[str] = tuple(DEFAULT_VARIANTS),
    keep_bf16: Sequence[str] = (),
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, dict[str, Any]]:
    """The summaries (:meth:`Stats.summary`) of the variants ``names`` (bf16 among them) of the
    float32 ``model`` on ``tokens``: windows of ``window`` tokens, each from an empty cache, fed
    ``chunk`` tokens at a time; each window scores its tokens after the first."""
    assert REFERENCE in names, "bf16 is the reference"
    variants = build_variants(model, names, keep_bf16)
    order = [REFERENCE, *(n for n in names if n != REFERENCE)]
    stats = {name: Stats() for name in order}
    ids = torch.tensor(tokens, dtype=torch.long)
    starts = list(range(0, len(ids) - 1, window))
    for w, start in enumerate(starts):
        piece = ids[start : start + window]
        caches = {name: Fp8KVCache(model.config, variants[name][1]) for name in order}
        for c in range(0, len(piece) - 1, chunk):
            inputs, targets = piece[c : c + chunk], piece[c + 1 : c + chunk + 1]
            logits: dict[str, torch.Tensor] = {}
            for name in order:
                t0 = time.perf_counter()
                out = variants[name][0](input_ids=inputs[None], cache=caches[name], use_cache=True)
                logits[name] = out.logits[0, : len(targets)].to(torch.float32)
                stats[name].seconds += time.perf_counter() - t0
            ref, ref32 = logits[REFERENCE], logits.get("float32")
            for name in order:
                stats[name].add(logits[name].log_softmax(-1), targets, ref, ref32)
                stats[name].add_logits(logits[name], ref)
        progress(f"window {w + 1}/{len(starts)}: {len(piece)} tokens, {stats[REFERENCE].positions} scored so far")
    reference_ppl = math.exp(stats[REFERENCE].nll / stats[REFERENCE].positions)
    return {name: stats[name].summary(reference_ppl) for name in names}


def kv_capacity(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int) -> dict[str, Any]:
    """Bytes a page takes and pages per GiB, bf16 against FP8 with one float32 scale per (page,
    layer, K|V, head) block, and against FP8 with a float32 scale per token (the scheme before)."""
    bf16 = kv_bytes_per_page(num_layers, num_kv_heads, head_dim, page_size, fp8=False)
    fp8 = kv_bytes_per_page(num_layers, num_kv_heads, head_dim, page_size, fp8=True)
    per_token_scales = page_size * num_layers * 2 * num_kv_heads * (head_dim + 4)
    gib = 1 << 30
    return {
        "page_size": page_size,
        "page_bytes": {"bf16": bf16, "fp8": fp8},
        "pages_per_gib": {"bf16": round(gib / bf16, 1), "fp8": round(gib / fp8, 1)},
        "ratio_fp8_to_bf16": round(bf16 / fp8, 4),
        "ratio_with_a_scale_per_token": round(bf16 / per_token_scales, 4),
    }


def load_tokens(model_dir: Path, n: int) -> list[int]:
    """The first ``n`` tokens of :data:`TEXT` by the model's tokenizer (no special tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"{TEXT.name} has {len(ids)} tokens, fewer than --tokens {n}")
    return list(ids[:n])


def resolve_model(name: str, data_dir: Path) -> tuple[str, Path]:
    from pdserve.default_model import NAME, ensure_default_model

    if name == "smollm2":
        return NAME, ensure_default_model(data_dir, progress=log)
    return Path(name).name, Path(name)


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| variant | perplexity | / bf16 | mean KL vs bf16 (nats) | max / mean abs logit err | top-1 same |"]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['perplexity']:.3f} | {r['ppl_ratio_to_bf16']:.4f} | {r['mean_kl_nats_vs_bf16']:.5f} "
            f"| {r['max_abs_logit_err_vs_bf16']:.3f} / {r['mean_abs_logit_err_vs_bf16']:.4f} "
            f"| {100 * r['top1_agreement_vs_bf16']:.2f}% |"
        )
    return lines


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


@dataclass
class Args:
    model: str = "smollm2"
    data_dir: Path = Path(tempfile.gettempdir()) / "pdserve-bench"
    tokens: int = 4096
    window: int = 2048
    chunk: int = 512
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    keep_bf16: list[str] = field(default_factory=list)
    out: Path = OUT


def parse(argv: Sequence[str] | None = None) -> Args:
    d = Args()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=d.model, help="smollm2 (the default model) or a model directory")
    p.add_argument("--data-dir", type=Path, default=d.data_dir, help="where smollm2 is fetched and converted once")
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens of the text read (default: %(default)s)")
    p.add_argument("--window", type=int, default=d.window, help="tokens a window, from an empty cache")
    p.add_argument("--chunk", type=int, default=d.chunk, help="tokens a forward pass (chunked prefill)")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=d.variants,
        help="bf16 always runs (default: %(default)s)",
    )
    p.add_argument(
        "--keep-bf16",
        nargs="*",
        default=d.keep_bf16,
        help="linear layers left in bf16, by dotted name parts: 0 29 (layers), down_proj, 5.mlp",
    )
    p.add_argument("--fp8-lm-head", action="store_true", help="the LM head in FP8 too (a lever, not the default)")
    p.add_argument("--out", type=Path, default=d.out, help="the JSON written (default: docs/data/fp8_quality.json)")
    a = p.parse_args(argv)
    global QUANTIZE_LM_HEAD
    QUANTIZE_LM_HEAD = a.fp8_lm_head
    names = [REFERENCE, *(v for v in a.variants if v != REFERENCE)]
    return Args(a.model, a.data_dir, a.tokens, a.window, a.chunk, names, a.keep_bf16, a.out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    from transformers import AutoModelForCausalLM

    from pdserve.engine.loader import quiet_transformers

    sys.path.insert(0, str(ROOT / "bench"))
    from common import git_commit

    quiet_transformers()
    name, model_dir = resolve_model(args.model, args.data_dir)
    tokens = load_tokens(model_dir, args.tokens)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    log(f"{name}: {args.tokens} tokens of {TEXT.name} in windows of {args.window}, chunks of {args.chunk}")
    log(f"variants: {', '.join(args.variants)}" + (f"; left in bf16: {args.keep_bf16}" if args.keep_bf16 else ""))
    t0 = time.perf_counter()
    results = evaluate(model, tokens, args.window, args.chunk, args.variants, args.keep_bf16, log)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    page_size = EngineConfig.page_size
    qwen_head_dim = QWEN2_5_7B["hidden_size"] // QWEN2_5_7B["num_attention_heads"]
    report = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "command": " ".join(["python bench/fp8_quality.py", *(sys.argv[1:] if argv is None else argv)]),
        "model": name,
        "device": "cpu (simulated: exact float8_e4m3fn rounding, torch " + torch.__version__ + ")",
        "text_source": {
            "path": str(TEXT.relative_to(ROOT)),
            "sha256": hashlib.sha256(TEXT.read_bytes()).hexdigest(),
            "first_tokens": args.tokens,
        },
        "tokens": args.tokens,
        "scored_positions": _scored(args.tokens, args.window),
        "window": args.window,
        "chunk": args.chunk,
        "weights_left_in_bf16": ["embed_tokens", *([] if QUANTIZE_LM_HEAD else ["lm_head"]), *args.keep_bf16],
        "weights_scheme": "float8_e4m3fn, one float32 scale (amax / 448) per output channel",
        "activations": {
            "token": "W8A8: each row rounded to float8_e4m3fn with its own scale, as prefill and batched decode compute",
            "none": "W8A16: bf16 activations, as the batch-1 GEMV computes (variants ending _a16)",
            "group": f"W8A8 with a scale per {GROUP} columns of a row (variants ending _g128)",
            "down_group": f"W8A8, down's input with a scale per {GROUP} columns of a row, the others per row "
            "(variants ending _down_g128)",
            "a16:NAMES": "W8A8 but the inputs of the projections NAMES in 16 bits (W8A16 there; variants "
            "fp8_both_a16_qkv, _o, _gate_up, _down)",
        },
        "kv_scheme": (
            f"float8_e4m3fn, one power-of-two float32 scale per {page_size}-token page per KV head (amax / 448 "
            "rounded up, grown as larger tokens arrive), stored chunk by chunk; keys after rotary and a "
            "Hadamard rotation (queries rotated alike: scores unchanged)"
        ),
        "kl": "mean over scored positions of KL(p_bf16 || p_variant) of the next-token distributions, nats",
        "variants": results,
        "kv_capacity": {
            name: kv_capacity(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, page_size),
            "Qwen2.5-7B": kv_capacity(
                QWEN2_5_7B["num_hidden_layers"], QWEN2_5_7B["num_key_value_heads"], qwen_head_dim, page_size
            ),
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for line in table(results):
        print(line)
    cap = report["kv_capacity"][name]
    print(f"KV pages per GiB at page size {page_size}: {cap['pages_per_gib']} ({cap['ratio_fp8_to_bf16']}x)")
    log(f"wrote {args.out}")
    return 0


def _scored(tokens: int, window: int) -> int:
    """Positions scored: each window's tokens after its first."""
    return sum(min(window, tokens - s) - 1 for s in range(0, tokens - 1, window))


if __name__ == "__main__":
    raise SystemExit(main())
