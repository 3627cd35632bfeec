"""Probe: FP8 weights rounded GPTQ-style (each column's rounding error spread over the columns
not yet rounded, by the inverse Hessian of the layer's inputs on calibration text) against
round-to-nearest, on the default model, with bench/fp8_quality.py's simulation and text.

Calibration: the tokens of ``engine/data/tiny_corpus.txt`` after the first 4,096 (which the
quality figures score), through the float32 model; per output channel the same scale as
``--quantization fp8`` (amax / 448, the largest entry kept at 448 so the scale is unchanged).
A lever for issue "FP8 on Hopper"'s quality goal, measured and not taken (docs/notes.md).

    python bench/probes/fp8_gptq_probe.py --out docs/data/fp8_quality_gptq.json
"""

import argparse
import copy
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import fp8_quality as fq  # noqa: E402

from pdserve.engine.quant import FP8, FP8_MAX  # noqa: E402


def round_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` (in units of its channel's scale) rounded to the nearest e4m3 value, saturating."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8).to(torch.float32)


def gptq_(linear: torch.nn.Linear, H: torch.Tensor, damp: float = 0.01, block: int = 128) -> None:
    """``linear``'s weight rounded to e4m3 column by column in place (kept dequantized), each
    column's error compensated on the later columns through the inverse of ``H`` (its inputs'
    ``X^T X``, damped by ``damp`` of its mean diagonal), ``block`` columns at a time."""
    W = linear.weight.detach().to(torch.float32).clone()
    amax = W.abs().amax(dim=1).clamp_min(1e-12)
    scale = amax / FP8_MAX
    Wn = W / scale[:, None]
    H = H.clone().to(torch.float64)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    Wn[:, dead] = 0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(H.shape[0], dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).to(torch.float32)
    Q = torch.zeros_like(Wn)
    n = Wn.shape[1]
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1 = Wn[:, i1:i2].clone()
        Err = torch.zeros_like(W1)
        Hi = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            d = Hi[i, i]
            q = round_fp8(w)
            Q[:, i1 + i] = q
            e = (w - q) / d
            W1[:, i:] -= e[:, None] * Hi[i, i:][None, :]
            Err[:, i] = e
        Wn[:, i2:] -= Err @ Hinv[i1:i2, i2:]
    # keep each row's scale exact: its largest entry at 448
    arg = W.abs().argmax(dim=1)
    Q[torch.arange(Q.shape[0]), arg] = torch.sign(W[torch.arange(Q.shape[0]), arg]) * FP8_MAX
    linear.weight.data = (Q * scale[:, None]).to(linear.weight.dtype)


@torch.inference_mode()
def feed(
    model: torch.nn.Module, tokens: list[int], hooked: list[tuple[torch.nn.Module, Any]], chunk: int = 512
) -> None:
    """``tokens`` through ``model`` in windows of ``chunk``, each ``(module, hook)`` of ``hooked``
    a forward hook on its module meanwhile."""
    hooks = [m.register_forward_hook(fn) for m, fn in hooked]
    try:
        ids = torch.tensor(tokens)
        for s in range(0, len(ids), chunk):
            model(ids[None, s : s + chunk])
    finally:
        for h in hooks:
            h.remove()


def hessians(model: torch.nn.Module, tokens: list[int], chunk: int = 512) -> dict[str, torch.Tensor]:
    """Each decoder linear's ``X^T X`` over ``tokens``, fed in windows of ``chunk``."""
    H: dict[str, torch.Tensor] = {}
    hooked = []
    for name, m in model.get_decoder().layers.named_modules():
        if isinstance(m, torch.nn.Linear):

            def hook(mod, inp, out, name=name):
                x = inp[0].reshape(-1, inp[0].shape[-1]).to(torch.float64)
                H[name] = H.get(name, 0) + x.T @ x

            hooked.append((m, hook))
    feed(model, tokens, hooked, chunk)
    return H


def model_and_text() -> tuple[str, torch.nn.Module, list[int], list[int]]:
    """The default model in float32, the 4,096 tokens the quality figures score, and the corpus'
    tokens after them (the calibration text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, model_dir = fq.resolve_model("smollm2", Path("/tmp/pdserve-bench"))
    scored = fq.load_tokens(model_dir, 4096)
    ids = AutoTokenizer.from_pretrained(model_dir)(fq.TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return name, model, scored, list(ids["input_ids"][4096:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="bf16,fp8_weights,fp8_weights_a16,fp8_both")
    args = p.parse_args()
    names = args.variants.split(",")
    name, model, scored, calib = model_and_text()
    t0 = time.time()
    h = hessians(model, calib)
    rounded = copy.deepcopy(model)
    layers = rounded.get_decoder().layers
    for n, m in layers.named_modules():
        if isinstance(m, torch.nn.Linear):
            gptq_(m, h[n])
    print(f"calibration {len(calib)} tokens, GPTQ rounding in {time.time() - t0:.0f} s", flush=True)
    nearest = fq.evaluate(model, scored, 2048, 512, names)
    weights = {n: m.weight.detach().clone() for n, m in layers.named_modules() if isinstance(m, torch.nn.Linear)}
    plain = fq.quantize_weights

    def with_gptq(m: torch.nn.Module, keep=(), activations: str = "token") -> int:
        for n, mod in m.get_decoder().layers.named_modules():
            if isinstance(mod, torch.nn.Linear) and n in weights:
                mod.weight.data = weights[n].to(mod.weight.dtype)
        return plain(m, keep, activations)

    fq.quantize_weights = with_gptq
    gptq = fq.evaluate(model, scored, 2048, 512, names)
    keys = ("ppl_ratio_to_bf16", "mean_kl_nats_vs_bf16", "top1_agreement_vs_bf16")
    report = {
        "date": datetime.date.today().isoformat(),
        "command": "python bench/probes/fp8_gptq_probe.py " + " ".join(sys.argv[1:]),
        "model": name,
        "scored": "the first 4,096 tokens of engine/data/tiny_corpus.txt, windows of 2,048, chunks of 512",
        "calibration_tokens": len(calib),
        "round_to_nearest": {k: {x: nearest[k][x] for x in keys} for k in names},
        "gptq": {k: {x: gptq[k][x] for x in keys} for k in names},
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for k in names:
        print(k, "nearest", report["round_to_nearest"][k], "gptq", report["gptq"][k], flush=True)


if __name__ == "__main__":
    main()
