"""Greedy equality at Qwen2.5-7B dimensions in float32 on the GPU (random weights).

bf16 runs of pdserve and transformers part ways after a few tokens on random weights
(near-tied logits, different kernels); this checks the same code in float32.

    python bench/probes/gpu_fp32_check.py     # one GPU
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_reading import agree, engine_run, hf_generate
from make_dummy_model import DIMS

from pdserve.engine import attention
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model_runner import ModelRunner, ModelSpec


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config

    device = torch.device("cuda")
    impl = attention.register()
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(**DIMS["qwen2.5-7b"]), dtype=torch.float32, attn_implementation=impl
        ).eval()
    config = EngineConfig(device="cuda", max_total_tokens=20_000)
    engine = Engine(ModelRunner(ModelSpec(Path("qwen2.5-7b-fp32")), config, model=model), config)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 150000) for _ in range(n)] for n in (17, 130, 300, 511)]
    ours, _, _ = engine_run(engine, prompts, 32)
    theirs = [hf_generate(model, [p], 32, device)[0][0] for p in prompts]
    print("fp32 7B-dims greedy tokens agreeing (of 32):", [agree(a, b) for a, b in zip(ours, theirs, strict=True)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
