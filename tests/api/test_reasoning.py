"""The reasoning split without a server: when it is on, where a reply begins (inside the
thinking when the prompt opened it), and the split the same whole or in any pieces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pdserve.api.errors import APIError
from pdserve.api.model_info import ModelInfo
from pdserve.api.protocol import Limits, parse_chat
from pdserve.api.reasoning import ThinkReader, opens_thinking, resolve_reasoning, split_whole
from tests.api.test_tools import splits

# Generation prompts in the two shapes thinking models use: Qwen3's leaves the tag to the
# model, DeepSeek-R1's opens the thinking itself.
LEAVES = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<A>{% endif %}{# </think> #}"
OPENS = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<A><think>\n{% endif %}{# </think> #}"


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_split_is_on_where_the_template_knows_the_closing_tag(tokenizer: Any) -> None:
    assert not resolve_reasoning(tokenizer).on  # the tiny model's template has no </think>
    assert resolve_reasoning(tokenizer, "think").on
    tokenizer.chat_template = LEAVES
    assert resolve_reasoning(tokenizer).on and not resolve_reasoning(tokenizer, "none").on
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert "special token" in resolve_reasoning(tokenizer).why and not resolve_reasoning(tokenizer).on
    with pytest.raises(ValueError, match="special token"):
        resolve_reasoning(tokenizer, "think")


@pytest.mark.parametrize(
    ("text", "inside", "thinking", "answer"),
    [
        ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.", "Paris."),
        ("  <think>a</think>b", False, "a", "b"),
        ("Let me see.\n</think>\n\nParis.", True, "Let me see.", "Paris."),
        ("Paris, at once.", False, None, "Paris, at once."),
        ("<think>\n\n</think>\n\nParis.", False, "", "Paris."),
        ("<think>cut short by max_tok", False, "cut short by max_tok", ""),
        ("a < b and <thin ice", False, None, "a < b and <thin ice"),
        ("x </thin y", True, "x </thin y", ""),
    ],
)
def test_the_split_is_the_same_whole_or_in_any_pieces(
    text: str, inside: bool, thinking: str | None, answer: str
) -> None:
    assert split_whole(text, inside) == (thinking, answer)
    for pieces in splits(text):
        reader = ThinkReader(inside)
        parts = [reader.feed(piece) for piece in pieces]
        parts.append(reader.finish())
        assert "".join(p[0] for p in parts) == (thinking or "") and "".join(p[1] for p in parts) == answer, pieces


def test_thinking_is_given_out_as_it_comes() -> None:
    reader = ThinkReader()
    assert reader.feed("<thi") == ("", "")
    assert reader.feed("nk>\nstep one ") == ("step one", "")  # the space waits: it may end the thinking
    assert reader.feed("and two </th") == (" and two", "")
    assert reader.feed("ink>\n\nDone") == ("", "Done")


def test_a_prompt_that_opens_the_thinking_starts_the_reply_inside(tokenizer: Any) -> None:
    def info(template: str) -> ModelInfo:
        tokenizer.chat_template = template
        return ModelInfo("m", Path("."), tokenizer, 4096, frozenset(), 0, reasoning=resolve_reasoning(tokenizer))

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert parse_chat(body, info(LEAVES), Limits(16)).thinking is False
    assert parse_chat(body, info(OPENS), Limits(16)).thinking is True
    assert opens_thinking("<A><think>\n") and not opens_thinking("<think>\n\n</think>\n\n")
    shaped = {**body, "response_format": {"type": "json_object"}}
    assert parse_chat(shaped, info(OPENS), Limits(16)).thinking is None  # held to a schema: all answer
    tokenizer.chat_template = LEAVES
    plain = ModelInfo("m", Path("."), tokenizer, 4096, frozenset(), 0)
    assert parse_chat(body, plain, Limits(16)).thinking is None  # the split off


def test_chat_template_kwargs_reach_the_template_and_may_not_replace_its_inputs(tokenizer: Any) -> None:
    tokenizer.chat_template = "{{ messages[0].content }}{% if shout %}!{% endif %}"
    info = ModelInfo("m", Path("."), tokenizer, 4096, frozenset(), 0)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert parse_chat({**body, "chat_template_kwargs": {"shout": True}}, info, Limits(16)).jobs[0].prompt_text == "hi!"
    for bad in ({"messages": []}, {"return_dict": True}, ["shout"], {"shout": "x", "messages": 1}):
        with pytest.raises(APIError) as refused:
            parse_chat({**body, "chat_template_kwargs": bad}, info, Limits(16))
        assert refused.value.param == "chat_template_kwargs"
    # OpenAI's reasoning_effort reaches a template that reads it (Qwen3's enable_thinking too)
    tokenizer.chat_template = (
        "{{ messages[0].content }}{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
        "{% if reasoning_effort is defined %} [{{ reasoning_effort }}]{% endif %}"
    )
    texts = {
        e: parse_chat({**body, "reasoning_effort": e}, info, Limits(16)).jobs[0].prompt_text for e in ("none", "high")
    }
    assert texts == {"none": "hi /no_think [none]", "high": "hi [high]"}
    assert parse_chat(body, info, Limits(16)).jobs[0].prompt_text == "hi"
    tokenizer.chat_template = "{{ messages[0].content + bos }}"  # a value the template cannot add
    with pytest.raises(APIError) as failed:
        parse_chat({**body, "chat_template_kwargs": {"bos": 5}}, info, Limits(16))
    assert failed.value.status == 400 and failed.value.param == "chat_template_kwargs"
