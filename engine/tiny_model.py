"""Build pdserve's built-in tiny causal LM, once, so the server runs with no downloads.

``ensure_default_model(data_dir)`` returns ``data_dir / "models" / DEFAULT_MODEL_NAME``.
On first use it builds a small Hugging Face model directory there, which
``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained`` load
without network access:

* ``tokenizer.json`` / ``tokenizer_config.json``: a real byte-level BPE tokenizer
  (256-byte initial alphabet plus merges learned from ``engine/data/tiny_corpus.txt``;
  specials ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), and a Qwen2-style
  ChatML chat template that adds no default system message.
* ``config.json`` / ``model.safetensors`` / ``generation_config.json``: a 4-layer
  ``Qwen2ForCausalLM`` with *random* weights (``torch.manual_seed(0)``).
* ``README.md`` and a marker file, which is written last.

The model's output is NOT meaningful text. It exists to exercise the serving path
(tokenizer, chat template, prefill, decode, streaming detokenisation). The embedding rows
of the special tokens are scaled by ``SPECIAL_ROW_SCALE`` and the (untied) LM head is the
embedding times ``LOGIT_SCALE``, so logits spread over a few units and the special tokens'
near-zero logits are practically never sampled: ``max_new_tokens`` decides how long a reply is.

Weight init: in transformers 5, ``Qwen2ForCausalLM(config)`` initialises the weights in
``post_init`` (``_init_weights``): Linear and Embedding get normal(0, ``initializer_range``),
biases get zeros and RMSNorm weights get ones. Because ``pad_token_id`` becomes the
embedding's ``padding_idx``, the ``<|endoftext|>`` row is zeroed, so its logit is always 0.
A tied, unscaled head would spread the logits only ±0.3, and at temperature 0.7 about one
32-token reply in 70 would meet an EOS early.
``_check_random_init`` fails the build if the weights come out empty or zero.

Tokenizer pipeline: with transformers 5, ``AutoTokenizer`` on a ``qwen2`` model
directory always builds ``Qwen2Tokenizer``. That class keeps only the vocab and merges from
``tokenizer.json`` and hard-codes its own pipeline: an NFC normaliser, Qwen2's split regex,
then ``ByteLevel(add_prefix_space=False, use_regex=False)``. We train with exactly that
pipeline, so ``tokenizers.Tokenizer.from_file`` and ``AutoTokenizer`` give the same ids.
Any NFC-normalised UTF-8 text (CJK, emoji, newlines, runs of spaces) decodes back exactly.
Text that is not in NFC form comes back NFC-normalised.

Determinism: building into two empty directories gives byte-identical files. The
tokenizer trainer breaks ties in a fixed order, the weights come from a fixed seed with the
float32 default dtype (the caller's global RNG state is restored afterwards), and no
timestamps are written.

The build is atomic. Files are written to a temporary directory next to the target, which
is then renamed into place with ``os.rename``. If another process publishes first, its
copy is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports stay lazy so the already-built fast path stays cheap
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

__all__ = ["DEFAULT_MODEL_NAME", "ensure_default_model"]

DEFAULT_MODEL_NAME = "pdserve-tiny-qwen2"

# Change this whenever the recipe changes; directories built by an older recipe get rebuilt.
RECIPE_VERSION = 2
MARKER_NAME = ".pdserve-complete.json"
CORPUS_PATH = pathlib.Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2

VOCAB_MULTIPLE = 64
# Total vocabulary including specials: 256 bytes + 3 specials + 4093 learned merges.
TOKENIZER_VOCAB_SIZE = 68 * VOCAB_MULTIPLE  # 4352
# Copied from transformers' Qwen2Tokenizer, which AutoTokenizer rebuilds the tokenizer with.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
MODEL_MAX_LENGTH = 4096

# ChatML as used by Qwen2, minus the default system message. The content may be a string
# or a list of OpenAI-style parts; only the parts with type "text" are rendered.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SEED = 0
SPECIAL_ROW_SCALE = 0.05
# The LM head is the embedding times this: logits with a spread of a few units, so sampled
# text concentrates on likely tokens and a special token's near-zero logit is ~never drawn.
LOGIT_SCALE = 10.0
ARCHITECTURE: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 768,
    "max_position_embeddings": MODEL_MAX_LENGTH,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
}
ROPE_THETA = 10000.0

ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class TokenIds:
    """Ids of the special tokens in the trained vocabulary."""

    endoftext: int
    im_start: int
    im_end: int

    @property
    def all(self) -> tuple[int, int, int]:
        return (self.endoftext, self.im_start, self.im_end)


def ensure_default_model(data_dir: pathlib.Path, progress: ProgressFn | None = None) -> pathlib.Path:
    """Return the built-in tiny model directory under ``data_dir``, building it if needed."""
    target = pathlib.Path(data_dir) / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return target
    report: ProgressFn = progress if progress is not None else _ignore
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        build_model_dir(staging, report)
        _publish(staging, target, report)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_model_dir(out_dir: pathlib.Path, progress: ProgressFn) -> None:
    """Write the complete model directory (tokenizer, config, weights, marker) into ``out_dir``."""
    progress("training tokenizer")
    tokenizer = _train_tokenizer(CORPUS_PATH)
    ids = _special_ids(tokenizer)
    _save_tokenizer(tokenizer, out_dir)

    progress("initialising weights")
    config = _make_config(_round_up(tokenizer.get_vocab_size(), VOCAB_MULTIPLE), ids)
    model = _init_model(config, _rare_token_ids(ids, tokenizer.get_vocab_size(), config.vocab_size))

    progress("saving weights")
    with _quiet_progress_bars():
        model.save_pretrained(out_dir, safe_serialization=True)
    _save_generation_config(out_dir, ids)
    num_params = sum(p.numel() for p in model.parameters())
    _write_readme(out_dir, config.vocab_size, num_params)

    progress("checking tokenizer")
    _check_tokenizer(out_dir, ids)
    _write_marker(out_dir, config.vocab_size, num_params)
    _make_readable(out_dir)


# --- tokenizer ---------------------------------------------------------------------------


def _train_tokenizer(corpus_path: pathlib.Path) -> Tokenizer:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus_path.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def _special_ids(tokenizer: Tokenizer) -> TokenIds:
    found = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    ids = [token_id for token_id in found.values() if token_id is not None]
    if len(ids) != len(SPECIAL_TOKENS):
        raise RuntimeError(f"special tokens missing from trained vocabulary: {found}")
    return TokenIds(*ids)


def _save_tokenizer(tokenizer: Tokenizer, out_dir: pathlib.Path) -> None:
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    added_tokens_decoder = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "unk_token": None,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def _check_tokenizer(model_dir: pathlib.Path, ids: TokenIds) -> None:
    """Load the tokenizer the way the server will and fail loudly if it drifts from the recipe."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    sample = "Hello,  world!\n請介紹一下你自己 😀\t(x) -> 42"
    problems: list[str] = []
    if tok.eos_token_id != ids.im_end or tok.pad_token_id != ids.endoftext or tok.bos_token is not None:
        problems.append(f"eos/pad/bos = {tok.eos_token_id}/{tok.pad_token_id}/{tok.bos_token}")
    encoded = tok.encode(sample)
    if tok.decode(encoded) != sample or ids.im_end in encoded:
        problems.append(f"round-trip of {sample!r} gave {tok.decode(encoded)!r}")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    if prompt != f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n":
        problems.append(f"chat template rendered {prompt!r}")
    if problems:
        raise RuntimeError(f"tiny model tokenizer check failed in {model_dir}: {'; '.join(problems)}")


# --- model -------------------------------------------------------------------------------


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _rare_token_ids(ids: TokenIds, tokenizer_size: int, vocab_size: int) -> list[int]:
    """Specials plus any padding rows the tokenizer can never decode."""
    return [*ids.all, *range(tokenizer_size, vocab_size)]


def _make_config(vocab_size: int, ids: TokenIds) -> Qwen2Config:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        use_cache=True,
        use_sliding_window=False,
        max_window_layers=ARCHITECTURE["num_hidden_layers"],
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=ids.im_end,
        pad_token_id=ids.endoftext,
        dtype="float32",
        architectures=["Qwen2ForCausalLM"],
        **ARCHITECTURE,
    )


def _init_model(config: Qwen2Config, rare_ids: list[int]) -> Qwen2ForCausalLM:
    """Randomly initialise the model from a fixed seed and make ``rare_ids`` unlikely outputs."""
    import torch
    from transformers import Qwen2ForCausalLM

    with _float32_default(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen2ForCausalLM(config)
    model.eval()
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, torch.nn.Embedding):
        raise TypeError(f"unexpected input embedding module {type(embedding).__name__}")
    embeddings = embedding.weight
    _check_random_init(embeddings)
    with torch.no_grad():
        embeddings[rare_ids] *= SPECIAL_ROW_SCALE
        # An untied head: the (scaled) embedding, so greedy choices are those of a tied model.
        model.get_output_embeddings().weight.copy_(embeddings * LOGIT_SCALE)
    return model


@contextmanager
def _float32_default() -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _check_random_init(embeddings: torch.Tensor) -> None:
    """transformers 5 initialises in ``post_init``; make sure we did not get empty/zero weights."""
    import torch

    std = float(embeddings.detach().std())
    if embeddings.dtype != torch.float32 or not 0.01 < std < 0.04:
        raise RuntimeError(f"unexpected weight init: dtype={embeddings.dtype} std={std:.4g}")


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide the "Writing model shards" bar that ``save_pretrained`` draws on stderr."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _save_generation_config(out_dir: pathlib.Path, ids: TokenIds) -> None:
    from transformers import GenerationConfig

    generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[ids.im_end, ids.endoftext],
        pad_token_id=ids.endoftext,
        do_sample=False,
    )
    generation_config.save_pretrained(out_dir)


# --- files -------------------------------------------------------------------------------


def _write_readme(out_dir: pathlib.Path, vocab_size: int, num_params: int) -> None:
    text = f"""# {DEFAULT_MODEL_NAME}

A tiny **random-weight** Qwen2-architecture causal language model that pdserve builds
locally (`pdserve.engine.tiny_model`) so it can run and be tested without downloads.

**Its output is not meaningful text.** The weights are random (seed {SEED}); only the
shapes, the tokenizer and the file layout are real. The special-token embedding rows are
scaled by {SPECIAL_ROW_SCALE} and the LM head is the embedding times {LOGIT_SCALE}, so that EOS
is practically never sampled and `max_new_tokens` decides the reply length.

- architecture: Qwen2ForCausalLM, float32, untied LM head
- layers: {ARCHITECTURE["num_hidden_layers"]}, hidden size: {ARCHITECTURE["hidden_size"]}, \
heads: {ARCHITECTURE["num_attention_heads"]} query / {ARCHITECTURE["num_key_value_heads"]} key-value
- parameters: {num_params:,}
- vocabulary: {vocab_size} (byte-level BPE trained on `engine/data/tiny_corpus.txt`)
- chat format: ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`), EOS `<|im_end|>`
"""
    (out_dir / "README.md").write_text(text, encoding="utf-8")


def _write_marker(out_dir: pathlib.Path, vocab_size: int, num_params: int) -> None:
    files = sorted(p for p in out_dir.iterdir() if p.is_file() and p.name != MARKER_NAME)
    marker = {
        "name": DEFAULT_MODEL_NAME,
        "recipe_version": RECIPE_VERSION,
        "vocab_size": vocab_size,
        "num_parameters": num_params,
        "sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
    }
    _write_json(out_dir / MARKER_NAME, marker)


def _make_readable(out_dir: pathlib.Path) -> None:
    """``mkdtemp`` makes the directory 0700 and safetensors writes 0600; publish it world-readable."""
    for path in out_dir.iterdir():
        path.chmod(0o644)
    out_dir.chmod(0o755)


def _write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _is_complete(model_dir: pathlib.Path) -> bool:
    try:
        marker = json.loads((model_dir / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("recipe_version") == RECIPE_VERSION


def _publish(staging: pathlib.Path, target: pathlib.Path, progress: ProgressFn) -> None:
    """Rename ``staging`` to ``target``; if another process got there first, keep theirs."""
    if target.exists() and not _is_complete(target):
        progress(f"replacing incomplete or outdated {target}")
        _discard(target)
    try:
        os.rename(staging, target)
    except OSError:
        if _is_complete(target):
            progress(f"another process built {target} first; using it")
            return
        raise
    progress(f"model ready at {target}")


def _discard(path: pathlib.Path) -> None:
    graveyard = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, graveyard)
    except FileNotFoundError:
        return
    shutil.rmtree(graveyard, ignore_errors=True)


def _ignore(_message: str) -> None:
    return None
