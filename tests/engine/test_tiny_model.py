"""Tests for pdserve.engine.tiny_model: the locally built random-weight Qwen2 model."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    Qwen2ForCausalLM,
)

from pdserve.engine import tiny_model
from pdserve.engine.tiny_model import DEFAULT_MODEL_NAME, ensure_default_model

ROUND_TRIP_TEXTS = [
    "請介紹一下你自己",
    "请介绍一下你自己",
    "Hello, world! How are you today?",
    "  leading, trailing and    multiple   spaces  ",
    "line one\nline two\n\n\ttabbed\r\nwindows line\n",
    "emoji 😀🚀👍🏽 and a ZWJ sequence 👩‍💻",
    "mixed 中文 English 123 ½ ∑ Ω «» — “quotes”",
    "not in the corpus: 안녕하세요 مرحبا नमस्ते ሰላም",
    "control bytes \x00\x01\x7f and a BOM \ufeff",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[str]]:
    data_dir = tmp_path_factory.mktemp("data")
    messages: list[str] = []
    model_dir = ensure_default_model(data_dir, progress=messages.append)
    return model_dir, messages


@pytest.fixture(scope="module")
def model_dir(built: tuple[pathlib.Path, list[str]]) -> pathlib.Path:
    return built[0]


@pytest.fixture(scope="module")
def tok(model_dir: pathlib.Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: pathlib.Path) -> Qwen2ForCausalLM:
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    assert isinstance(loaded, Qwen2ForCausalLM)
    return loaded.eval()


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _copy_files(src: pathlib.Path, dst: pathlib.Path) -> None:
    for path in src.iterdir():
        shutil.copy2(path, dst / path.name)


# --- layout ------------------------------------------------------------------------------


def test_layout_and_progress(built: tuple[pathlib.Path, list[str]]) -> None:
    model_dir, messages = built
    assert model_dir.name == DEFAULT_MODEL_NAME
    assert model_dir.parent.name == "models"
    names = {p.name for p in model_dir.iterdir()}
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    }
    assert expected | {"tokenizer_config.json", "README.md", tiny_model.MARKER_NAME} <= names
    # Only the published directory is left behind: no temp/staging directories.
    assert [p.name for p in model_dir.parent.iterdir()] == [DEFAULT_MODEL_NAME]
    assert "training tokenizer" in messages and "initialising weights" in messages
    assert "not meaningful" in (model_dir / "README.md").read_text(encoding="utf-8")


def test_corpus_is_reasonable() -> None:
    text = tiny_model.CORPUS_PATH.read_text(encoding="utf-8")
    assert 40_000 <= len(text.encode("utf-8")) <= 80_000
    assert "請介紹一下你自己" in text and "请介绍一下你自己" in text


# --- tokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tok: PreTrainedTokenizerBase, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == tok.encode(text, add_special_tokens=False)  # no BOS/EOS insertion
    assert not set(ids) & set(tok.all_special_ids)


def test_non_nfc_text_is_normalised(tok: PreTrainedTokenizerBase) -> None:
    # transformers 5 rebuilds Qwen2Tokenizer with an NFC normaliser; the recipe matches it.
    assert tok.decode(tok.encode("cafe\u0301")) == "caf\u00e9"


def test_raw_tokenizer_json_matches_auto_tokenizer(model_dir: pathlib.Path, tok: PreTrainedTokenizerBase) -> None:
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in [*ROUND_TRIP_TEXTS, "<|im_start|>user\nhi<|im_end|>\n"]:
        assert raw.encode(text).ids == tok.encode(text), text


def test_tokenizer_learned_useful_merges(tok: PreTrainedTokenizerBase) -> None:
    assert len(tok) == tiny_model.TOKENIZER_VOCAB_SIZE
    # Byte-level fallback alone would need 3 tokens per CJK character.
    assert len(tok.encode("請介紹一下你自己")) < 8
    assert len(tok.encode("请介绍一下你自己")) < 8
    assert len(tok.encode("The serving system")) == 3


def test_special_tokens(model_dir: pathlib.Path, tok: PreTrainedTokenizerBase) -> None:
    im_start, im_end, endoftext = (
        tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    )
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == endoftext
    assert tok.bos_token is None
    assert tok.encode("<|im_start|>x<|im_end|>")[::2] == [im_start, im_end]
    assert tok.decode([im_start, *tok.encode("x"), im_end], skip_special_tokens=True) == "x"

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    assert config["eos_token_id"] == im_end
    assert config["pad_token_id"] == endoftext
    assert config["bos_token_id"] is None
    generation = GenerationConfig.from_pretrained(model_dir)
    assert generation.eos_token_id == [im_end, endoftext]
    assert generation.pad_token_id == endoftext
    assert generation.do_sample is False


def test_chat_template(tok: PreTrainedTokenizerBase) -> None:
    def render(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        rendered = tok.apply_chat_template(
            messages,  # type: ignore[arg-type]  # the stubs only allow string content
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        assert isinstance(rendered, str)
        return rendered

    user_hi: dict[str, Any] = {"role": "user", "content": "hi"}
    assert render([user_hi]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render([user_hi], add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    conversation: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        user_hi,
        {"role": "assistant", "content": "你好！"},
        {"role": "user", "content": [{"type": "text", "text": "請介紹一下你自己"}]},
    ]
    assert render(conversation) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n你好！<|im_end|>\n"
        "<|im_start|>user\n請介紹一下你自己<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template([user_hi], add_generation_prompt=True, tokenize=True, return_dict=False)
    token_ids = [i for i in ids if isinstance(i, int)] if isinstance(ids, list) else []
    assert token_ids == ids
    assert tok.decode(token_ids) == render([user_hi])


# --- model -------------------------------------------------------------------------------


def test_model_config_and_weights(model: Qwen2ForCausalLM, tok: PreTrainedTokenizerBase) -> None:
    config = model.config
    assert config.model_type == "qwen2"
    shape = (config.hidden_size, config.num_hidden_layers, config.intermediate_size)
    assert shape == (256, 4, 768)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 4096
    assert config.rope_parameters is not None
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.tie_word_embeddings is False
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(tok)
    assert model.dtype == torch.float32

    embeddings = model.model.embed_tokens.weight.detach()
    assert torch.allclose(model.lm_head.weight, embeddings * tiny_model.LOGIT_SCALE)
    assert 0.015 < float(embeddings.std()) < 0.025  # random normal(0, 0.02), not zeros/empty
    q_proj = model.model.layers[0].self_attn.q_proj.weight.detach()
    assert 0.015 < float(q_proj.std()) < 0.025
    typical = float(embeddings.norm(dim=1).mean())
    for token_id in (
        tok.eos_token_id,
        tok.pad_token_id,
        tok.convert_tokens_to_ids("<|im_start|>"),
    ):
        assert float(embeddings[token_id].norm()) < 0.1 * typical


def test_greedy_generate(model: Qwen2ForCausalLM, tok: PreTrainedTokenizerBase) -> None:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "請介紹一下你自己"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    inputs = tok(prompt, return_tensors="pt")
    outputs = [
        model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id) for _ in range(2)
    ]
    new_tokens = outputs[0][0, inputs["input_ids"].shape[1] :]
    assert new_tokens.shape == (16,)  # EOS is rare, so max_new_tokens decides the length
    assert torch.equal(outputs[0], outputs[1])
    assert isinstance(tok.decode(new_tokens), str)


# --- building ----------------------------------------------------------------------------


def test_second_call_reuses_directory(model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_rebuild(out_dir: pathlib.Path, progress: Callable[[str], None]) -> None:
        raise AssertionError("model directory was rebuilt")

    monkeypatch.setattr(tiny_model, "build_model_dir", no_rebuild)
    marker = model_dir / tiny_model.MARKER_NAME
    before = (model_dir.stat().st_mtime_ns, marker.stat().st_mtime_ns)
    messages: list[str] = []
    start = time.perf_counter()
    assert ensure_default_model(model_dir.parent.parent, progress=messages.append) == model_dir
    assert time.perf_counter() - start < 2.0  # (a loaded CI runner: far from a rebuild's minute)
    assert (model_dir.stat().st_mtime_ns, marker.stat().st_mtime_ns) == before
    assert messages == []


def test_deterministic_across_directories(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    other = ensure_default_model(tmp_path / "other")
    assert other != model_dir
    for name in ("tokenizer.json", "model.safetensors"):
        assert _sha256(other / name) == _sha256(model_dir / name), name
    assert {p.name: _sha256(p) for p in other.iterdir()} == {p.name: _sha256(p) for p in model_dir.iterdir()}


def test_concurrent_winner_is_kept(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "models" / DEFAULT_MODEL_NAME

    def lose_the_race(out_dir: pathlib.Path, progress: Callable[[str], None]) -> None:
        shutil.copytree(model_dir, target)  # "another process" publishes first
        (out_dir / "ours.txt").write_text("ours", encoding="utf-8")

    monkeypatch.setattr(tiny_model, "build_model_dir", lose_the_race)
    messages: list[str] = []
    assert ensure_default_model(tmp_path, progress=messages.append) == target
    assert not (target / "ours.txt").exists()
    assert (target / tiny_model.MARKER_NAME).is_file()
    assert os.listdir(target.parent) == [DEFAULT_MODEL_NAME]
    assert any("another process" in m for m in messages)


def test_incomplete_directory_is_replaced(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}", encoding="utf-8")  # no marker: a broken leftover
    monkeypatch.setattr(
        tiny_model,
        "build_model_dir",
        lambda out_dir, progress: _copy_files(model_dir, out_dir),
    )
    assert ensure_default_model(tmp_path) == target
    assert _sha256(target / "config.json") == _sha256(model_dir / "config.json")
    assert os.listdir(target.parent) == [DEFAULT_MODEL_NAME]
