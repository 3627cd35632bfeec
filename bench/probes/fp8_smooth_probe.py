"""Probe: FP8 W8A8 with the activations' channel maxima migrated into the weights
(SmoothQuant-style), against plain W8A8, on the default model, with bench/fp8_quality.py's
simulation and text.

For each decoder layer, the inputs of q/k/v (after ``input_layernorm``) and of gate/up (after
``post_attention_layernorm``) are divided per channel by ``s = amax_x ** alpha / amax_w ** (1 -
alpha)`` and the weights reading them multiplied by it, folded into the norm's weight: no
cost at run time (o and down, whose inputs come from no norm, are left as they are).
``amax_x``: each channel's largest magnitude over the calibration tokens (those of
``engine/data/tiny_corpus.txt`` after the first 4,096, which the quality figures score),
through the float32 model; ``amax_w``: each input column's over the projections reading it.
Then the weights are rounded as ``--quantization fp8`` rounds them (per output channel, to
nearest) and computed W8A8 (each row of the input rounded with its own scale), with and
without the FP8 KV. A lever for issue "FP8 on Hopper"'s quality goal (docs/notes.md).

    python bench/probes/fp8_smooth_probe.py --out docs/data/fp8_quality_smooth.json
"""

import argparse
import copy
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import fp8_quality as fq  # noqa: E402

sys.path.insert(0, str(ROOT / "bench" / "probes"))
from fp8_gptq_probe import feed, model_and_text  # noqa: E402


def channel_maxima(model: torch.nn.Module, tokens: list[int], chunk: int = 512) -> dict[tuple[int, str], torch.Tensor]:
    """Per decoder layer, each input channel's largest magnitude into q/k/v ("attn") and
    gate/up ("mlp") over ``tokens``, fed in windows of ``chunk``."""
    amax: dict[tuple[int, str], torch.Tensor] = {}
    hooked = []
    for i, layer in enumerate(model.get_decoder().layers):
        for part, proj in (("attn", layer.self_attn.q_proj), ("mlp", layer.mlp.gate_proj)):

            def hook(mod, inp, out, key=(i, part)):
                x = inp[0].reshape(-1, inp[0].shape[-1]).abs().amax(0)
                amax[key] = torch.maximum(amax[key], x) if key in amax else x

            hooked.append((proj, hook))
    feed(model, tokens, hooked, chunk)
    return amax


def smoothed(model: torch.nn.Module, amax: dict[tuple[int, str], torch.Tensor], alpha: float) -> torch.nn.Module:
    """A copy of ``model`` with the migration folded in (the same function in float32)."""
    out = copy.deepcopy(model)
    for i, layer in enumerate(out.get_decoder().layers):
        attn, mlp = layer.self_attn, layer.mlp
        for part, norm, projs in (
            ("attn", layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
            ("mlp", layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj)),
        ):
            w = torch.cat([p.weight.detach().abs() for p in projs]).amax(0).clamp_min(1e-5)
            s = (amax[i, part].clamp_min(1e-5).pow(alpha) / w.pow(1 - alpha)).clamp_min(1e-5)
            with torch.no_grad():
                norm.weight.div_(s)
                for p in projs:
                    p.weight.mul_(s)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--alphas", default="0.3,0.5,0.7", help="migration strengths to measure")
    args = p.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    name, model, scored, calib = model_and_text()
    t0 = time.time()
    amax = channel_maxima(model, calib)
    print(f"calibration {len(calib)} tokens in {time.time() - t0:.0f} s", flush=True)
    variants = dict(fq.build_variants(model, ["bf16", "fp8_weights", "fp8_both"]))
    for alpha in alphas:
        m = fq.build_variants(smoothed(model, amax, alpha), ["fp8_weights"])["fp8_weights"][0]
        variants[f"smooth_{alpha}_weights"] = (m, "")
        variants[f"smooth_{alpha}_both"] = (m, "kv")
    built = fq.build_variants
    fq.build_variants = lambda model, names, keep=(): variants  # evaluate() takes these as built
    try:
        results = fq.evaluate(model, scored, 2048, 512, list(variants))
    finally:
        fq.build_variants = built
    keys = ("ppl_ratio_to_bf16", "mean_kl_nats_vs_bf16", "top1_agreement_vs_bf16")
    report = {
        "date": datetime.date.today().isoformat(),
        "command": "python bench/probes/fp8_smooth_probe.py " + " ".join(sys.argv[1:]),
        "model": name,
        "scored": "the first 4,096 tokens of engine/data/tiny_corpus.txt, windows of 2,048, chunks of 512",
        "calibration_tokens": len(calib),
        "reference": "bf16 without the migration",
        "variants": {k: {x: results[k][x] for x in keys} for k in variants},
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for k, v in report["variants"].items():
        print(k, v, flush=True)


if __name__ == "__main__":
    main()
