"""The exported JSON Schema: the checked-in files are what the code makes, every message is
there, the messages the code makes validate, and each value rule refuses exactly what the
dataclasses refuse."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator

from pdserve import schemas
from pdserve.schemas import (
    Cancel,
    ErrorInfo,
    GenerateRequest,
    Message,
    MessageError,
    SamplingParams,
    TokenBatch,
    TokenChunk,
    TokenLogprob,
    Usage,
)
from pdserve.schemas.json_schema import DESCRIPTIONS, MESSAGES, RULES, export, schema_of

REPO_ROOT = Path(__file__).resolve().parents[2]
JSON_DIR = REPO_ROOT / "schemas" / "json"


def validator(message: type[Message]) -> Draft202012Validator:
    schema = schema_of(message)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def test_the_checked_in_files_are_what_the_code_makes() -> None:
    """Regenerate and compare: after changing a message, run `pdserve schemas export`."""
    made = export()
    assert sorted(p.name for p in JSON_DIR.glob("*.json")) == sorted(made)
    for name, data in made.items():
        assert (JSON_DIR / name).read_bytes() == data, f"{name} is stale: run `pdserve schemas export`"


def test_every_message_class_is_exported() -> None:
    classes = {c for c in vars(schemas).values() if inspect.isclass(c) and issubclass(c, Message) and c is not Message}
    assert classes == set(MESSAGES)


def test_messages_the_code_makes_validate() -> None:
    sampling = SamplingParams(max_new_tokens=8, temperature=0.5, seed=3, stop=("x",), stop_token_ids=(2,))
    request = GenerateRequest(rid="r", model="m", prompt_ids=(1, 2), reply_to="pd.tokens.c.r", sampling=sampling)
    chunk = TokenChunk(
        rid="r",
        seq=0,
        token_ids=(5,),
        finish_reason="stop",
        stop_reason="x",
        usage=Usage(2, 1),
        logprobs=(TokenLogprob(-0.1, (5,), (-0.1,)),),
        timings={"queue": 0.1},
        state="queued",
    )
    error = TokenChunk(rid="r", seq=0, finish_reason="error", error=ErrorInfo("no", "invalid_request_error", "c"))
    several = SamplingParams(n=3, logit_bias={"5": -100.0}, json_schema='{"type": "object"}')
    group = GenerateRequest(rid="g", model="m", prompt_ids=(1,), reply_to="pd.tokens.c.g", sampling=several)
    for message in (request, group, chunk, error, TokenBatch((chunk, error)), Cancel(rid="r")):
        payload = orjson.loads(message.encode())
        validator(type(message)).validate(payload)


def test_the_required_fields_alone_are_a_valid_request() -> None:
    minimal = {"v": 1, "rid": "r", "model": "m", "prompt_ids": [1], "reply_to": "pd.tokens.c.r"}
    validator(GenerateRequest).validate(minimal)
    assert GenerateRequest.decode(orjson.dumps(minimal)).sampling == SamplingParams()
    for missing in ("v", "rid", "model", "prompt_ids", "reply_to"):
        less = {k: v for k, v in minimal.items() if k != missing}
        assert not validator(GenerateRequest).is_valid(less), missing
        with pytest.raises(MessageError):
            GenerateRequest.decode(orjson.dumps(less))


# (where in a GenerateRequest, value): each refused or accepted alike by the schema and the code.
EDGES: list[tuple[tuple[str, ...], Any]] = [
    (("rid",), ""),
    (("prompt_ids",), []),
    (("prompt_ids",), [-1]),
    (("prompt_ids",), [0]),
    (("reply_to",), ""),
    (("attempt",), -1),
    (("attempt",), 0),
    (("v",), 2),
    (("sampling", "max_new_tokens"), 0),
    (("sampling", "max_new_tokens"), 1),
    (("sampling", "temperature"), -0.1),
    (("sampling", "temperature"), 0),
    (("sampling", "temperature"), 100),
    (("sampling", "temperature"), 100.5),
    (("sampling", "top_p"), 0),
    (("sampling", "top_p"), 1),
    (("sampling", "top_p"), 1.01),
    (("sampling", "min_p"), -0.01),
    (("sampling", "min_p"), 1),
    (("sampling", "seed"), -1),
    (("sampling", "seed"), None),
    (("sampling", "seed"), 2**63 - 1),
    (("sampling", "seed"), 2**63),
    (("sampling", "frequency_penalty"), 2.5),
    (("sampling", "presence_penalty"), -2),
    (("sampling", "repetition_penalty"), 0),
    (("sampling", "repetition_penalty"), 10),
    (("sampling", "top_logprobs"), 21),
    (("sampling", "top_logprobs"), 20),
    (("sampling", "stop"), ["a"] * 17),
    (("sampling", "stop"), ["a"] * 16),
    (("sampling", "stop"), [""]),
    (("sampling", "stop_token_ids"), [-3]),
    (("sampling", "stop_token_ids"), [3]),
    (("sampling", "ignore_eos"), 1),
    (("sampling", "n"), 0),
    (("sampling", "n"), 64),
    (("sampling", "n"), 65),
    (("sampling", "logit_bias"), {"17": -100, "3": 5.5}),
    (("sampling", "logit_bias"), {"17": 101}),
    (("sampling", "logit_bias"), {"x": 1}),
    (("sampling", "logit_bias"), {"-1": 1}),
    (("sampling", "logit_bias"), None),
    (("sampling", "json_schema"), '{"type": "object"}'),
    (("sampling", "json_schema"), ""),
    (("sampling", "regex"), "[a-z]+"),
    (("sampling", "ebnf"), 1),
    (("output_ids",), [1, 2]),
    (("deadline",), "soon"),
]


@pytest.mark.parametrize(("where", "value"), EDGES, ids=lambda x: str(x))
def test_the_schema_refuses_what_the_code_refuses(where: tuple[str, ...], value: Any) -> None:
    payload: dict[str, Any] = {"v": 1, "rid": "r", "model": "m", "prompt_ids": [1], "reply_to": "s", "sampling": {}}
    target = payload
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    try:
        GenerateRequest.decode(orjson.dumps(payload))
        code_accepts = True
    except MessageError:
        code_accepts = False
    assert validator(GenerateRequest).is_valid(payload) == code_accepts


def test_a_chunk_state_outside_the_known_ones_is_refused_by_both() -> None:
    bad = {"v": 1, "rid": "r", "seq": 0, "state": "zombie"}
    assert not validator(TokenChunk).is_valid(bad)
    with pytest.raises(MessageError):
        TokenChunk.decode(orjson.dumps(bad))


def test_every_rule_names_a_real_field() -> None:
    for cls, rules in RULES.items():
        assert set(rules) <= {f.name for f in dataclasses.fields(cls)}, cls


def test_every_field_a_publisher_uses_is_described_here_and_in_the_protocol_page() -> None:
    protocol = (REPO_ROOT / "docs" / "protocol.md").read_text()
    for cls, docs in DESCRIPTIONS.items():
        names = [f.name for f in dataclasses.fields(cls)]
        assert set(docs) == set(names), cls
        section = _section(protocol, cls.__name__)
        for name in names:
            assert f"`{name}`" in section, f"docs/protocol.md: {cls.__name__}.{name} is not described"


def _section(text: str, title: str) -> str:
    """The part of ``text`` under the heading that names ``title``, up to the next heading of its level."""
    match = re.search(rf"^(#+) .*`{title}`.*$", text, re.M)
    assert match, f"docs/protocol.md has no section on {title}"
    level = len(match.group(1))
    rest = text[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def test_export_writes_and_check_finds_a_stale_file(tmp_path: Path) -> None:
    from pdserve.cli import main

    assert main(["schemas", "export", "--out", str(tmp_path)]) == 0
    assert main(["schemas", "export", "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "Cancel.json").write_text("{}")
    (tmp_path / "Gone.json").write_text("{}")
    assert main(["schemas", "export", "--out", str(tmp_path), "--check"]) == 1
    assert main(["schemas", "export", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "Gone.json").exists()
    assert main(["schemas", "export", "--check"]) == 0  # the checked-in files
