"""OpenAI's Responses API (``POST /v1/responses``) through the whole system (`pdserve up`, PD
mode, the real tiny model) with the official `openai` client: the reply equals the chat
completion of the same messages (greedy), whole and streamed as the Responses events; a
forced function call as a ``function_call`` item, its arguments streamed; earlier calls and
their outputs as input items; what it cannot serve is a 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, nats_for_module: Any, system_control: Any
) -> Iterator[Any]:
    start, stop = system_control
    s = start(tmp_path_factory.mktemp("responses"), tiny_model_dir, nats_for_module.url)
    yield s
    stop(s)


@pytest.fixture
def client(system: Any) -> Any:
    return openai.AsyncOpenAI(base_url=system.url + "/v1", api_key="none", max_retries=0, timeout=120)


async def test_a_response_is_the_chat_completion_of_its_messages_whole_and_streamed(system: Any, client: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = await client.chat.completions.create(
        model=system.model_name, messages=messages, max_tokens=12, temperature=0
    )
    common = {"model": system.model_name, "instructions": "Be brief.", "max_output_tokens": 12, "temperature": 0}
    whole = await client.responses.create(input="Name a colour.", **common)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.usage.output_tokens == 12
    # the same prompt as the chat request's: its pages found in the prefix cache
    assert chat.usage.prompt_tokens_details.cached_tokens == 0 < whole.usage.input_tokens_details.cached_tokens
    assert [item.type for item in whole.output] == ["message"] and whole.store is False
    # the same as a list of items, streamed
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}]
    stream = await client.responses.create(input=items, stream=True, **common)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 12


async def test_a_forced_function_call_is_a_function_call_item_and_its_output_goes_back(
    system: Any, client: Any
) -> None:
    common = {
        "model": system.model_name,
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 60,
        "temperature": 0,
    }
    whole = await client.responses.create(input="Weather in Paris?", **common)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert whole.status == "completed"
    stream = await client.responses.create(input="Weather in Paris?", stream=True, **common)
    events = [event async for event in stream]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments
    done = [e for e in events if e.type == "response.output_item.done"]
    assert len(done) == 1 and done[0].item.arguments == call.arguments
    # the call and its output as input items: a conversation the chat template renders
    follow = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'},
    ]
    after = await client.responses.create(model=system.model_name, input=follow, max_output_tokens=6, temperature=0)
    messages = [
        follow[0],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'},
    ]
    chat = await client.chat.completions.create(model=system.model_name, messages=messages, max_tokens=6, temperature=0)
    assert after.output[0].type == "message" and after.output_text == chat.choices[0].message.content
    assert after.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools", "unsupported_parameter"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "unsupported_parameter"),
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"input": []}, "input", None),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", None),
        ({"text": {"format": {"type": "xml"}}}, "text", None),
    ],
)
async def test_what_is_not_served_is_a_400(
    system: Any, client: Any, extra: dict[str, Any], param: str, code: str | None
) -> None:
    body = {"model": system.model_name, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(**body)
    error = caught.value.body
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code
