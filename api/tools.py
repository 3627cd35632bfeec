"""Tool calling on ``/v1/chat/completions``: a request's ``tools`` and ``tool_choice``
checked, the tools shown to the model (through its chat template where the template takes
them, else in a system message of pdserve's), and the model's calls read back out of its
text into ``tool_calls``, whole or streamed.

Formats read (``--tool-call-parser``): ``hermes``, calls as ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` (Qwen2.5 and Qwen3, Hermes, and what pdserve's own system
message asks of a model whose template takes no tools); ``llama3_json``, a reply that is one
JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1 and later). ``tool_choice``
``required`` or a named function constrain the output to the calls' JSON (the structured
output grammar), so they need no format. Text that starts a call but does not parse as one
(unknown function, broken JSON, cut by ``max_tokens``) is returned as content and counted
(``pdserve_tool_call_parse_failures_total``)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.errors import bad_request

PARSERS = ("auto", "hermes", "llama3_json", "none")
FORMATS = ("hermes", "llama3_json")
CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


# ---- the model's side: which format, and does its template take tools ----------------
@dataclass(frozen=True)
class ToolFormat:
    """How this model is shown tools and how its calls are read. ``native``: its chat
    template takes ``tools``; ``name``: the format read (None: none, so ``tool_choice``
    ``auto`` is refused); ``why``: how it was chosen, for the start-up log."""

    name: str | None
    native: bool
    why: str


def template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, else all of them
        template = template.get("default") or "\n".join(str(t) for t in template.values())
    return template or ""


def template_in(model_dir: Any) -> Any:
    """A stand-in tokenizer holding only the chat template of the model directory (its
    ``chat_template.jinja``, or ``tokenizer_config.json``'s), for checking flags at start
    without loading the tokenizer."""
    from pathlib import Path
    from types import SimpleNamespace

    folder = Path(model_dir)
    template: Any = None
    if (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    elif (folder / "tokenizer_config.json").exists():
        try:
            template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
        except (OSError, json.JSONDecodeError, AttributeError):
            template = None
        if isinstance(template, list):  # named templates
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    return SimpleNamespace(chat_template=template, all_special_tokens=())


def resolve_format(tokenizer: Any, parser: str = "auto") -> ToolFormat:
    """The tool format for ``parser`` (one of :data:`PARSERS`); ``auto`` reads the chat
    template: ``<tool_call>`` in it is hermes, ``ipython``/``<|python_tag|>`` llama3_json, a
    template that takes no tools gets pdserve's system message and hermes. Raises
    ``ValueError`` for a parser that cannot work with this model."""
    if parser not in PARSERS:
        raise ValueError(f"tool call parser {parser!r}: use one of {', '.join(PARSERS)}")
    text = template_text(tokenizer)
    native = bool(re.search(r"\btools\b", text))
    specials = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    if parser == "none":
        return ToolFormat(None, native, "--tool-call-parser none")
    if parser == "llama3_json" and not native:
        raise ValueError("--tool-call-parser llama3_json needs a chat template that takes tools; use hermes or auto")
    if parser in FORMATS:
        chosen, why = parser, f"--tool-call-parser {parser}"
    elif not native:
        chosen, why = "hermes", "the chat template takes no tools: pdserve's system message, hermes"
    elif OPEN in text:
        chosen, why = "hermes", "the chat template writes <tool_call>"
    elif "ipython" in text or "<|python_tag|>" in text:
        chosen, why = "llama3_json", "the chat template has an ipython role"
    else:
        return ToolFormat(None, native, "the chat template's tool format is not one pdserve reads")
    if chosen == "hermes" and (OPEN in specials or CLOSE in specials):
        return ToolFormat(None, native, "the tokenizer drops <tool_call> as a special token")
    return ToolFormat(chosen, native, why)


# ---- the request's side ----------------------------------------------------------------
@dataclass(frozen=True)
class ToolRequest:
    """A request's tools (as given, each ``{"type": "function", "function": {...}}``), its
    ``tool_choice`` (``none``, ``auto``, ``required`` or ``function``: the one ``name``
    forces) and ``parallel_tool_calls``."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    name: str | None = None
    parallel: bool = True
    format: str | None = None  # how auto's calls are read

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def shown(self) -> bool:
        """The model is told of the tools (not with ``tool_choice`` ``none``)."""
        return self.choice != "none"

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                params = t["function"].get("parameters")
                return params if params is not None else OBJECT_SCHEMA
        raise KeyError(name)

    def schema(self) -> str:
        """The JSON Schema a forced choice's output follows: the named function's
        parameters, or for ``required`` an array of ``{"name", "arguments"}`` calls."""
        if self.choice == "function":
            assert self.name is not None
            return json.dumps(self.parameters(self.name))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": self.parameters(n)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for n in sorted(self.names)
        ]
        array: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        }
        if not self.parallel:
            array["maxItems"] = 1
        return json.dumps(array)


def _function(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{where} must be an object with type 'function' and a 'function' object", "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'", "tools")
    if not isinstance(fn.get("description", ""), str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON Schema (an object)", "tools")
    if not isinstance(fn.get("strict", False), (bool, type(None))):
        raise bad_request(f"{where}.function.strict must be a boolean", "tools")
    return {"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters") if k in fn}}


def parse_tools(body: dict[str, Any], fmt: ToolFormat) -> ToolRequest | None:
    """The request's tools, checked (a 400 for anything malformed); None without tools."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad_request(f"'{legacy}' is deprecated and not served; use 'tools' and 'tool_choice'", legacy)
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("the tools' function names must differ", "tools")
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("'tool_choice' must be none, auto, required or {'type': 'function', ...}", "tool_choice")
        if fn["name"] not in names:
            raise bad_request(f"'tool_choice' names {fn['name']!r}, which is not among the tools", "tool_choice")
        choice, name = "function", fn["name"]
    elif choice not in CHOICES:
        raise bad_request("'tool_choice' must be none, auto, required or {'type': 'function', ...}", "tool_choice")
    if choice == "auto" and fmt.name is None:
        raise bad_request(
            f"this server reads no tool calls from this model's text ({fmt.why}): use tool_choice 'required' or "
            "name a function, or start it with --tool-call-parser",
            "tool_choice",
        )
    return ToolRequest(functions, choice, name, parallel, fmt.name)


# ---- messages: what the template is given ------------------------------------------------
def _arguments(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, str):
        raise bad_request(f"{where}.function.arguments must be a string of JSON", "messages")
    try:
        parsed = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError:
        raise bad_request(f"{where}.function.arguments is not valid JSON", "messages") from None
    if not isinstance(parsed, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object", "messages")
    return parsed


def message_tool_calls(m: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, as chat templates take them (``arguments`` a
    dict, where the API sends a JSON string)."""
    calls = m.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for k, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where} must be an object with a 'function' holding a 'name'", "messages")
        if call.get("type", "function") != "function" or not isinstance(call.get("id", ""), str):
            raise bad_request(f"{where}: 'type' must be 'function' and 'id' a string", "messages")
        args = _arguments(fn.get("arguments", "{}"), where)
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if "id" in call:
            entry["id"] = call["id"]
        out.append(entry)
    return out


def system_message(tools: tuple[dict[str, Any], ...]) -> str:
    """pdserve's words to a model whose template takes no tools (hermes format)."""
    lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You have functions you can call. Each is described by one JSON object inside <tools></tools>:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call a function, write a JSON object with its name and arguments between <tool_call> and "
        "</tool_call>, one call per pair:\n"
        '<tool_call>\n{"name": "the function\'s name", "arguments": {"argument": "value"}}\n</tool_call>'
    )


def plain_messages(messages: list[dict[str, Any]], request: ToolRequest | None) -> list[dict[str, Any]]:
    """The conversation for a template that takes no tools: the tools in a system message,
    earlier calls written out in the format the model is asked for, tool results as a user
    turn each run of them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            written = [
                OPEN
                + "\n"
                + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                + "\n"
                + CLOSE
                for c in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m["content"] else []) + written)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("tool_results", None)
    if request is not None and request.shown:
        intro = system_message(request.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + intro}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out


# ---- the model's text: calls read back ----------------------------------------------------
def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Call:
    name: str
    arguments: str  # JSON text, as the API sends it
    id: str = field(default_factory=call_id)

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any, names: frozenset[str], key: str = "arguments") -> Call | None:
    """A ``{"name", "arguments"}`` object (llama3's ``parameters``) naming a known tool."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


@dataclass
class Events:
    """What one piece of the model's text became: ``content`` to show, ``calls`` whole,
    ``arguments`` a fragment of the one forced call's arguments, ``failures`` text that
    started a call and did not parse."""

    content: str = ""
    calls: list[Call] = field(default_factory=list)
    arguments: str = ""
    failures: int = 0


class CallReader:
    """Reads one sample's text as it streams (``feed`` each piece, ``finish`` at the end);
    reading a whole text in one ``feed`` gives the same result as any split of it."""

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self.names = request.names
        self.pending = ""  # text held back: a call in progress, or what may begin one
        self.inside = False
        self.started = False  # content or a call has been given out (llama3_json: decided)
        self.calls = 0
        self.forced_call: Call | None = None
        if request.choice == "function":
            assert request.name is not None
            self.forced_call = Call(request.name, "")

    def feed(self, text: str) -> Events:
        ev = Events()
        if self.forced_call is not None:
            ev.arguments = text
            self.forced_call.arguments += text
            return ev
        self.pending += text
        if self.request.choice == "required":
            return ev
        if self.request.format == "llama3_json":
            return self._llama(ev)
        return self._hermes(ev)

    def finish(self) -> Events:
        ev = Events()
        if self.forced_call is not None:
            return ev
        text, self.pending = self.pending, ""
        if self.request.choice == "required":
            found = _loads(text)
            calls = [_call(c, self.names) for c in found] if isinstance(found, list) and found else [None]
            if all(c is not None for c in calls):
                ev.calls = [c for c in calls if c is not None]
            else:
                ev.content, ev.failures = text, 1
        elif self.request.format == "llama3_json":
            if self.started or not text.strip():
                ev.content = text
            else:
                self._llama_whole(text, ev)
        elif self.inside:
            ev.content, ev.failures = OPEN + text, 1
        else:
            ev.content = self._shown(text)
        self.calls += len(ev.calls)
        return ev

    # hermes: <tool_call>{...}</tool_call>, any number, content before them
    def _hermes(self, ev: Events) -> Events:
        while True:
            if not self.inside:
                at = self.pending.find(OPEN)
                if at < 0:
                    keep = partial_suffix(self.pending, OPEN)
                    ev.content += self._shown(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    return ev
                ev.content += self._shown(self.pending[:at])
                self.pending = self.pending[at + len(OPEN) :]
                self.inside = True
            at = self.pending.find(CLOSE)
            if at < 0:
                return ev
            body, self.pending = self.pending[:at], self.pending[at + len(CLOSE) :]
            self.inside = False
            found = _loads(body.strip())  # one call, or a list of them (SmolLM2's training format)
            calls = [_call(c, self.names) for c in (found if isinstance(found, list) and found else [found])]
            if any(c is None for c in calls):
                ev.content += OPEN + body + CLOSE
                ev.failures += 1
            else:
                ev.calls.extend(c for c in calls if c is not None)
                self.calls += len(calls)

    def _shown(self, text: str) -> str:
        """Content between or after calls is dropped when it is only whitespace."""
        if self.calls and not text.strip():
            return ""
        return text

    # llama3_json: the whole reply is a call when it begins with '{'
    def _llama(self, ev: Events) -> Events:
        if self.started:
            ev.content, self.pending = self.pending, ""
            return ev
        head = self.pending.lstrip()
        if head.startswith("<|python_tag|>"):
            head = head[len("<|python_tag|>") :].lstrip()
        if not head or head.startswith("{") or "<|python_tag|>".startswith(head):
            return ev  # a call, or not yet known: held until the end
        self.started = True
        ev.content, self.pending = self.pending, ""
        return ev

    def _llama_whole(self, text: str, ev: Events) -> None:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        parts = [p for p in body.split(";") if p.strip()] if not _loads(body) else [body]
        calls = [_call(_loads(p.strip()), self.names, "parameters") for p in parts]
        if calls and all(c is not None for c in calls):
            ev.calls = [c for c in calls if c is not None]
        else:
            ev.content, ev.failures = text, 1


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class Reply:
    """A whole sample's message: content (None when only calls), calls, failures."""

    content: str | None
    calls: list[Call]
    failures: int


def read_whole(request: ToolRequest, text: str) -> Reply:
    reader = CallReader(request)
    parts = [reader.feed(text), reader.finish()]
    calls = [c for ev in parts for c in ev.calls]
    if reader.forced_call is not None:
        calls = [reader.forced_call]
    content = "".join(ev.content for ev in parts)
    return Reply(content if content.strip() or not calls else None, calls, sum(ev.failures for ev in parts))


def finish_reason(reason: str | None, calls: int) -> str | None:
    """``tool_calls`` where the model ended by itself after calling."""
    return "tool_calls" if calls and reason == "stop" else reason
