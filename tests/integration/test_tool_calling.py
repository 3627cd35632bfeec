"""Tool calling through the whole system (`pdserve up` on a real nats-server and the real
tiny model, whose chat template takes no tools: pdserve's own system message, hermes format),
with the official `openai` client: a named function and ``required`` constrain the output
to calls whose arguments follow the tools' schemas; ``auto`` reads hermes calls out of the
text (the text here forced by a regex, as a trained model would write it), streamed or
whole alike; a conversation with earlier calls and their results; and the 400s."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from pdserve.api.tools import plain_messages, system_message

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# What a model trained on the hermes format writes; the regex makes the tiny model write it.
HERMES = (
    r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}", "unit": "c"\}\}\n'
    r'</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, nats_for_module: Any, system_control: Any
) -> Iterator[Any]:
    start, stop = system_control
    s = start(tmp_path_factory.mktemp("tools"), tiny_model_dir, nats_for_module.url, "--mode", "unified")
    yield s
    stop(s)


@pytest.fixture
def client(system: Any) -> Any:
    return openai.AsyncOpenAI(base_url=system.url + "/v1", api_key="none", max_retries=0, timeout=120)


async def metric(system: Any, name: str) -> float:
    async with httpx.AsyncClient(base_url=system.url, timeout=30) as http:
        text = (await http.get("/metrics")).text
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert found, name
    return float(found.group(1))


async def read_stream(client: Any, **kwargs: Any) -> tuple[str, str, list[dict[str, Any]], str | None]:
    """A stream's reasoning_content and content, joined, its calls (argument fragments joined
    by index) and finish reason."""
    thinking, content, calls, reason = "", "", {}, None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            thinking += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for part in delta.tool_calls or ():
                call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or part.id
                call["name"] = call["name"] or (part.function.name if part.function else None)
                call["arguments"] += (part.function.arguments or "") if part.function else ""
            reason = choice.finish_reason or reason
    return thinking, content, [calls[i] for i in sorted(calls)], reason


async def streamed(client: Any, **kwargs: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """A stream's content, its calls and finish reason."""
    _, content, calls, reason = await read_stream(client, **kwargs)
    return content, calls, reason


async def test_a_named_function_gets_arguments_that_follow_its_schema_streamed_or_not(system: Any, client: Any) -> None:
    before = await metric(system, "pdserve_tool_calls_total")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    common = {"model": system.model_name, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 60}
    reply = await client.chat.completions.create(temperature=0, **common)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, reason = await streamed(client, temperature=0, **common)
    assert content == "" and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert calls[0]["id"].startswith("call_")
    assert await metric(system, "pdserve_tool_calls_total") == before + 2


async def test_required_makes_every_sample_call_known_tools_with_valid_arguments(system: Any, client: Any) -> None:
    common = {"model": system.model_name, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    single = await client.chat.completions.create(
        temperature=1.0, n=8, max_tokens=100, parallel_tool_calls=False, **common
    )
    names = set()
    for c in single.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c.message.content
        (call,) = c.message.tool_calls
        names.add(call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len(single.choices) == 8 and names <= set(SCHEMAS)
    # parallel calls: an array of them, as long as the model makes it (the random model may
    # not close it within max_tokens: then the text comes back as content, counted; an array
    # closed by the last token allowed is read, its reason still "length")
    failures = await metric(system, "pdserve_tool_call_parse_failures_total")
    reply = await client.chat.completions.create(temperature=1.0, n=4, max_tokens=120, **common)
    cut = 0
    for c in reply.choices:
        if c.finish_reason == "length" and c.message.tool_calls is None:
            cut += 1
            assert c.message.content.startswith('[{"name": "get_'), c.message.content
            continue
        assert c.finish_reason in ("tool_calls", "length") and c.message.tool_calls, c.message.content
        assert c.message.content is None
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert await metric(system, "pdserve_tool_call_parse_failures_total") == failures + cut


async def test_auto_reads_hermes_calls_out_of_the_text_streamed_or_whole(system: Any, client: Any) -> None:
    before = await metric(system, "pdserve_tool_calls_total")
    failures = await metric(system, "pdserve_tool_call_parse_failures_total")
    common = {
        "model": system.model_name,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 120,
        "temperature": 0,
        "extra_body": {"guided_regex": HERMES},
    }
    reply = await client.chat.completions.create(**common)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert [name for name, _ in got] == ["get_weather", "get_time"] and got[1][1] == {"zone": "UTC"}
    assert re.fullmatch("[a-z]{2,6}", got[0][1]["city"]) and got[0][1]["unit"] == "c"
    content, calls, reason = await streamed(client, **common)
    assert (content, reason) == ("Checking.\n", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == got
    assert await metric(system, "pdserve_tool_calls_total") == before + 4
    assert await metric(system, "pdserve_tool_call_parse_failures_total") == failures  # the normal path
    # a call to a function not offered is text, counted, never a call
    bad = {**common, "extra_body": {"guided_regex": r'<tool_call>\{"name": "rm_rf", "arguments": \{\}\}</tool_call>'}}
    reply = await client.chat.completions.create(**bad)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert await metric(system, "pdserve_tool_call_parse_failures_total") == failures + 1


async def test_the_prompt_shows_the_tools_earlier_calls_and_their_results(system: Any, tiny_model_dir: Path) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with httpx.AsyncClient(base_url=system.url, timeout=60) as http:
        tokens = (await http.post("/tokenize", json={"messages": history, "tools": TOOLS})).json()
        reply = (
            await http.post(
                "/v1/chat/completions",
                json={"model": system.model_name, "messages": history, "tools": TOOLS, "max_tokens": 4},
            )
        ).json()
        none = (await http.post("/tokenize", json={"messages": history, "tools": TOOLS, "tool_choice": "none"})).json()
    parsed = [
        {
            **m,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in history
    ]
    from pdserve.api.tools import ToolRequest

    text = tokenizer.apply_chat_template(
        plain_messages(parsed, ToolRequest(tuple(TOOLS), "auto")), add_generation_prompt=True, tokenize=False
    )
    assert system_message(tuple(TOOLS)) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    assert tokens["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert reply["usage"]["prompt_tokens"] == tokens["count"]
    assert none["count"] < tokens["count"]  # tool_choice none: the tools are not shown
    async with httpx.AsyncClient(base_url=system.url, timeout=60) as http:
        model = (await http.get("/get_model_info")).json()
    assert (model["tool_call_parser"], model["chat_template_takes_tools"]) == ("hermes", False)
    assert "pdserve's system message" in model["tool_call_parser_reason"]


def test_the_openai_client_example_runs_a_call_and_answers(system: Any) -> None:
    """examples/tool_call.py, as a user runs it: the call, its result sent back, an answer."""
    import subprocess
    import sys

    script = Path(__file__).parents[2] / "examples" / "tool_call.py"
    argv = [sys.executable, str(script), "--base-url", system.url + "/v1", "--tool-choice", "get_weather"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    (call,) = out["calls"]
    assert call["name"] == "get_weather" and call["result"]["city"] == call["arguments"]["city"]
    assert isinstance(out["answer"], str) and "call: get_weather(" in done.stderr


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages",
        ),
    ],
)
async def test_malformed_tools_are_openai_style_400s(system: Any, body: dict[str, Any], param: str) -> None:
    request = {"model": system.model_name, "messages": ASK, "max_tokens": 4, **body}
    async with httpx.AsyncClient(base_url=system.url, timeout=30) as http:
        r = await http.post("/v1/chat/completions", json=request)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


# ---- a thinking model: <think>...</think> goes to reasoning_content ----------------------
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, nats_for_module: Any, system_control: Any
) -> Iterator[Any]:
    """The tiny model with a chat template that knows </think> (as Qwen3's does)."""
    import shutil

    model_dir = tmp_path_factory.mktemp("thinking") / "pdserve-tiny-thinking"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    start, stop = system_control
    s = start(tmp_path_factory.mktemp("thinking-up"), model_dir, nats_for_module.url, "--mode", "unified")
    yield s
    stop(s)


async def stream_parts(client: Any, **kwargs: Any) -> tuple[str, str, int]:
    """A stream's reasoning_content and content, joined, and its tool calls' count."""
    thinking, content, calls, _ = await read_stream(client, **kwargs)
    return thinking, content, len(calls)


async def test_thinking_goes_to_reasoning_content_streamed_or_whole(thinking: Any) -> None:
    client = openai.AsyncOpenAI(base_url=thinking.url + "/v1", api_key="none", max_retries=0, timeout=120)
    regex = r"<think>\n[a-z]{3,8}( [a-z]{3,8}){2}\n</think>\n\nParis is [a-z]{3,8}\."
    common = {
        "model": thinking.model_name,
        "messages": ASK,
        "max_tokens": 80,
        "temperature": 0,
        "extra_body": {"guided_regex": regex},
    }
    reply = await client.chat.completions.create(**common)
    message = reply.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch("[a-z]{3,8}( [a-z]{3,8}){2}", reasoning), reasoning
    assert re.fullmatch(r"Paris is [a-z]{3,8}\.", message.content), message.content
    assert await stream_parts(client, **common) == (reasoning, message.content, 0)
    async with httpx.AsyncClient(base_url=thinking.url, timeout=60) as http:
        info = (await http.get("/get_model_info")).json()
        off = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
        prompt = (await http.post("/tokenize", json=off)).json()
        plain = (
            await http.post(
                "/v1/chat/completions",
                json={"model": thinking.model_name, **off, "max_tokens": 20, "guided_regex": "Plain answer"},
            )
        ).json()
        bad = await http.post("/tokenize", json={"messages": ASK, "chat_template_kwargs": {"tools": []}})
    assert (info["reasoning_parser"], info["reasoning_parser_reason"]) == ("think", "the chat template knows </think>")
    assert (
        AutoTokenizer.from_pretrained(thinking.model_dir).decode(prompt["tokens"]).endswith("<think>\n\n</think>\n\n")
    )
    assert plain["choices"][0]["message"]["content"] == "Plain answer"
    assert plain["choices"][0]["message"]["reasoning_content"] is None
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


async def test_a_thinking_model_calls_tools_after_its_thinking(thinking: Any) -> None:
    client = openai.AsyncOpenAI(base_url=thinking.url + "/v1", api_key="none", max_retries=0, timeout=120)
    regex = (
        r"<think>\nthe user wants weather\n</think>\n\n<tool_call>\n"
        r'\{"name": "get_time", "arguments": \{"zone": "CET"\}\}\n</tool_call>'
    )
    common = {
        "model": thinking.model_name,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 80,
        "temperature": 0,
        "extra_body": {"guided_regex": regex},
    }
    reply = await client.chat.completions.create(**common)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "the user wants weather"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_time", {"zone": "CET"})
    ]
    assert await stream_parts(client, **common) == ("the user wants weather", "", 1)
    # a reply held to a JSON Schema is all answer
    digit = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    shaped = await client.chat.completions.create(
        model=thinking.model_name,
        messages=ASK,
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": digit}},
    )
    assert shaped.choices[0].message.model_extra.get("reasoning_content") is None
    assert json.loads(shaped.choices[0].message.content)["a"] in (1, 2)
