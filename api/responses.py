"""OpenAI's Responses API, ``POST /v1/responses``, over the chat pipeline.

A request's ``input`` (a string, or a list of items: messages, earlier function calls and
their outputs) and ``instructions`` become chat messages, its ``tools``, ``tool_choice``,
``text.format``, ``reasoning.effort`` and sampling knobs the chat request's, which
:func:`~pdserve.api.protocol.parse_chat` validates and renders as for
``/v1/chat/completions``; the reply comes back as output items: a ``reasoning`` item (a
thinking model's), a ``message`` with its ``output_text``, and a ``function_call`` per call.
Streamed, as the Responses events (``response.created``, ``response.output_text.delta``, ...,
``response.completed``), each with its ``sequence_number``.

Nothing is stored: ``previous_response_id``, ``background``, ``include`` and
``conversation`` are refused (400 ``unsupported_parameter``), and a response says
``"store": false`` whatever the request said.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pdserve.api import routes
from pdserve.api.completion import Delta, total_usage
from pdserve.api.errors import APIError, bad_request
from pdserve.api.http import ORJSONResponse
from pdserve.api.protocol import Limits, Parsed, parse_chat
from pdserve.schemas import Usage

# what the Responses API has that a server without storage or built-in tools cannot do
UNSERVED = ("previous_response_id", "background", "conversation", "prompt")
# Responses knobs that go to the chat request under the same name
SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "seed", "top_k", "min_p", "stop")


def _content(item: dict[str, Any], role: str) -> str:
    """A message item's content as text: a string, or its ``input_text``/``output_text`` parts."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("a message's 'content' must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(
                f"a {role} message's parts may only be text ('input_text', 'output_text'), not {kind!r}",
                "input",
                "unsupported_parameter",
            )
        texts.append(part["text"])
    return "".join(texts)


def to_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages (function calls as an assistant's
    ``tool_calls``, their outputs as ``tool`` messages)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    for item in items:
        if not isinstance(item, dict):
            raise bad_request("each of 'input' must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"a message's 'role' must be user, system, developer or assistant, not {role!r}", "input"
                )
            messages.append({"role": "system" if role == "developer" else role, "content": _content(item, role)})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise bad_request("a 'function_call' item needs 'call_id', 'name' and 'arguments' strings", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise bad_request("a 'function_call_output' item needs 'call_id' and 'output' strings", "input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: chat templates drop it from the history too
        else:
            raise bad_request(f"input items of type {kind!r} are not supported", "input", "unsupported_parameter")
    return messages


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"only function tools are served, not {kind!r}", "tools", "unsupported_parameter")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    chat["tools"] = out
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("'tool_choice' must be auto, none, required or a function by name", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice


def _format(body: dict[str, Any], chat: dict[str, Any]) -> None:
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", "text")
    if fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        raise bad_request("'text.format' must be of type text, json_object or json_schema", "text")


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses request stands for."""
    for key in UNSERVED:
        if body.get(key) is not None:
            raise bad_request(
                f"'{key}' is not supported by this server (it stores nothing)", key, "unsupported_parameter"
            )
    include = body.get("include")
    if include:  # (an empty list asks for nothing)
        raise bad_request("'include' is not supported by this server", "include", "unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("'truncation' may only be 'disabled' here", "truncation", "unsupported_parameter")
    if body.get("top_logprobs"):
        raise bad_request("'top_logprobs' is not served on /v1/responses", "top_logprobs", "unsupported_parameter")
    chat: dict[str, Any] = {k: body[k] for k in SAME if k in body}
    chat["messages"] = to_messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    elif reasoning is not None and not isinstance(reasoning, dict):
        raise bad_request("'reasoning' must be an object", "reasoning")
    _tools(body, chat)
    _format(body, chat)
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    return chat


def parse_responses(body: dict[str, Any], info: Any, limits: Limits) -> Parsed:
    return parse_chat(to_chat(body), info, limits)


def _usage(usage: Usage | None, reasoning_tokens: int) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class _Response:
    """The response object, as the request and what came back so far make it."""

    def __init__(self, body: dict[str, Any], name: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body, self.name = body, name
        self.output: list[dict[str, Any]] = []

    def render(self, status: str, usage: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "model": self.name,
            "output": self.output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"), "summary": None},
            "store": False,
            "temperature": b.get("temperature"),
            "text": {"format": fmt},
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "top_p": b.get("top_p"),
            "truncation": "disabled",
            "usage": usage,
            "user": b.get("user"),
            "metadata": b.get("metadata") or {},
        }


def _reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": f"rs_{uuid.uuid4().hex}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def _status(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "completed"


async def responses(request: Request) -> Response:
    seen: dict[str, Any] = {}

    def parse(body: dict[str, Any], info: Any, limits: Limits) -> Parsed:
        seen.update(body)
        return parse_responses(body, info, limits)

    state, parsed = await routes._parse(request, parse)
    body = seen
    job = parsed.jobs[0]
    response = _Response(body, state.info.name)
    rid = response.id
    if parsed.stream:
        first, rest = await routes._open_stream(request, state, job, rid, parsed.skip_special_tokens)
        usage = routes._Usage(1, len(job.prompt_ids))
        head = {"id": rid, "object": "chat.completion.chunk", "created": response.created, "model": response.name}
        chat = routes._ChatStream(state, head, parsed, usage)
        events = _Events(response, chat, usage, state.info.tokenizer)
        return StreamingResponse(events.body(first, rest), media_type="text/event-stream", headers=routes.SSE_HEADERS)
    (samples,) = await routes._collect_all(request, state, parsed, rid, parsed.skip_special_tokens)
    assert not isinstance(samples, APIError)
    result = samples[0]
    choice = routes._chat_choice(state, parsed, 0, result)
    message = choice["message"]
    thinking = message.get("reasoning_content")
    if thinking:
        response.output.append(_reasoning_item(thinking))
    if message.get("content"):
        response.output.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        response.output.append(_call_item(call))
    reasoning_tokens = len(state.info.tokenizer.encode(thinking, add_special_tokens=False)) if thinking else 0
    totals = _usage(total_usage(samples), reasoning_tokens)
    return ORJSONResponse(response.render(_status(result.finish_reason), totals, result.finish_reason))


class _Events:
    """A streamed response: the chat stream's chunks (:class:`routes._ChatStream`) as the
    Responses events, an output item open at a time (thinking, then text, then calls)."""

    def __init__(self, response: _Response, chat: Any, usage: Any, tokenizer: Any) -> None:
        self.response, self.chat, self.usage, self.tokenizer = response, chat, usage, tokenizer
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the output item being written
        self.text = ""  # its text so far (a reasoning item's, a message's, a call's arguments)
        self.reasoning = ""  # every thinking text (its tokens counted at the end)

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _index(self) -> int:
        return len(self.response.output) - 1

    def _start(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.response.output.append(item)
        self.open, self.text = item, ""
        out.append(self._event("response.output_item.added", output_index=self._index(), item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index(),
                    content_index=0,
                    part=part,
                )
            )
        return out

    def _close(self) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        self.open = None
        where = {"item_id": item["id"], "output_index": self._index()}
        out = []
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": self.text}]
            out.append(self._event("response.reasoning_text.done", **where, content_index=0, text=self.text))
        elif item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out.append(self._event("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[]))
            out.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        else:
            item["arguments"] = self.text
            out.append(self._event("response.function_call_arguments.done", **where, arguments=self.text))
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=self._index(), item=item))
        return out

    def _write(self, kind: str, delta: str) -> list[bytes]:
        self.text += delta
        assert self.open is not None
        where = {"item_id": self.open["id"], "output_index": self._index()}
        if kind == "reasoning":
            return [self._event("response.reasoning_text.delta", **where, content_index=0, delta=delta)]
        if kind == "message":
            return [self._event("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[])]
        return [self._event("response.function_call_arguments.delta", **where, delta=delta)]

    def render(self, i: int, d: Delta) -> list[bytes]:
        out: list[bytes] = []
        (choice,) = self.chat.render(i, d)[0]["choices"]
        delta = choice["delta"]
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._start(_reasoning_item("", "in_progress"))
            self.reasoning += delta["reasoning_content"]
            out += self._write("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._start(_message_item("", "in_progress"))
            out += self._write("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function", {})
            if "name" in function:  # a new call (whole, or a forced one's first fragment)
                out += self._start(_call_item({**call, "function": {**function, "arguments": ""}}, "in_progress"))
            if function.get("arguments"):
                out += self._write("function_call", function["arguments"])
        if choice["finish_reason"] is not None:
            out += self._close()
            reasoning_tokens = (
                len(self.tokenizer.encode(self.reasoning, add_special_tokens=False)) if self.reasoning else 0
            )
            usage = _usage(self.usage.total(), reasoning_tokens)
            status = _status(d.finish_reason)
            final = self.response.render(status, usage, d.finish_reason)
            out.append(self._event(f"response.{status}", response=final))
        return out

    async def body(
        self, first: tuple[int, Delta] | None, rest: AsyncIterator[tuple[int, Delta]]
    ) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=self.response.render("in_progress"))
        yield self._event("response.in_progress", response=self.response.render("in_progress"))
        async for event in routes.events_body(first, rest, self.render, self._error):
            yield event

    def _error(self, error: APIError) -> bytes:
        return self._event("error", code=error.code, message=error.message, param=error.param)
