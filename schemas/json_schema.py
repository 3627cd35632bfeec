"""JSON Schema (draft 2020-12) of every wire message, made from the dataclasses themselves.

The types come from the fields' annotations, required fields are those without a default
(plus ``v``, which the decoder demands), and the value rules the classes check in
``__post_init__`` are written here once, in :data:`RULES`; ``tests/schemas`` proves each
rule refuses and accepts what the class does. Every object allows extra properties: a
receiver ignores unknown fields, which is how a minor version adds one.

``pdserve schemas export`` writes one file per message under ``schemas/json/``; a test
regenerates them and compares, so the checked-in files cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union, get_args, get_origin

import orjson

from pdserve.schemas.codec import Message
from pdserve.schemas.control import Cancel, FlushCache, FlushCacheReply
from pdserve.schemas.kv import KVLease, KVLeaseReply, KVReady, KVRelease
from pdserve.schemas.kv_events import KVEvents, PlacementClaim
from pdserve.schemas.link import KVLink, KVLinkReply, KVPush, KVPushReply
from pdserve.schemas.request import GenerateRequest
from pdserve.schemas.sampling import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT,
    MAX_LOGIT_BIAS,
    MAX_PRIORITY,
    MAX_SAMPLES,
    MAX_STOP_REGEX,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from pdserve.schemas.tokens import STATES, TokenBatch, TokenChunk
from pdserve.schemas.worker import WorkerInfo

DRAFT = "https://json-schema.org/draft/2020-12/schema"
ID_BASE = "https://pdserve.dev/schemas/v1/"

# Every message type that travels on its own, in the order docs/protocol.md lists them.
MESSAGES: tuple[type[Message], ...] = (
    GenerateRequest,
    TokenChunk,
    TokenBatch,
    Cancel,
    KVReady,
    KVRelease,
    KVLease,
    KVLeaseReply,
    KVLink,
    KVLinkReply,
    KVPush,
    KVPushReply,
    WorkerInfo,
    FlushCache,
    FlushCacheReply,
    KVEvents,
    PlacementClaim,
)

_NON_NEGATIVE_INT = {"type": "integer", "minimum": 0}

# The value rules of ``__post_init__``, as JSON Schema keywords per (class, field).
RULES: dict[type, dict[str, dict[str, Any]]] = {
    SamplingParams: {
        "max_new_tokens": {"minimum": 1},
        "min_new_tokens": {"minimum": 0},
        "temperature": {"minimum": 0, "maximum": 100},
        "top_p": {"exclusiveMinimum": 0, "maximum": 1},
        "min_p": {"minimum": 0, "maximum": 1},
        "seed": {"minimum": 0, "maximum": 2**63 - 1},
        "frequency_penalty": {"minimum": -2, "maximum": 2},
        "presence_penalty": {"minimum": -2, "maximum": 2},
        "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 10},
        "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
        "prompt_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
        "stop": {"maxItems": MAX_STOP_STRINGS, "items": {"type": "string", "minLength": 1}},
        "stop_token_ids": {"items": _NON_NEGATIVE_INT},
        "stop_regex": {
            "maxItems": MAX_STOP_STRINGS,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_REGEX},
        },
        "allowed_token_ids": {"items": _NON_NEGATIVE_INT},
        "bad_words": {
            "maxItems": MAX_BAD_WORDS,
            "items": {"minItems": 1, "maxItems": MAX_BAD_WORD_TOKENS, "items": _NON_NEGATIVE_INT},
        },
        "cache_salt": {"minLength": 1, "maxLength": MAX_CACHE_SALT},
        "priority": {"minimum": -MAX_PRIORITY, "maximum": MAX_PRIORITY},
        "n": {"minimum": 1, "maximum": MAX_SAMPLES},
        "logit_bias": {
            "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        "json_schema": {"minLength": 1},
        "regex": {"minLength": 1},
        "ebnf": {"minLength": 1},
        "structural_tag": {"minLength": 2},
    },
    GenerateRequest: {
        "rid": {"minLength": 1},
        "prompt_ids": {"minItems": 1, "items": _NON_NEGATIVE_INT},
        "reply_to": {"minLength": 1},
        "attempt": {"minimum": 0},
    },
    TokenChunk: {"state": {"enum": list(STATES)}},
}

# What a field means, for the fields a direct publisher sends or reads. docs/protocol.md
# says the same at more length; a test checks that every field of these classes has one.
DESCRIPTIONS: dict[type, dict[str, str]] = {
    GenerateRequest: {
        "rid": "Request id, unique per request; also the Nats-Msg-Id header (the stream drops a repeat within its dedup window).",
        "model": "The served model's name (pd.req.<model> must match it).",
        "prompt_ids": "Prompt token ids of the model's tokenizer.",
        "reply_to": "Core NATS subject that receives this request's TokenChunks; with users on, pd.tokens.<your-id>.<rid>.",
        "sampling": "How to pick tokens and when to stop.",
        "output_ids": "Tokens already generated (a resumed request); the worker continues after them and numbers chunks from len(output_ids).",
        "deadline": "Unix time after which workers drop the request and answer a timeout error (0: none).",
        "published_at": "Publisher's Unix time (queueing figures; tells this request from an earlier cancelled one of the same rid).",
        "attempt": "Migrations so far; 0 for a first submission. Chunks carry it back.",
        "batch_to": "Optional subject of the same receiver that takes TokenBatches; empty: every chunk goes to reply_to alone.",
        "v": "Major version of the message.",
    },
    SamplingParams: {
        "max_new_tokens": "Most tokens to generate.",
        "min_new_tokens": "No end-of-sequence, stop token or stop string before this many tokens (their logits masked until then); at most max_new_tokens; not with structured output.",
        "temperature": "0: greedy.",
        "top_p": "Nucleus sampling; 1 disables it.",
        "top_k": "Keep the k most likely tokens; 0 or less disables it.",
        "min_p": "Drop tokens below min_p times the top probability; 0 disables it.",
        "seed": "Per-request seed: the same seed gives the same tokens whatever else runs (null: unseeded).",
        "stop": "Stop strings: generation stops once the text contains one (the receiver cuts the text before it).",
        "stop_token_ids": "Token ids that end generation (the token is part of the output).",
        "stop_regex": "Regular expressions (SGLang's stop_regex; Python's syntax, as the regex package reads it): generation stops once the text matches one with a match that is not empty (the receiver cuts the text before the match; a worker looks in its last 64 tokens).",
        "ignore_eos": "Go on past the model's end-of-sequence tokens.",
        "frequency_penalty": "OpenAI-style frequency penalty.",
        "presence_penalty": "OpenAI-style presence penalty.",
        "repetition_penalty": "Multiplicative repetition penalty; 1 disables it.",
        "logprobs": "Send each token's log probability.",
        "top_logprobs": "Also send the n most likely alternatives per token.",
        "prompt_logprobs": "Send the prompt's tokens' log probabilities (from the second token on) with this many alternatives each, on the first chunk (null: none; with n > 1 on each sample's first chunk). The prompt is computed in full (no prefix cache).",
        "n": "Parallel samples of the prompt (one prefill, its KV shared): sample i streams as rid#i, with seed + i when seeded.",
        "logit_bias": "Token id (a decimal string) -> bias in [-100, 100] added to its logit before sampling (OpenAI's logit_bias).",
        "allowed_token_ids": "Non-empty: only these tokens may be drawn (every other token's logit masked; vLLM's allowed_token_ids).",
        "cache_salt": "The prompt's page hashes start from this salt: its prefix is found in the caches (the workers' prefix caches, the KV tiers, placement) only by requests with the same salt (vLLM's cache_salt; null: none).",
        "priority": "Scheduling order, lower first (vLLM's priority; 0 the default, ties by arrival). Below 0 the request goes to its model's urgent queues (pd.urgent.<model>, then pd.kvurgent.<model> in PD mode), which workers take from even when full, giving it the seat of a running request of a lower priority.",
        "bad_words": "Token sequences the output may not complete: a sequence's last token is masked where the output's last tokens are the rest of it (a one-token sequence: everywhere). vLLM's bad_words, tokenized.",
        "json_schema": "Structured output: the output is JSON valid against this JSON Schema (a JSON text). At most one of json_schema, regex, ebnf, structural_tag.",
        "regex": "Structured output: the output matches this regular expression.",
        "ebnf": "Structured output: the output is a sentence of this EBNF grammar (GBNF dialect, start rule root).",
        "structural_tag": 'Structured output: xgrammar\'s structural tag as JSON text ({"type": "structural_tag", "format": ...}), e.g. free text whose parts after a trigger are tags with JSON valid against a schema (tool calls). At most one of json_schema, regex, ebnf, structural_tag.',
    },
    TokenChunk: {
        "rid": "The request's id.",
        "seq": "Output index of token_ids[0] (for a chunk without tokens, of the next token): shows duplicates and gaps.",
        "token_ids": "Consecutive output tokens.",
        "finish_reason": "Set on the last chunk only: stop, length, abort or error.",
        "stop_reason": "What stopped it: the stop token id or stop string (null: end of sequence or none).",
        "usage": "Token counts, on the last chunk.",
        "error": "Why the request failed (finish_reason error).",
        "logprobs": "One entry per token of token_ids, when asked for.",
        "prompt_logprobs": "On the first chunk of a request whose sampling asks for prompt_logprobs: the prompt's tokens' log probabilities.",
        "worker_id": "The worker that sent the chunk.",
        "timings": "Named durations in seconds (queueing, transfer), for benchmarks.",
        "attempt": "The request's attempt this chunk belongs to: ignore chunks of other attempts.",
        "state": "'' (tokens), alive (a keep-alive: a worker holds the request), queued (after this chunk the request waits for a decode worker), handed_back (the worker gave it back unfinished).",
        "v": "Major version of the message.",
    },
    TokenBatch: {
        "chunks": "TokenChunks of several requests from one engine step; each means what it would mean alone.",
        "v": "Major version of the message.",
    },
    Cancel: {
        "rid": "The request to stop.",
        "reason": "Why, for the workers' logs.",
        "attempt": "0: the whole request; n > 0: only attempts before n (superseded by a migration).",
        "issued_at": "Unix time: the cancel covers submissions of rid published up to then (0: any).",
        "v": "Major version of the message.",
    },
}


def schema_of(message: type[Message]) -> dict[str, Any]:
    """The JSON Schema of ``message``: its nested dataclasses under ``$defs``."""
    defs: dict[str, Any] = {}
    top = _object(message, defs)
    top["properties"]["v"] = {"const": message.VERSION, "description": "Major version of the message."}
    top["required"] = sorted({*top["required"], "v"}, key=[f.name for f in dataclasses.fields(message)].index)
    schema: dict[str, Any] = {"$schema": DRAFT, "$id": f"{ID_BASE}{message.__name__}.json", **top}
    if defs:
        schema["$defs"] = dict(sorted(defs.items()))
    return schema


def export() -> dict[str, bytes]:
    """Every message's schema as file name -> bytes (sorted keys, two-space indent)."""
    return {f"{m.__name__}.json": render(schema_of(m)) for m in MESSAGES}


def render(schema: dict[str, Any]) -> bytes:
    return orjson.dumps(schema, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def _object(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    rules = RULES.get(cls, {})
    docs = DESCRIPTIONS.get(cls, {})
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        prop = _merge(_type(hints[f.name], defs), rules.get(f.name, {}))
        if f.default is not dataclasses.MISSING and _is_json(f.default):
            prop["default"] = _jsonable(f.default)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
        if f.name in docs:
            prop["description"] = docs[f.name]
        properties[f.name] = prop
    out: dict[str, Any] = {"title": cls.__name__, "type": "object"}
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
        out["description"] = " ".join(cls.__doc__.split())
    out.update(properties=properties, required=required, additionalProperties=True)
    return out


def _type(hint: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        variants = [_type(arg, defs) for arg in get_args(hint)]
        return {"anyOf": variants}
    if origin is list or origin is tuple:
        return {"type": "array", "items": _type(get_args(hint)[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type(get_args(hint)[1], defs)}
    if origin is typing.Literal:
        return {"enum": list(get_args(hint))}
    if hint is type(None):
        return {"type": "null"}
    scalar = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(hint)
    if scalar is not None:
        return {"type": scalar}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if hint.__name__ not in defs:
            defs[hint.__name__] = {}  # placeholder against recursion
            defs[hint.__name__] = _object(hint, defs)
        return {"$ref": f"#/$defs/{hint.__name__}"}
    raise TypeError(f"no JSON Schema for {hint!r}")


def _merge(base: dict[str, Any], rule: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``rule`` added; a nullable type gets the rule on its non-null variant."""
    if not rule:
        return base
    if "anyOf" in base:
        return {"anyOf": [v if v.get("type") == "null" else {**v, **rule} for v in base["anyOf"]]}
    return {**base, **rule}


def _is_json(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, tuple)) or dataclasses.is_dataclass(value)


def _jsonable(value: Any) -> Any:
    return orjson.loads(orjson.dumps(value))


__all__ = ["DESCRIPTIONS", "MESSAGES", "RULES", "export", "render", "schema_of"]
