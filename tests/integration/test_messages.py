"""Anthropic's Messages API (``POST /v1/messages``) through the whole system (`pdserve up`, PD
mode, the real tiny model) with the official `anthropic` client: the reply equals the chat
completion of the same messages (greedy), whole and streamed as Anthropic's events; a forced
tool as a ``tool_use`` block, streamed as ``input_json_delta``s; tool results sent back; a stop
sequence; an assistant prefill; errors in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0}
TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, nats_for_module: Any, system_control: Any
) -> Iterator[Any]:
    start, stop = system_control
    s = start(tmp_path_factory.mktemp("messages"), tiny_model_dir, nats_for_module.url)
    yield s
    stop(s)


@pytest.fixture
def client(system: Any) -> Any:
    return anthropic.AsyncAnthropic(base_url=system.url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture
def chat(system: Any) -> Any:
    return openai.AsyncOpenAI(base_url=system.url + "/v1", api_key="none", max_retries=0, timeout=120)


async def test_a_message_is_the_chat_completion_of_its_messages_whole_and_streamed(
    system: Any, client: Any, chat: Any
) -> None:
    asked = [{"role": "user", "content": "Name a colour."}]
    want = await chat.chat.completions.create(
        model=system.model_name,
        messages=[{"role": "system", "content": "Be brief."}, *asked],
        max_tokens=12,
        temperature=0,
    )
    # (this client takes no temperature of its own: greedy as an extra field)
    common = {"model": system.model_name, "system": "Be brief.", "max_tokens": 12, "extra_body": GREEDY}
    whole = await client.messages.create(messages=asked, **common)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == want.choices[0].message.content
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    prompt = want.usage.prompt_tokens
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == prompt
    assert whole.usage.cache_read_input_tokens > 0  # the same prompt as the chat request's: found cached
    async with client.messages.stream(messages=asked, **common) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "content_block")]  # (the SDK's own helpers)
    assert kinds[0] == "message_start" and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    # a stop sequence: the text cut before it, the sequence named
    text = whole.content[0].text
    cut = next(
        text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
    )
    stopped = await client.messages.create(messages=asked, stop_sequences=[cut], **common)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == cut
    assert stopped.content[0].text == text[: text.index(cut)]


async def test_a_forced_tool_is_a_tool_use_block_and_its_result_goes_back(system: Any, client: Any, chat: Any) -> None:
    common = {"model": system.model_name, "tools": [TOOL], "max_tokens": 60, "extra_body": GREEDY}
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    whole = await client.messages.create(messages=asked, tool_choice={"type": "tool", "name": "get_weather"}, **common)
    (use,) = whole.content
    assert use.type == "tool_use" and use.name == "get_weather" and whole.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    async with client.messages.stream(
        messages=asked, tool_choice={"type": "tool", "name": "get_weather"}, **common
    ) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    parts = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(parts) == use.input and final.content[0].input == use.input
    # the call and its result sent back: as the chat request of the same conversation
    follow = [
        *asked,
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temp": 21}'}]},
    ]
    after = await client.messages.create(model=system.model_name, messages=follow, max_tokens=6, extra_body=GREEDY)
    same = await chat.chat.completions.create(
        model=system.model_name,
        messages=[
            *asked,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": '{"temp": 21}'},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert after.content[0].text == same.choices[0].message.content


async def test_an_assistant_prefill_is_continued(system: Any, client: Any, chat: Any) -> None:
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    got = await client.messages.create(model=system.model_name, messages=messages, max_tokens=5, extra_body=GREEDY)
    want = await chat.chat.completions.create(
        model=system.model_name,
        messages=messages,
        max_tokens=5,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert got.content[0].text == want.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400),  # no max_tokens
        ({"max_tokens": 4, "messages": []}, 400),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search"}]}, 400),
    ],
)
async def test_errors_come_in_anthropic_s_shape(system: Any, body: dict[str, Any], status: int) -> None:
    async with httpx.AsyncClient(base_url=system.url, timeout=30) as http:
        r = await http.post("/v1/messages", json={"model": system.model_name, **body})
    assert r.status_code == status
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
