"""The OpenAPI 3.1 description of the HTTP API, served at ``/openapi.json``.

Built for the running server: its model name, vocabulary, limits and whether it needs an
API key. Every constraint written here is one :mod:`pdserve.api.protocol` enforces (a
body that breaks one gets a 4xx), so a schema-driven fuzzer may hold the server to it.
The server checks some things a schema cannot say (a prompt's length in tokens, a chat
turn's content by role, streaming with a batch) and refuses those with 400 as well.
"""

from __future__ import annotations

from typing import Any

from pdserve.api.access import LIMITED_PATHS, OPEN_PATHS
from pdserve.api.config import ApiConfig
from pdserve.api.model_info import ModelInfo
from pdserve.api.protocol import INT64, MAX_COMPLETION_LOGPROBS, MAX_DOCUMENTS, REASONING_EFFORTS
from pdserve.schemas.sampling import (
    MAX_BAD_WORDS,
    MAX_CACHE_SALT,
    MAX_LOGIT_BIAS,
    MAX_PRIORITY,
    MAX_SAMPLES,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
)

Schema = dict[str, Any]


def _maybe(schema: Schema) -> Schema:
    """``schema`` or null (an optional field given as null takes its default)."""
    kind = schema["type"]
    return {**schema, "type": [*kind, "null"] if isinstance(kind, list) else [kind, "null"]}


def _number(low: float, high: float, exclusive_low: bool = False) -> Schema:
    bound = {"exclusiveMinimum": low} if exclusive_low else {"minimum": low}
    return _maybe({"type": "number", **bound, "maximum": high})


def _integer(low: int, high: int = INT64 - 1) -> Schema:
    return _maybe({"type": "integer", "minimum": low, "maximum": high})


BOOL = _maybe({"type": "boolean"})


def _sampling(temperature_max: float, max_tokens: Schema) -> dict[str, Schema]:
    stop_string = {"type": "string", "minLength": 1}
    return {
        "temperature": _number(0.0, temperature_max),
        "top_p": _number(0.0, 1.0, exclusive_low=True),
        "top_k": _integer(-1),
        "min_p": _number(0.0, 1.0),
        "seed": _integer(0),
        "stop": {
            "anyOf": [
                stop_string,
                {"type": "array", "items": stop_string, "maxItems": MAX_STOP_STRINGS},
                {"type": "null"},
            ]
        },
        "stop_token_ids": _maybe({"type": "array", "items": {"type": "integer", "minimum": 0}}),
        "ignore_eos": BOOL,
        "frequency_penalty": _number(-2.0, 2.0),
        "presence_penalty": _number(-2.0, 2.0),
        "repetition_penalty": _number(0.0, 10.0, exclusive_low=True),
        "n": _integer(1, MAX_SAMPLES),
        "logit_bias": _maybe(
            {"type": "object", "additionalProperties": _number(-100.0, 100.0), "maxProperties": MAX_LOGIT_BIAS}
        ),
        "max_tokens": max_tokens,
        "min_tokens": _integer(0),  # vLLM's; at most max_tokens
    }


def _prompt(info: ModelInfo, config: ApiConfig, text: bool = True, ids: bool = True) -> Schema:
    """A string, token ids, or a batch of either (at most ``max_batch_prompts``)."""
    token = {"type": "integer", "minimum": 0, "maximum": len(info.tokenizer) - 1}
    id_list = {"type": "array", "items": token, "minItems": 1}
    string = {"type": "string", "minLength": 1}
    batch = {"minItems": 1, "maxItems": config.max_batch_prompts}
    options: list[Schema] = []
    if text:
        options += [string, {"type": "array", "items": string, **batch}]
    if ids:
        options += [id_list, {"type": "array", "items": id_list, **batch}]
    return {"oneOf": options}


def _max_tokens(info: ModelInfo, config: ApiConfig, low: int = 1) -> Schema:
    """``low`` 0: where the prompt alone may be asked for (echoed or scored)."""
    return _integer(low, config.max_output_tokens or max(info.context_length - 1, 1))


RESPONSE_FORMAT: Schema = _maybe(
    {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema", "structural_tag"]},
            "json_schema": {
                "type": "object",
                "required": ["schema"],
                "properties": {"name": {"type": "string"}, "schema": {"type": "object"}},
            },
        },
    }
)


def _vllm_extras(info: ModelInfo) -> dict[str, Schema]:
    """vLLM's request extensions pdserve serves on completions and chat."""
    token = {"type": "integer", "minimum": 0, "maximum": len(info.tokenizer) - 1}
    return {
        "add_special_tokens": BOOL,
        "skip_special_tokens": BOOL,
        "include_stop_str_in_output": BOOL,
        "truncate_prompt_tokens": _integer(-1),
        "allowed_token_ids": _maybe({"type": "array", "items": token, "minItems": 1}),
        "bad_words": _maybe(
            {"type": "array", "items": {"type": "string", "pattern": r"\S"}, "maxItems": MAX_BAD_WORDS // 2}
        ),
        "return_tokens_as_token_ids": BOOL,
        "return_token_ids": BOOL,
        "cache_salt": _maybe({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT}),
        "priority": _integer(-MAX_PRIORITY, MAX_PRIORITY),
        "guided_choice": _maybe({"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}),
        "structural_tag": _maybe({"type": "string", "minLength": 2}),
    }


def completion_body(info: ModelInfo, config: ApiConfig) -> Schema:
    return {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "model": {"anyOf": [{"type": "string", "enum": list(info.names)}, {"type": "null"}]},
            "prompt": _prompt(info, config),
            **_sampling(100.0, _max_tokens(info, config, 0)),
            "logprobs": _integer(0, MAX_COMPLETION_LOGPROBS),
            "echo": BOOL,
            "prompt_logprobs": _integer(0, MAX_TOP_LOGPROBS),
            **_vllm_extras(info),
            "user": _maybe({"type": "string"}),
            "response_format": RESPONSE_FORMAT,
            "stream": BOOL,
            "stream_options": _maybe(
                {"type": "object", "properties": {"include_usage": BOOL, "continuous_usage_stats": BOOL}}
            ),
        },
    }


def chat_body(info: ModelInfo, config: ApiConfig) -> Schema:
    part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
    }
    roles = ["system", "user", "assistant", "tool", "developer"]
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    call = {
        "type": "object",
        "required": ["function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
    }
    calls = {"type": "array", "items": call}
    message = {
        "anyOf": [
            {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": roles},
                    "content": content,
                    "tool_calls": calls,
                    "tool_call_id": {"type": "string"},
                },
            },
            {  # an assistant turn may have no content (its tool calls instead)
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"type": "string", "enum": ["assistant"]},
                    "content": {"type": "null"},
                    "tool_calls": calls,
                },
            },
        ]
    }
    tool = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                    "description": {"type": "string"},
                    "parameters": {"type": "object"},
                },
            },
        },
    }
    named = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
        },
    }
    max_tokens = _max_tokens(info, config)
    return {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "model": {"anyOf": [{"type": "string", "enum": list(info.names)}, {"type": "null"}]},
            "messages": {"type": "array", "items": message, "minItems": 1},
            **_sampling(2.0, max_tokens),
            "max_completion_tokens": max_tokens,
            "logprobs": BOOL,
            "top_logprobs": _integer(0, MAX_TOP_LOGPROBS),
            "prompt_logprobs": _integer(0, MAX_TOP_LOGPROBS),
            **_vllm_extras(info),
            "user": _maybe({"type": "string"}),
            "response_format": RESPONSE_FORMAT,
            "tools": _maybe({"type": "array", "items": tool}),
            "tool_choice": {
                "anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, named, {"type": "null"}]
            },
            "parallel_tool_calls": BOOL,
            "chat_template_kwargs": _maybe({"type": "object"}),
            "documents": _maybe(
                {
                    "type": "array",
                    "items": {"type": "object", "minProperties": 1, "additionalProperties": {"type": "string"}},
                    "maxItems": MAX_DOCUMENTS,
                }
            ),
            "reasoning_effort": _maybe({"type": "string", "enum": list(REASONING_EFFORTS)}),
            "add_generation_prompt": BOOL,
            "continue_final_message": BOOL,
            "stream": BOOL,
            "stream_options": _maybe(
                {"type": "object", "properties": {"include_usage": BOOL, "continuous_usage_stats": BOOL}}
            ),
        },
    }


def generate_body(info: ModelInfo, config: ApiConfig) -> Schema:
    sampling = _sampling(100.0, _max_tokens(info, config, 0))
    sampling["max_new_tokens"] = sampling.pop("max_tokens")
    sampling["min_new_tokens"] = sampling.pop("min_tokens")  # SGLang's name
    sampling["skip_special_tokens"] = BOOL
    sampling["no_stop_trim"] = BOOL
    sampling["json_schema"] = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "object"}, {"type": "null"}]}
    for key in ("regex", "ebnf"):
        sampling[key] = _maybe({"type": "string", "minLength": 1})
    rid = {"type": "string", "minLength": 1}
    return {
        "type": "object",
        "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}],
        "properties": {
            "model": {"anyOf": [{"type": "string", "enum": list(info.names)}, {"type": "null"}]},
            "text": _prompt(info, config, ids=False),
            "input_ids": _prompt(info, config, text=False),
            "sampling_params": _maybe({"type": "object", "properties": sampling}),
            **sampling,
            "return_logprob": BOOL,
            "top_logprobs_num": _integer(0, MAX_TOP_LOGPROBS),
            "logprob_start_len": _integer(-1, max(info.context_length - 1, 1)),
            "return_text_in_logprobs": BOOL,
            "priority": _integer(-MAX_PRIORITY, MAX_PRIORITY),
            "stream": BOOL,
            "rid": {"anyOf": [rid, {"type": "array", "items": rid}, {"type": "null"}]},
        },
    }


def responses_body(info: ModelInfo) -> Schema:
    """OpenAI's Responses request, as far as its shape goes (``/v1/responses`` checks the rest:
    the items, the tools, what it does not serve)."""
    item = {"type": "object", "properties": {"type": {"type": "string"}, "role": {"type": "string"}}}
    return {
        "type": "object",
        "required": ["input"],
        "properties": {
            "model": {"anyOf": [{"type": "string", "enum": list(info.names)}, {"type": "null"}]},
            "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": item, "minItems": 1}]},
            "instructions": _maybe({"type": "string"}),
            "stream": BOOL,
        },
    }


def messages_body(info: ModelInfo) -> Schema:
    """Anthropic's Messages request, as far as its shape goes (``/v1/messages`` checks the rest)."""
    message = {"type": "object", "required": ["role"], "properties": {"role": {"enum": ["user", "assistant"]}}}
    return {
        "type": "object",
        "required": ["max_tokens", "messages"],
        "properties": {
            "model": {"anyOf": [{"type": "string", "enum": list(info.names)}, {"type": "null"}]},
            "max_tokens": {"type": "integer", "minimum": 1},
            "messages": {"type": "array", "items": message, "minItems": 1},
            "stream": BOOL,
        },
    }


ABORT: Schema = {
    "type": "object",
    "oneOf": [{"required": ["rid"]}, {"required": ["abort_all"]}],
    "properties": {"rid": {"type": "string", "minLength": 1}, "abort_all": {"type": "boolean", "enum": [True]}},
}

TOKENIZE: Schema = {
    "type": "object",
    "properties": {
        "model": _maybe({"type": "string"}),
        "prompt": {"type": "string"},
        "messages": {"type": "array", "items": {"type": "object"}},
        "add_special_tokens": BOOL,
        "add_generation_prompt": BOOL,
        "return_token_strs": BOOL,
    },
}


def detokenize_body(info: ModelInfo) -> Schema:
    token = {"type": "integer", "minimum": 0, "maximum": len(info.tokenizer) - 1}
    return {
        "type": "object",
        "required": ["tokens"],
        "properties": {
            "model": _maybe({"type": "string"}),
            "tokens": {"type": "array", "items": token},
            "skip_special_tokens": BOOL,
        },
    }


ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(path: str, config: ApiConfig) -> dict[str, Schema]:
    """The error answers of ``path``; ``default`` covers the rest (503 queue full, 504 ...)."""
    out = {"default": _json({"$ref": "#/components/schemas/Error"}, "an error, OpenAI-style")}
    if config.api_keys and path not in OPEN_PATHS:
        out["401"] = _json({"$ref": "#/components/schemas/Error"}, "no API key, or a wrong one")
    if config.max_concurrent_requests and path in LIMITED_PATHS:
        out["429"] = _json({"$ref": "#/components/schemas/Error"}, "too many requests of this key in flight")
    return out


def _generation(path: str, summary: str, body: Schema, config: ApiConfig) -> Schema:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {
                    "description": "the result, or with stream=true server-sent events ending in 'data: [DONE]'",
                    "content": {
                        "application/json": {"schema": {"type": ["object", "array"]}},
                        "text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}},
                    },
                },
                "400": _json({"$ref": "#/components/schemas/Error"}, "the body is not valid"),
                "413": _json({"$ref": "#/components/schemas/Error"}, f"the body exceeds {config.max_body_bytes} bytes"),
                **_errors(path, config),
            },
        }
    }


def _get(path: str, summary: str, media: str, schema: Schema, config: ApiConfig) -> Schema:
    ok = {"description": summary, "content": {media: {"schema": schema}}}
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(path, config)}}}


def _model_by_id(config: ApiConfig) -> Schema:
    """OpenAI's model retrieval: the card of the served model or of an alias, 404 for any other id."""
    path = "/v1/models/{model}"
    item = _get(
        path,
        "the served model by its name or an alias (404 model_not_found for another)",
        "application/json",
        {"type": "object"},
        config,
    )
    item["get"]["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    item["get"]["responses"]["404"] = _json({"$ref": "#/components/schemas/Error"}, "no model of that id here")
    return item


def describe(config: ApiConfig, info: ModelInfo) -> Schema:
    """The OpenAPI document of this server."""
    obj, text = {"type": "object"}, {"type": "string"}
    paths: dict[str, Schema] = {
        "/v1/completions": _generation("/v1/completions", "OpenAI completions", completion_body(info, config), config),
        "/v1/chat/completions": _generation(
            "/v1/chat/completions", "OpenAI chat completions", chat_body(info, config), config
        ),
        "/generate": _generation("/generate", "SGLang generate", generate_body(info, config), config),
        "/v1/messages": _generation(
            "/v1/messages", "Anthropic messages: text and custom tools", messages_body(info), config
        ),
        "/v1/responses": _generation(
            "/v1/responses", "OpenAI responses: text and function tools, nothing stored", responses_body(info), config
        ),
        "/health": _get(
            "/health", "whether the API can serve (503 if not), and its totals", "application/json", obj, config
        ),
        "/v1/models": _get("/v1/models", "the served model, then its aliases", "application/json", obj, config),
        "/v1/models/{model}": _model_by_id(config),
        "/get_model_info": _get("/get_model_info", "the served model (SGLang)", "application/json", obj, config),
        "/workers": _get("/workers", "the worker registry", "application/json", {"type": "array"}, config),
        "/metrics": _get("/metrics", "Prometheus metrics", "text/plain", text, config),
        "/dashboard": _get("/dashboard", "the live page", "text/html", text, config),
        "/dashboard/data": _get("/dashboard/data", "what the live page draws", "application/json", obj, config),
        "/openapi.json": _get("/openapi.json", "this description", "application/json", obj, config),
        "/tokenize": _generation("/tokenize", "text or chat messages to token ids (vLLM)", TOKENIZE, config),
        "/detokenize": _generation("/detokenize", "token ids to text (vLLM)", detokenize_body(info), config),
        "/version": _get("/version", "pdserve's version", "application/json", obj, config),
        "/get_server_info": _get(
            "/get_server_info", "the server and its limits (SGLang)", "application/json", obj, config
        ),
    }
    paths["/health_generate"] = _get(
        "/health_generate",
        "one token generated through the whole pipeline (SGLang): 200 with its seconds, 503 if not within 20 s",
        "application/json",
        obj,
        config,
    )
    paths["/health_generate"]["get"]["responses"]["503"] = _json(obj, "no token in time, or a worker failed it")
    paths["/abort_request"] = _generation(
        "/abort_request", "end a request of the caller's, or all of them (SGLang): the ids ended", ABORT, config
    )
    if config.enable_flush_cache:
        paths["/flush_cache"] = _generation("/flush_cache", "every worker forgets its cached prefixes", obj, config)
    paths["/health"]["get"]["responses"]["503"] = _json(obj, "no worker pool can serve yet")
    document: Schema = {
        "openapi": "3.1.0",
        "info": {"title": "pdserve", "version": "1", "description": f"serving {info.name}"},
        "paths": paths,
        "components": {"schemas": {"Error": ERROR}},
    }
    if config.api_keys:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
        for path in OPEN_PATHS:
            paths[path]["get"]["security"] = []
    return document
