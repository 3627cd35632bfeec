"""Anthropic's Messages API, ``POST /v1/messages``, over the chat pipeline.

``system`` and ``messages`` (text blocks, an assistant's ``tool_use`` blocks, a user's
``tool_result`` blocks) become chat messages; ``tools`` (``input_schema``), ``tool_choice``
(``auto``, ``any``, ``tool``, ``none``), ``stop_sequences``, ``thinking`` and the sampling
knobs the chat request's, which :func:`~pdserve.api.protocol.parse_chat` validates and
renders as for ``/v1/chat/completions``. The reply's content blocks: ``thinking`` (a thinking
model's), ``text``, and a ``tool_use`` per call; ``stop_reason`` ``end_turn``,
``max_tokens``, ``stop_sequence`` or ``tool_use``; ``usage`` with the prompt's cached part
as ``cache_read_input_tokens``. Streamed as its events (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``). Errors
in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pdserve.api import routes
from pdserve.api.completion import Delta, Result, total_usage
from pdserve.api.errors import APIError, bad_request
from pdserve.api.http import ORJSONResponse
from pdserve.api.protocol import Limits, Parsed, parse_chat
from pdserve.schemas import Usage

SAME = ("model", "temperature", "top_p", "top_k", "max_tokens", "stream")


def _text(blocks: Any, where: str) -> str:
    """A content of text: a string, or text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", "messages")
    out = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad_request(
                f"{where} may hold only text blocks here, not {kind!r}", "messages", "unsupported_parameter"
            )
        out.append(block["text"])
    return "".join(out)


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user's tool results each a ``tool`` message)."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad_request(f"messages[{i}] must be an object with role user or assistant", "messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"messages[{i}].content must be a string or a list of content blocks", "messages")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"messages[{i}]: a tool_use block needs 'id' and 'name'", "messages")
            arguments = orjson.dumps(block.get("input", {})).decode()
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"messages[{i}]: a tool_result block needs 'tool_use_id'", "messages")
            text = _text(block.get("content", ""), f"messages[{i}]'s tool_result")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's thinking: chat templates drop it from the history too
        else:
            raise bad_request(
                f"messages[{i}]: content blocks of type {kind!r} are not supported here",
                "messages",
                "unsupported_parameter",
            )
    out = list(results)
    if calls:
        out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
    elif texts or not results:
        out.append({"role": role, "content": "".join(texts)})
    return out


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request an Anthropic Messages request stands for."""
    if body.get("max_tokens") is None:
        raise bad_request("'max_tokens' is required", "max_tokens")
    chat: dict[str, Any] = {k: body[k] for k in SAME if k in body}
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text(system, "'system'")})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(given):
        messages += _message(m, i)
    chat["messages"] = messages
    if messages[-1]["role"] == "assistant":  # Anthropic's prefill: the reply goes on with it
        chat["continue_final_message"] = True
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        chat["reasoning_effort"] = "none"
    elif thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "enabled"):
        raise bad_request("'thinking' must be {'type': 'enabled' | 'disabled'}", "thinking")
    _tools(body, chat)
    return chat


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list", "tools")
        out = []
        for tool in tools:
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
                raise bad_request(
                    "only custom tools with an 'input_schema' are served", "tools", "unsupported_parameter"
                )
            function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if "description" in tool:
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
        chat["tools"] = out
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in ("auto", "any", "none"):
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise bad_request("'tool_choice' must be of type auto, any, tool (with a name) or none", "tool_choice")
    if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def parse_messages(body: dict[str, Any], info: Any, limits: Limits) -> Parsed:
    return parse_chat(to_chat(body), info, limits)


def _error(exc: APIError) -> Response:
    return ORJSONResponse(
        {"type": "error", "error": {"type": exc.type, "message": exc.message}},
        status_code=exc.status,
        headers=exc.headers,
    )


def _stop(reason: str | None, matched: str | int | None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat finish reason."""
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _usage(usage: Usage | None) -> dict[str, int]:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,  # (Anthropic's: the part not read from a cache)
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_block(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = orjson.loads(call["function"]["arguments"] or "{}")
    except orjson.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments}


async def messages(request: Request) -> Response:
    try:
        return await _messages(request)
    except APIError as exc:
        return _error(exc)


async def _messages(request: Request) -> Response:
    state, parsed = await routes._parse(request, parse_messages)
    job = parsed.jobs[0]
    rid = f"msg_{uuid.uuid4().hex}"
    name = state.info.name
    if parsed.stream:
        first, rest = await routes._open_stream(request, state, job, rid, parsed.skip_special_tokens)
        usage = routes._Usage(1, len(job.prompt_ids))
        head = {"id": rid, "object": "chat.completion.chunk", "created": 0, "model": name}
        chat = routes._ChatStream(state, head, parsed, usage)
        events = _Events(rid, name, len(job.prompt_ids), chat, usage)
        return StreamingResponse(events.body(first, rest), media_type="text/event-stream", headers=routes.SSE_HEADERS)
    (samples,) = await routes._collect_all(request, state, parsed, rid, parsed.skip_special_tokens)
    assert not isinstance(samples, APIError)
    result: Result = samples[0]
    choice = routes._chat_choice(state, parsed, 0, result)
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    content += [_tool_block(call) for call in message.get("tool_calls") or []]
    stop_reason, stop_sequence = _stop(choice["finish_reason"], result.stop_reason)
    return ORJSONResponse(
        {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "model": name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(total_usage(samples)),
        }
    )


class _Events:
    """A streamed message: the chat stream's chunks (:class:`routes._ChatStream`) as
    Anthropic's events, a content block open at a time (thinking, then text, then tool uses)."""

    def __init__(self, rid: str, name: str, prompt_tokens: int, chat: Any, usage: Any) -> None:
        self.rid, self.name, self.prompt_tokens, self.chat, self.usage = rid, name, prompt_tokens, chat, usage
        self.index = -1
        self.open: str | None = None  # the kind of the block being written

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return [*out, self._event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=self.index)]

    def render(self, i: int, d: Delta) -> list[bytes]:
        out: list[bytes] = []
        (choice,) = self.chat.render(i, d)[0]["choices"]
        delta = choice["delta"]
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
            out.append(self._event("content_block_delta", index=self.index, delta=thinking))
        if delta.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            text = {"type": "text_delta", "text": delta["content"]}
            out.append(self._event("content_block_delta", index=self.index, delta=text))
        for call in delta.get("tool_calls") or []:
            function = call.get("function", {})
            if "name" in function:  # a new call (whole, or a forced one's first fragment)
                block = {"type": "tool_use", "id": call.get("id"), "name": function["name"], "input": {}}
                out += self._start(block)
            if function.get("arguments"):
                part = {"type": "input_json_delta", "partial_json": function["arguments"]}
                out.append(self._event("content_block_delta", index=self.index, delta=part))
        if choice["finish_reason"] is not None:
            out += self._close()
            stop_reason, stop_sequence = _stop(choice["finish_reason"], d.stop_reason)
            usage = _usage(self.usage.total())
            out.append(
                self._event(
                    "message_delta",
                    delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    usage={"output_tokens": usage["output_tokens"]},
                )
            )
            out.append(self._event("message_stop"))
        return out

    async def body(
        self, first: tuple[int, Delta] | None, rest: AsyncIterator[tuple[int, Delta]]
    ) -> AsyncIterator[bytes]:
        start: dict[str, Any] = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        yield self._event("message_start", message=start)
        async for event in routes.events_body(first, rest, self.render, self._error):
            yield event

    def _error(self, error: APIError) -> bytes:
        return self._event("error", error={"type": error.type, "message": error.message})
