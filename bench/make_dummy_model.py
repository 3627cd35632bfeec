"""A config-only model directory of a known architecture, for ``--load-format dummy``.

The weights are random (each worker draws the same ones from seed 0 on its device);
the tokenizer is the built-in tiny model's, so any prompt tokenizes. Token ids above
the tokenizer's vocabulary are never produced by it but are valid model inputs.

    python bench/make_dummy_model.py --dims qwen2.5-7b --out /tmp/qwen7b-dummy
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.shapes import QWEN2_5_0_5B, QWEN2_5_7B

DIMS = {"qwen2.5-7b": QWEN2_5_7B, "qwen2.5-0.5b": QWEN2_5_0_5B}


def write_model_dir(out: Path, dims: dict, dtype: str = "bfloat16") -> Path:
    """A Qwen2 config of ``dims`` with the built-in tokenizer in ``out``; returns ``out``."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config

    from pdserve.engine.tiny_model import ensure_default_model

    tiny = ensure_default_model(Path(tempfile.mkdtemp()))
    tok = AutoTokenizer.from_pretrained(tiny)
    config = Qwen2Config(**dims, dtype=dtype, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", choices=sorted(DIMS), default="qwen2.5-7b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(write_model_dir(args.out, DIMS[args.dims], args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
