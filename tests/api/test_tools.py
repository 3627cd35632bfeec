"""Tool calling's parts without a server: which format a chat template gets, the request's
tools checked, the schema a forced choice constrains to, the prompt a template that takes
tools (or one that takes none) is given, and calls read out of text however it streams."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from pdserve.api.errors import APIError
from pdserve.api.model_info import ModelInfo
from pdserve.api.protocol import chat_messages, render_chat
from pdserve.api.tools import (
    CallReader,
    ToolFormat,
    ToolRequest,
    finish_reason,
    parse_tools,
    read_whole,
    resolve_format,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = (
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
)
# A template in the shape of Qwen2.5's: tools listed in the system turn, calls as hermes.
NATIVE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
LLAMA = "{%- if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}ipython {{ m.content }}{% endfor %}"
FOREIGN = "{%- if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}[CALLS]{{ m.content }}{% endfor %}"
STRICT = "{%- if messages[0].role != 'user' %}{{ raise_exception('begin with a user turn') }}{%- endif %}{{ messages }}"


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def info_for(tokenizer: Any, template: str | None = None, parser: str = "auto") -> ModelInfo:
    if template is not None:
        tokenizer.chat_template = template
    return ModelInfo("m", Path("."), tokenizer, 4096, frozenset(), 0, tool_format=resolve_format(tokenizer, parser))


def test_the_format_follows_the_chat_template(tokenizer: Any) -> None:
    plain = resolve_format(tokenizer)  # the tiny model's template takes no tools
    assert (plain.name, plain.native) == ("hermes", False)
    for template, name in ((NATIVE, "hermes"), (LLAMA, "llama3_json"), (FOREIGN, None)):
        tokenizer.chat_template = template
        fmt = resolve_format(tokenizer)
        assert (fmt.name, fmt.native) == (name, True), template
    assert resolve_format(tokenizer, "hermes").name == "hermes"  # a flag wins over the template
    assert resolve_format(tokenizer, "none").name is None
    tokenizer.chat_template = "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="llama3_json needs a chat template that takes tools"):
        resolve_format(tokenizer, "llama3_json")
    with pytest.raises(ValueError, match="use one of"):
        resolve_format(tokenizer, "mistral")


def test_auto_is_refused_where_no_format_is_read_but_forced_choices_are_served() -> None:
    none = ToolFormat(None, True, "the chat template's tool format is not one pdserve reads")
    with pytest.raises(APIError) as refused:
        parse_tools({"tools": list(TOOLS)}, none)
    assert refused.value.status == 400 and "not one pdserve reads" in refused.value.message
    forced = parse_tools({"tools": list(TOOLS), "tool_choice": "required"}, none)
    assert forced is not None and forced.forced
    assert parse_tools({"tools": [], "tool_choice": "none"}, none) is None


def test_forced_choices_constrain_to_schemas_that_compile() -> None:
    named = ToolRequest(TOOLS, "function", "get_weather")
    assert json.loads(named.schema()) == WEATHER
    required = ToolRequest(TOOLS, "required")
    one = ToolRequest(TOOLS, "required", parallel=False)
    schema, single = json.loads(required.schema()), json.loads(one.schema())
    assert schema["minItems"] == 1 and "maxItems" not in schema and single["maxItems"] == 1
    consts = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert consts == ["get_time", "get_weather"]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == {"type": "object"}  # no parameters given
    for spec in (named.schema(), required.schema(), one.schema()):
        xgr.Grammar.from_json_schema(spec)


def test_a_template_that_takes_tools_gets_them_and_earlier_calls_as_objects(tokenizer: Any) -> None:
    info = info_for(tokenizer, NATIVE)
    body = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        ],
        "tools": list(TOOLS),
    }
    request = parse_tools(body, info.tool_format)
    text = render_chat(info, chat_messages(body), request)
    assert text.startswith("<|im_start|>system\nTools:" + json.dumps(TOOLS[0]))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>tool\ncold<|im_end|>" in text and text.endswith("<|im_start|>assistant")
    hidden = parse_tools({**body, "tool_choice": "none"}, info.tool_format)
    assert hidden is not None and not hidden.shown
    assert "Tools:" not in render_chat(info, chat_messages(body), hidden)


def test_a_template_that_takes_no_tools_gets_pdserves_system_message(tokenizer: Any) -> None:
    info = info_for(tokenizer)
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "content": "noon"},
            {"role": "tool", "content": "UTC"},
        ],
        "tools": list(TOOLS),
    }
    text = render_chat(info, chat_messages(body), parse_tools(body, info.tool_format))
    system = text[: text.index("<|im_start|>user")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou have functions you can call.")
    assert json.dumps(TOOLS[0]["function"]) in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    # a run of tool results is one user turn
    assert "<|im_start|>user\n<tool_response>\nnoon\n</tool_response>\n<tool_response>\nUTC\n</tool_response>" in text


def test_a_template_refusing_the_messages_is_a_400(tokenizer: Any) -> None:
    info = info_for(tokenizer, STRICT, "hermes")
    with pytest.raises(APIError) as refused:
        render_chat(info, chat_messages({"messages": [{"role": "assistant", "content": "x"}]}), None)
    assert refused.value.status == 400 and "begin with a user turn" in refused.value.message


def splits(text: str, times: int = 100, seed: int = 7) -> list[list[str]]:
    """``times`` random ways of cutting ``text`` into up to seven pieces."""
    rng = random.Random(seed)
    out = []
    for _ in range(times):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


HERMES_TEXT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
)


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls", "failures"),
    [
        ("hermes", HERMES_TEXT, "Let me look.\n", [("get_weather", {"city": "Paris"}), ("get_time", {})], 0),
        ("hermes", "No tools needed <tool", "No tools needed <tool", [], 0),
        (
            "hermes",
            '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {"z": 1}}]</tool_call>',
            None,
            [("get_time", {}), ("get_time", {"z": 1})],
            0,
        ),
        (
            "hermes",
            '<tool_call>[{"name": "get_time"}, {"name": "rm"}]</tool_call>',
            '<tool_call>[{"name": "get_time"}, {"name": "rm"}]</tool_call>',
            [],
            1,
        ),
        (
            "hermes",
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
            [],
            1,
        ),
        ("hermes", 'x <tool_call>{"name": "get_time", "argu', 'x <tool_call>{"name": "get_time", "argu', [], 1),
        (
            "hermes",
            '<tool_call>{"name": "get_time", "arguments": "{\\"a\\": 1}"}</tool_call>',
            None,
            [("get_time", {"a": 1})],
            0,
        ),
        (
            "llama3_json",
            ' {"name": "get_weather", "parameters": {"city": "Rome"}}',
            None,
            [("get_weather", {"city": "Rome"})],
            0,
        ),
        (
            "llama3_json",
            '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}',
            None,
            [("get_time", {})] * 2,
            0,
        ),
        ("llama3_json", "Sure, {braces} in text", "Sure, {braces} in text", [], 0),
        ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', [], 1),
    ],
)
def test_calls_are_read_the_same_whole_or_in_any_pieces(
    fmt: str, text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]], failures: int
) -> None:
    request = ToolRequest(TOOLS, "auto", format=fmt)
    whole = read_whole(request, text)
    assert whole.content == content and whole.failures == failures
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    for pieces in splits(text):
        reader = CallReader(request)
        events = [reader.feed(piece) for piece in pieces]
        events.append(reader.finish())
        streamed = "".join(e.content for e in events)
        assert streamed == (content or ""), pieces
        assert [(c.name, c.arguments) for e in events for c in e.calls] == [(c.name, c.arguments) for c in whole.calls]
        assert sum(e.failures for e in events) == failures


def test_content_is_given_out_as_soon_as_it_cannot_begin_a_call() -> None:
    reader = CallReader(ToolRequest(TOOLS, "auto", format="hermes"))
    assert reader.feed("Hello <to").content == "Hello "
    assert reader.feed("day").content == "<today"
    assert reader.feed("<tool_call>{").content == ""


def test_an_array_closed_by_the_last_token_allowed_is_read_and_its_reason_stays_length() -> None:
    """``required``'s array closed exactly at max_tokens: its calls are given, the reason says
    the model did not end by itself; an array cut before it closes comes back as content."""
    request = ToolRequest(TOOLS, "required", format="hermes")
    whole = read_whole(request, '[{"name": "get_time", "arguments": {}}]')
    assert whole.content is None and whole.failures == 0 and [c.name for c in whole.calls] == ["get_time"]
    assert finish_reason("length", len(whole.calls)) == "length"
    assert finish_reason("stop", len(whole.calls)) == "tool_calls"
    cut = read_whole(request, '[{"name": "get_time", "argu')
    assert cut.calls == [] and cut.content == '[{"name": "get_time", "argu' and cut.failures == 1
    assert finish_reason("length", 0) == "length" and finish_reason("stop", 0) == "stop"
