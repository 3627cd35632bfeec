"""Builds an engine from a worker configuration: tokenizer, stop ids, model, pool."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.grammar import Grammars
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.parallel import TPGroup

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def eos_ids(model_path: Path, trust_remote_code: bool = False) -> set[int]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig

    ids: set[int] = set()
    try:
        gen = GenerationConfig.from_pretrained(model_path)
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids


def freeze_heap() -> int:
    """Every object alive now (the model's modules and parameters, the engine's tables, the
    libraries' modules) moved out of the garbage collector's reach, once a process has built
    its engine: a full collection walks every object it tracks (some 400k in a process of the
    default model's engines), on whichever thread allocated last, the engine's too, however
    little of it is garbage (vLLM freezes its heap after start-up for the same reason). Returns
    how many objects were frozen. Objects frozen are never collected: a process that drops an
    engine it froze and wants its memory back calls :func:`gc.unfreeze` first."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def build_engine(
    model_path: Path,
    config: EngineConfig,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    load_format: str = "auto",
    tp: TPGroup | None = None,
    model: torch.nn.Module | None = None,
) -> Engine:
    """The engine for the model in the local directory ``model_path`` (safetensors weights,
    sharded or not, or ``pytorch_model*.bin``; a hub id is resolved before, by
    :func:`pdserve.checkpoint.resolve`); ``tp``: this is rank 0 of a tensor-parallel group
    (:mod:`.parallel`). ``model``: another engine's model, whose weights this one shares
    (the two engines of a co-located process)."""
    from transformers import AutoTokenizer

    quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    runner = ModelRunner(ModelSpec(Path(model_path), dtype, trust_remote_code, load_format), config, model, tp=tp)

    def detokenize(ids: list[int]) -> str:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)
        return text

    eos = eos_ids(model_path, trust_remote_code)
    return Engine(
        runner,
        config,
        eos,
        detokenize,
        grammars=make_grammars(tokenizer, runner.vocab_size, eos, config.grammar_threads),
    )


def make_grammars(tokenizer: object, vocab_size: int, eos: set[int], threads: int | None = None) -> Grammars | None:
    """Structured output for this tokenizer, or ``None`` (logged) where xgrammar is missing
    or cannot read the tokenizer: constrained requests are then refused with an error."""
    try:
        return Grammars(tokenizer, vocab_size, sorted(eos), threads)
    except Exception as exc:  # ImportError, or a tokenizer xgrammar does not know
        log.warning("structured output unavailable", extra={"error": str(exc)})
        return None
