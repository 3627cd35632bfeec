"""Where pdserve's fast path and ``transformers`` part ways, position by position.

For small float32 models of each supported kind: the rotary tables, then logits of a
prefill and of teacher-forced decode steps through ``ModelRunner`` against the stock
model's full forward pass. Prints the largest absolute logit difference per stage.

    python bench/probes/gpu_diag.py [--device cuda]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from pdserve.bench.shapes import small_model
from pdserve.engine.config import EngineConfig
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.page_manager import PageManager
from pdserve.engine.sequence import ScheduledBatch, Sequence
from pdserve.schemas import SamplingParams


def model_of(kind: str, device: torch.device) -> torch.nn.Module:
    return small_model(kind, device)  # the fast-path tests' models


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    quiet_transformers()
    device = torch.device(args.device)
    if device.type == "cpu":
        from pdserve.engine.kernels import use_interpreter

        use_interpreter()
    print("tf32 matmul", torch.backends.cuda.matmul.allow_tf32, "precision", torch.get_float32_matmul_precision())
    for kind in ("qwen2", "llama", "llama3-rope"):
        model = model_of(kind, device)
        config = EngineConfig(
            device=str(device),
            max_total_tokens=1024,
            model_impl="pdserve",
            cuda_graph_max_batch=0,
            overlap_schedule=False,
        )
        runner = ModelRunner(ModelSpec(Path(kind)), config, model=model)
        assert runner.fast is not None
        n = 40
        pos = torch.arange(n, device=device)[None]
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(torch.empty((), device=device), pos)
        rope_diff = max(
            (cos[0] - runner.fast.cos[:n]).abs().max().item(), (sin[0] - runner.fast.sin[:n]).abs().max().item()
        )
        rng = random.Random(kind)
        tokens = [rng.randrange(300) for _ in range(n)]
        pages = PageManager(runner.num_pages, config.page_size)
        seq = Sequence("s", tokens[:20], SamplingParams(max_new_tokens=100))
        pages.grow(seq, 20)
        _, logits = runner.execute(ScheduledBatch([], [(seq, 20)]))
        with torch.inference_mode():
            ref = model(torch.tensor([tokens], device=device)).logits[0].double()
        assert logits is not None
        diffs = [(logits[0].double() - ref[19]).abs().max().item()]
        seq.num_computed = 20
        for i in range(20, n):
            seq.output_ids.append(tokens[i])
            pages.grow(seq, seq.num_tokens)
            _, logits = runner.execute(ScheduledBatch([seq], []))
            assert logits is not None
            diffs.append((logits[0].double() - ref[i]).abs().max().item())
            seq.num_computed += 1
        print(
            f"{kind:12} rope table {rope_diff:.2e}  prefill logits {diffs[0]:.2e}  "
            f"decode logits max {max(diffs[1:]):.2e} (first {diffs[1]:.2e})",
            flush=True,
        )
    for kind in ("qwen2", "llama3-rope"):
        engine_flow(kind, device)
    engine_flow("llama3-rope", device, generate_first=True)
    return 0


def engine_flow(kind: str, device: torch.device, generate_first: bool = False) -> None:
    """The fast-model test's own flow (three prompts, 16-token chunks, overlap on): every
    sampled row's logits against the stock model's on the same tokens."""
    from pdserve.engine.engine import Engine

    model = model_of(kind, device)
    rng = random.Random(kind)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 23, 40)]
    if generate_first:  # as the test does: the stock generate before the fast path is built
        inv_freq = model.model.rotary_emb.inv_freq.clone()
        with torch.inference_mode():
            for p in prompts:
                model.generate(torch.tensor([p], device=device), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        changed = (model.model.rotary_emb.inv_freq - inv_freq).abs().max().item()
        print(f"{kind:12} generate first: inv_freq changed by {changed:.2e}", flush=True)
    config = EngineConfig(
        device=str(device), max_total_tokens=1024, model_impl="pdserve", chunked_prefill_size=16, cuda_graph_max_batch=0
    )
    runner = ModelRunner(ModelSpec(Path(kind)), config, model=model)
    engine = Engine(runner, config)
    rows: list[tuple[int, str, int, torch.Tensor, str]] = []
    execute = runner.execute
    step = [0]

    def hooked(batch, feed=None):
        step[0] += 1
        shape = f"decodes={len(batch.decodes)} chunks={[(s.rid, s.num_computed, n) for s, n in batch.prefills]} feed={feed is not None}"
        seqs, logits = execute(batch, feed)
        if logits is not None:
            for i, seq in enumerate(seqs):
                rows.append((step[0], seq.rid, seq.num_tokens, logits[i].detach().double().clone(), shape))
        return seqs, logits

    runner.execute = hooked  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.rid, []).extend(out.token_ids)
    worst = 0.0
    for n, rid, length, logits, shape in rows:
        known = (prompts[int(rid)] + outputs[rid])[:length]  # what the row saw, a pending token too
        with torch.inference_mode():
            ref = model(torch.tensor([known], device=device)).logits[0, -1].double()
        diff = (logits - ref).abs().max().item()
        worst = max(worst, diff)
        if diff > 1e-4:
            print(f"  {kind} step {n} rid {rid} len {len(known)} diff {diff:.2e}  {shape}")
    print(f"{kind:12} engine flow: {len(rows)} rows, worst logit difference {worst:.2e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
