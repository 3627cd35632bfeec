"""What a request body may ask of the output's shape and the token choice: OpenAI's
``response_format`` and ``logit_bias``, SGLang's ``json_schema``/``regex``/``ebnf``, vLLM's
``guided_*``; each checked here (a 400 before anything is published) and carried to the
workers in ``SamplingParams``."""

from __future__ import annotations

from typing import Any

import orjson

from pdserve.api.errors import bad_request
from pdserve.schemas.sampling import MAX_LOGIT_BIAS

JSON_OBJECT_SCHEMA = '{"type": "object"}'


def logit_bias(body: dict[str, Any], vocab: int) -> dict[str, float] | None:
    """OpenAI's ``logit_bias``: token id (a string or an integer) -> bias in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out: dict[str, float] = {}
    for key, bias in value.items():
        if not str(key).isdigit() or int(key) >= vocab:
            raise bad_request(f"'logit_bias' key {key!r} is not a token id of the vocabulary", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(f"'logit_bias' values must be numbers between -100 and 100; got {bias!r}", "logit_bias")
        out[str(int(key))] = float(bias)
    return out or None


def _object(value: Any, param: str, what: str) -> dict[str, Any]:
    """``value``, an object or its JSON text, as an object; a 400 naming ``what`` it must be."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise bad_request(f"'{param}' is not valid JSON", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be {what} (an object)", param)
    return value


def _schema_text(value: Any, param: str) -> str:
    return orjson.dumps(_object(value, param, "a JSON Schema")).decode()


def response_format(body: dict[str, Any]) -> dict[str, str]:
    """``response_format`` as constraint fields: ``text`` none, ``json_object`` any JSON
    object, ``json_schema`` its ``json_schema.schema``."""
    value = body.get("response_format")
    if value is None:
        return {}
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", "response_format")
    kind = value["type"]
    spec = value.get("json_schema")
    if "json_schema" in value or kind == "json_schema":  # checked whatever the type, as the API describes it
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request(
                "'response_format.json_schema' must be an object with a 'schema' object", "response_format"
            )
        if not isinstance(spec.get("name", ""), str):
            raise bad_request("'response_format.json_schema.name' must be a string", "response_format")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        assert isinstance(spec, dict)
        return {"json_schema": _schema_text(spec["schema"], "response_format")}
    if kind == "structural_tag":  # vLLM's: the response format is the tag itself
        return {"structural_tag": structural_tag(value, "response_format")}
    raise bad_request(
        f"'response_format.type' must be text, json_object, json_schema or structural_tag; got {kind!r}",
        "response_format",
    )


def structural_tag(value: Any, param: str) -> str:
    """A structural tag (an object, or its JSON text) as xgrammar's JSON: ``{"type":
    "structural_tag", "format": ...}`` as it stands; the earlier form vLLM and SGLang take,
    ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`` (free text, each
    part that starts with a trigger one of the structures: its begin, JSON valid against its
    schema, its end), as the same format's ``triggered_tags``."""
    value = _object(value, param, "a structural tag")
    if "format" in value:
        return orjson.dumps({"type": "structural_tag", "format": value["format"]}).decode()
    structures, triggers = value.get("structures"), value.get("triggers")
    if (
        not isinstance(structures, list)
        or not structures
        or not all(
            isinstance(t, dict)
            and isinstance(t.get("begin"), str)
            and isinstance(t.get("end"), str)
            and isinstance(t.get("schema"), dict)
            for t in structures
        )
        or not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise bad_request(
            f"'{param}' must hold a 'format', or 'structures' (objects with 'begin', 'schema' and 'end') "
            "and 'triggers' (non-empty strings)",
            param,
        )
    tags = [
        {
            "type": "tag",
            "begin": t["begin"],
            "content": {"type": "json_schema", "json_schema": t["schema"]},
            "end": t["end"],
        }
        for t in structures
    ]
    return orjson.dumps(
        {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    ).decode()


def guided(src: dict[str, Any]) -> dict[str, str]:
    """SGLang's ``json_schema``/``regex``/``ebnf`` and vLLM's ``guided_json``/``guided_regex``/
    ``guided_grammar`` (the same three, other names)."""
    out: dict[str, str] = {}
    for key, field in (("json_schema", "json_schema"), ("guided_json", "json_schema")):
        if src.get(key) is not None:
            out[field] = _schema_text(src[key], key)
    choices = src.get("guided_choice")  # vLLM's: the output is one of these strings
    if choices is not None:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise bad_request("'guided_choice' must be a non-empty list of non-empty strings", "guided_choice")
        if src.get("regex") is not None or src.get("guided_regex") is not None:
            raise bad_request("give at most one of guided_choice and a regex", "guided_choice")
        out["regex"] = "(" + "|".join(_literal(c) for c in choices) + ")"
    if src.get("structural_tag") is not None:  # vLLM's and SGLang's (a JSON text)
        out["structural_tag"] = structural_tag(src["structural_tag"], "structural_tag")
    for key, field in (("regex", "regex"), ("guided_regex", "regex"), ("ebnf", "ebnf"), ("guided_grammar", "ebnf")):
        value = src.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise bad_request(f"'{key}' must be a non-empty string", key)
        out[field] = value
    return out


def _literal(text: str) -> str:
    """``text`` as a regular expression that matches it alone: the regex syntax's own characters
    escaped, tab, newline and carriage return named, every other character as it is."""
    named = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return "".join(named.get(c) or ("\\" + c if c in _REGEX_SYNTAX else c) for c in text)


_REGEX_SYNTAX = frozenset(".^$*+?()[]{}|\\/-")


def constraint(body: dict[str, Any], src: dict[str, Any]) -> dict[str, str]:
    """The one constraint a request asks for, checked to compile; {} for none."""
    found = {**response_format(body), **guided(src)}
    if len(found) > 1:
        raise bad_request(
            "give at most one of response_format, json_schema, regex, ebnf and structural_tag", "response_format"
        )
    for kind, spec in found.items():
        check(kind, spec)
    return found


def check(kind: str, spec: str) -> None:
    """A 400 unless ``spec`` compiles as a ``kind`` constraint (xgrammar, no tokenizer needed)."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(spec)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec)
        else:
            xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        lines = str(exc).strip().splitlines()
        raise bad_request(f"the {kind} constraint does not compile: {lines[0] if lines else exc}", kind) from None
