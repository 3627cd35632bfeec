"""Workload builders: random lengths, ShareGPT parsing and filtering, prefix-chat structure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.client import RequestOptions, build_body
from pdserve.bench.datasets import (
    Tokenizer,
    length_bounds,
    prefix_chat_requests,
    random_requests,
    sharegpt_pairs,
    sharegpt_requests,
)


def test_random_ids_exact_lengths_within_range(tokenizer_dir: Path) -> None:
    tok = Tokenizer(tokenizer_dir)
    assert tok.vocab_size == 202
    assert 201 not in tok.normal_ids  # the special token is never sampled
    reqs = random_requests(200, 100, 20, 0.5, seed=1, tokenizer=tok, form="ids")
    lo, hi = length_bounds(100, 0.5)
    assert (lo, hi) == (50, 150)
    assert all(lo <= r.prompt_len <= hi and len(r.prompt) == r.prompt_len and r.exact for r in reqs)
    assert all(10 <= r.output_len <= 30 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 20  # spread, not constant
    assert all(isinstance(t, int) and 0 <= t < 201 for r in reqs for t in r.prompt)  # type: ignore[union-attr]
    same = random_requests(200, 100, 20, 0.5, seed=1, tokenizer=tok, form="ids")
    assert [r.prompt for r in same] == [r.prompt for r in reqs]


def test_random_mixes_short_prompts_in_when_asked(tokenizer_dir: Path) -> None:
    tok = Tokenizer(tokenizer_dir)
    reqs = random_requests(400, 1000, 20, 0.1, seed=3, tokenizer=tok, form="ids", short_fraction=0.25, short_len=80)
    short = [r for r in reqs if r.prompt_len <= 88]
    assert all(72 <= r.prompt_len for r in short) and all(900 <= r.prompt_len <= 1100 for r in reqs if r not in short)
    assert 70 <= len(short) <= 130  # about a quarter
    plain = random_requests(50, 1000, 20, 0.1, seed=3, tokenizer=tok, form="ids")
    assert [r.prompt for r in plain] == [r.prompt for r in random_requests(50, 1000, 20, 0.1, 3, tok, "ids", 0.0)]
    with pytest.raises(ValueError):
        random_requests(1, 8, 8, 0.0, seed=0, tokenizer=None, form="text", short_fraction=1.5)


def test_random_zero_ratio_is_fixed_and_text_forms(tokenizer_dir: Path) -> None:
    reqs = random_requests(10, 32, 8, 0.0, seed=0, tokenizer=None, form="text")
    assert all(r.output_len == 8 and isinstance(r.prompt, str) and not r.exact for r in reqs)
    tok = Tokenizer(tokenizer_dir)
    texts = random_requests(10, 32, 8, 0.0, seed=0, tokenizer=tok, form="text")
    assert all(r.exact and r.prompt_len == 32 for r in texts)  # word-level: decode/encode round-trips
    chats = random_requests(3, 32, 8, 0.0, seed=0, tokenizer=None, form="chat")
    assert all(r.is_chat and r.prompt[0]["role"] == "user" for r in chats)  # type: ignore[index]
    with pytest.raises(ValueError):
        random_requests(1, 8, 8, 1.0, seed=0, tokenizer=None, form="text")
    with pytest.raises(ValueError):
        random_requests(1, 8, 8, 0.0, seed=0, tokenizer=None, form="ids")


def _sharegpt(tmp_path: Path) -> Path:
    long = " ".join(["w1"] * 2000)
    data = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "w1 w2 w3 w4 w5"},
                {"from": "gpt", "value": "w6 w7 w8 w9 w10 w11"},
            ],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "human", "value": "w2 w3 w4 w5 w6 w7"},
                {"from": "gpt", "value": "w1 w2 w3 w4"},
                {"from": "human", "value": "later"},
            ],
        },
        {
            "id": "short",
            "conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w1 w2 w3 w4 w5"}],
        },
        {"id": "long", "conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "w1 w2 w3 w4"}]},
        {"id": "noreply", "conversations": [{"from": "human", "value": "w1 w2 w3 w4"}]},
        {
            "id": "gptfirst",
            "conversations": [{"from": "gpt", "value": "w1 w2 w3 w4"}, {"from": "human", "value": "w1 w2 w3 w4"}],
        },
        {"id": "empty", "conversations": []},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_parsing_and_filters(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = _sharegpt(tmp_path)
    pairs = sharegpt_pairs(path)
    assert ("w1 w2 w3 w4 w5", "w6 w7 w8 w9 w10 w11") in pairs
    assert ("w2 w3 w4 w5 w6 w7", "w1 w2 w3 w4") in pairs
    assert len(pairs) == 4  # a, b, short, long (noreply / gptfirst / empty have no human->gpt first turn)
    tok = Tokenizer(tokenizer_dir)
    reqs = sharegpt_requests(path, 2, seed=0, tokenizer=tok, form="ids")
    lens = sorted((r.prompt_len, r.output_len) for r in reqs)
    assert lens == [(5, 6), (6, 4)]  # "short" (1-token prompt) and "long" (> 1024) are filtered
    fixed = sharegpt_requests(path, 2, seed=0, tokenizer=tok, form="text", fixed_output_len=50)
    assert all(r.output_len == 50 and isinstance(r.prompt, str) for r in fixed)
    cycled = sharegpt_requests(path, 5, seed=0, tokenizer=tok, form="chat")
    assert len(cycled) == 5 and all(r.is_chat for r in cycled)


def test_sharegpt_rejects_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError):
        sharegpt_requests(bad, 1, 0, None, "text")
    none = tmp_path / "none.json"
    none.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]))
    with pytest.raises(ValueError):
        sharegpt_requests(none, 1, 0, None, "text")


def test_prefix_chat_ids_share_prefixes(tokenizer_dir: Path) -> None:
    tok = Tokenizer(tokenizer_dir)
    groups, prefix, turn, out, turns = 3, 40, 5, 7, 3
    reqs = prefix_chat_requests(18, groups, prefix, turn, out, turns, seed=0, tokenizer=tok, form="ids")
    assert len(reqs) == 18
    # ordered turn by turn: all first turns before any second turn
    assert [r.turn for r in reqs] == sorted(r.turn for r in reqs)  # type: ignore[type-var]
    by_key = {(r.group, r.conversation, r.turn): r for r in reqs}
    systems = {}
    for r in reqs:
        assert r.output_len == out and r.exact
        assert r.prompt_len == prefix + (r.turn + 1) * turn + r.turn * out  # type: ignore[operator]
        systems.setdefault(r.group, r.prompt[:prefix])
        assert r.prompt[:prefix] == systems[r.group]  # the group's shared system prompt
        if r.turn:
            earlier = by_key[(r.group, r.conversation, r.turn - 1)]  # type: ignore[operator]
            assert r.prompt[: len(earlier.prompt)] == earlier.prompt  # later turns extend earlier ones
    assert len({tuple(s) for s in systems.values()}) == groups


def test_prefix_chat_messages_and_text() -> None:
    reqs = prefix_chat_requests(8, 2, 30, 4, 6, 2, seed=0, tokenizer=None, form="chat")
    first = [r for r in reqs if r.turn == 0]
    second = [r for r in reqs if r.turn == 1]
    assert len(first) == 4 and len(second) == 4
    for r in second:
        roles = [m["role"] for m in r.prompt]  # type: ignore[index]
        assert roles == ["system", "user", "assistant", "user"]
        same = next(f for f in first if (f.group, f.conversation) == (r.group, r.conversation))
        assert r.prompt[:2] == same.prompt  # type: ignore[index]
    texts = prefix_chat_requests(4, 2, 30, 4, 6, 2, seed=0, tokenizer=None, form="text")
    assert all(isinstance(r.prompt, str) and r.prompt.startswith("System: ") for r in texts)


def test_request_bodies_per_backend() -> None:
    [req] = random_requests(1, 4, 9, 0.0, seed=0, tokenizer=None, form="text")
    body = build_body(req, RequestOptions("openai", "m"))
    assert body["max_tokens"] == 9 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["prompt"] == req.prompt
    body = build_body(req, RequestOptions("openai-chat", "m", ignore_eos=False))
    assert "ignore_eos" not in body and body["messages"] == [{"role": "user", "content": req.prompt}]
    req.prompt = [1, 2, 3]
    body = build_body(req, RequestOptions("generate", None, extra_body={"sampling_params": {"top_k": 5}, "rid": "x"}))
    assert body["input_ids"] == [1, 2, 3] and body["rid"] == "x"
    assert body["sampling_params"] == {"max_new_tokens": 9, "temperature": 0.0, "ignore_eos": True, "top_k": 5}
