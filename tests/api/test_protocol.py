"""Request bodies of /v1/completions, /v1/chat/completions and /generate, with the real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from pdserve.api.errors import APIError
from pdserve.api.model_info import ModelInfo, load_model_info
from pdserve.api.protocol import Limits, parse_chat, parse_completion, parse_generate, parse_json
from pdserve.schemas import SamplingParams

DEFAULT_MAX = 1024


@pytest.fixture(scope="module")
def info(tiny_model_dir: Path) -> ModelInfo:
    return load_model_info(tiny_model_dir)


@pytest.fixture(scope="module")
def name(info: ModelInfo) -> str:
    return info.name


def _enc(info: ModelInfo, text: str) -> list[int]:
    return list(info.tokenizer.encode(text, add_special_tokens=True))


def _chat_ids(info: ModelInfo, messages: list[dict[str, Any]]) -> list[int]:
    ids = info.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _bad(fn: Any, body: Any, info: ModelInfo, *, code: str | None = None, param: str | None = None) -> APIError:
    with pytest.raises(APIError) as exc_info:
        fn(body, info, Limits(DEFAULT_MAX))
    return _check_error(exc_info.value, code=code, param=param)


def _check_error(exc: APIError, *, code: str | None = None, param: str | None = None) -> APIError:
    assert exc.status == 400
    body = exc.body()
    error = body["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    orjson.dumps(body)  # serialisable as is
    return exc


# ---- parse_json ------------------------------------------------------------------------


def test_parse_json_accepts_object() -> None:
    assert parse_json(b'{"a": 1, "b": [true, null]}') == {"a": 1, "b": [True, None]}


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b"{'a': 1}", b'{"a": 1,}', b"\xff"])
def test_parse_json_rejects_malformed(raw: bytes) -> None:
    with pytest.raises(APIError) as exc_info:
        parse_json(raw)
    exc = _check_error(exc_info.value, code="invalid_json")
    assert "not valid JSON" in exc.message


@pytest.mark.parametrize("raw", [b"[]", b'[{"prompt": "x"}]', b"1", b'"prompt"', b"null", b"true"])
def test_parse_json_rejects_non_object(raw: bytes) -> None:
    with pytest.raises(APIError) as exc_info:
        parse_json(raw)
    exc = _check_error(exc_info.value, code="invalid_json")
    assert "JSON object" in exc.message


# ---- /v1/completions -------------------------------------------------------------------


def test_completion_minimal(info: ModelInfo, name: str) -> None:
    parsed = parse_completion({"model": name, "prompt": "Hello, world"}, info, Limits(DEFAULT_MAX))
    assert len(parsed.jobs) == 1
    job = parsed.jobs[0]
    assert job.prompt_ids == _enc(info, "Hello, world")
    assert job.prompt_text == "Hello, world"
    assert job.sampling == SamplingParams(max_new_tokens=16)  # OpenAI's default for completions
    assert not parsed.stream and not parsed.include_usage and not parsed.echo and not parsed.batch


def test_completion_maps_fields(info: ModelInfo, name: str) -> None:
    body = {
        "model": name,
        "prompt": "Once upon a time",
        "max_tokens": 40,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.1,
        "seed": 7,
        "stop": ["\n", "THE END"],
        "stop_token_ids": [5, 6],
        "ignore_eos": True,
        "frequency_penalty": 0.3,
        "presence_penalty": -0.2,
        "repetition_penalty": 1.1,
        "logprobs": 3,
        "echo": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 1,
        "user": "someone",  # unknown fields are ignored
    }
    parsed = parse_completion(body, info, Limits(DEFAULT_MAX))
    assert parsed.stream and parsed.include_usage and parsed.echo
    assert parsed.echo_logprobs and parsed.prompt_logprobs is None  # the prompt's own logprobs lead the choice's
    assert parsed.jobs[0].sampling == SamplingParams(
        max_new_tokens=40,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        min_p=0.1,
        seed=7,
        stop=("\n", "THE END"),
        stop_token_ids=(5, 6),
        ignore_eos=True,
        frequency_penalty=0.3,
        presence_penalty=-0.2,
        repetition_penalty=1.1,
        logprobs=True,
        top_logprobs=3,
        prompt_logprobs=3,  # echo with logprobs: the prompt's too
    )


def test_completion_stop_string_and_logprobs_zero(info: ModelInfo, name: str) -> None:
    parsed = parse_completion({"model": name, "prompt": "x", "stop": "##", "logprobs": 0}, info, Limits(DEFAULT_MAX))
    sampling = parsed.jobs[0].sampling
    assert sampling.stop == ("##",)
    assert sampling.logprobs and sampling.top_logprobs == 0


def test_completion_stream_options_without_usage(info: ModelInfo, name: str) -> None:
    body = {"model": name, "prompt": "x", "stream": True, "stream_options": {}}
    assert not parse_completion(body, info, Limits(DEFAULT_MAX)).include_usage


def test_completion_token_ids_prompt(info: ModelInfo, name: str) -> None:
    parsed = parse_completion({"model": name, "prompt": [10, 20, 30]}, info, Limits(DEFAULT_MAX))
    assert parsed.jobs[0].prompt_ids == [10, 20, 30]
    assert parsed.jobs[0].prompt_text is None
    assert not parsed.batch


def test_completion_batch_of_strings(info: ModelInfo, name: str) -> None:
    prompts = ["first prompt", "請介紹一下你自己", "third"]
    parsed = parse_completion({"model": name, "prompt": prompts, "max_tokens": 8}, info, Limits(DEFAULT_MAX))
    assert parsed.batch
    assert [j.prompt_ids for j in parsed.jobs] == [_enc(info, p) for p in prompts]
    assert [j.prompt_text for j in parsed.jobs] == prompts
    assert all(j.sampling.max_new_tokens == 8 for j in parsed.jobs)


def test_completion_batch_of_token_lists(info: ModelInfo, name: str) -> None:
    parsed = parse_completion({"model": name, "prompt": [[1, 2], [3]]}, info, Limits(DEFAULT_MAX))
    assert parsed.batch
    assert [j.prompt_ids for j in parsed.jobs] == [[1, 2], [3]]


def test_completion_integral_float_max_tokens(info: ModelInfo, name: str) -> None:
    parsed = parse_completion({"model": name, "prompt": "x", "max_tokens": 12.0}, info, Limits(DEFAULT_MAX))
    assert parsed.jobs[0].sampling.max_new_tokens == 12


def test_completion_max_tokens_fills_context_exactly(info: ModelInfo, name: str) -> None:
    ids = [5] * 100
    parsed = parse_completion(
        {"model": name, "prompt": ids, "max_tokens": info.context_length - 100}, info, Limits(DEFAULT_MAX)
    )
    assert parsed.jobs[0].sampling.max_new_tokens == info.context_length - 100


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"prompt": 42}, "prompt"),  # prompt as number
        ({"prompt": None}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),  # outside the vocabulary
        ({"prompt": ""}, "prompt"),  # empty prompt
        ({"prompt": ["ok", ""]}, "prompt"),
        ({"temperature": "0.7"}, "temperature"),  # temperature as string
        ({"temperature": True}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 101}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": "5"}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": 3}, "stop"),  # stop as int
        ({"stop": [1, 2]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"max_tokens": "16"}, "max_tokens"),  # max_tokens as string
        ({"max_tokens": 0}, "max_tokens"),  # max_tokens < 1
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"echo": 1}, "echo"),
        ({"ignore_eos": "false"}, "ignore_eos"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"stream_options": "usage"}, "stream_options"),
        ({"stream_options": {"include_usage": "yes"}}, "include_usage"),
        ({"n": 65}, "n"),  # more than 64 samples
        ({"n": 0}, "n"),
        ({"model": 5}, "model"),
    ],
)
def test_completion_rejects(info: ModelInfo, name: str, changes: dict[str, Any], param: str) -> None:
    body = {"model": name, "prompt": "Hello", **changes}
    _bad(parse_completion, body, info, param=param)


def test_completion_rejects_invalid_sampling_value(info: ModelInfo, name: str) -> None:
    # in range for the parser, refused by SamplingParams: still a 400
    exc = _bad(parse_completion, {"model": name, "prompt": "x", "top_p": 0}, info)
    assert "top_p" in exc.message
    exc = _bad(parse_completion, {"model": name, "prompt": "x", "repetition_penalty": 0}, info)
    assert "repetition_penalty" in exc.message


def test_completion_requires_a_prompt_and_takes_the_served_model_without_one(info: ModelInfo, name: str) -> None:
    _bad(parse_completion, {"model": name}, info, param="prompt")
    # no model: the one served (as vLLM and SGLang take it)
    same = [
        parse_completion(b, info, Limits(DEFAULT_MAX)).jobs[0].prompt_ids
        for b in ({"prompt": "x"}, {"model": name, "prompt": "x"})
    ]
    assert same[0] == same[1]


def test_completion_unknown_model(info: ModelInfo) -> None:
    exc = _bad(parse_completion, {"model": "gpt-4", "prompt": "x"}, info, code="model_not_found", param="model")
    assert "gpt-4" in exc.message


def test_an_alias_names_the_served_model(tiny_model_dir: Path) -> None:
    """``--served-model-alias``: a request may name the model by an alias (the served name
    repeated among them is dropped); any other name is still refused, naming them all."""
    aliased = load_model_info(tiny_model_dir, "served", aliases=("gpt-x", "served", "org/other", "gpt-x"))
    assert aliased.names == ("served", "gpt-x", "org/other")
    want = parse_completion({"model": "served", "prompt": "x"}, aliased, Limits(DEFAULT_MAX)).jobs[0].prompt_ids
    for alias in ("gpt-x", "org/other"):
        assert (
            parse_completion({"model": alias, "prompt": "x"}, aliased, Limits(DEFAULT_MAX)).jobs[0].prompt_ids == want
        )
    exc = _bad(parse_completion, {"model": "gpt-4", "prompt": "x"}, aliased, code="model_not_found", param="model")
    assert all(f"'{n}'" in exc.message for n in aliased.names)


def test_completion_batch_cannot_stream(info: ModelInfo, name: str) -> None:
    _bad(parse_completion, {"model": name, "prompt": ["a", "b"], "stream": True}, info, param="stream")


def test_max_tokens_beyond_context(info: ModelInfo, name: str) -> None:
    body = {"model": name, "prompt": "Hello", "max_tokens": info.context_length}
    exc = _bad(parse_completion, body, info, code="context_length_exceeded", param="max_tokens")
    assert str(info.context_length) in exc.message


def test_prompt_longer_than_context(info: ModelInfo, name: str) -> None:
    for length in (info.context_length, info.context_length + 10):
        body = {"model": name, "prompt": [7] * length, "max_tokens": 1}
        _bad(parse_completion, body, info, code="context_length_exceeded", param="prompt")
    text = "hello " * (info.context_length + 5)
    _bad(parse_completion, {"model": name, "prompt": text}, info, code="context_length_exceeded")
    _bad(parse_generate, {"text": text}, info, code="context_length_exceeded")
    long_chat = {"model": name, "messages": [{"role": "user", "content": text}]}
    _bad(parse_chat, long_chat, info, code="context_length_exceeded")


# ---- /v1/chat/completions ---------------------------------------------------------------


def test_chat_applies_template(info: ModelInfo, name: str) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "請介紹一下你自己"},
        {"role": "assistant", "content": "我是一個模型。"},
        {"role": "user", "content": "More 😀?"},
    ]
    parsed = parse_chat({"model": name, "messages": messages}, info, Limits(DEFAULT_MAX))
    job = parsed.jobs[0]
    assert job.prompt_ids == _chat_ids(info, messages)
    assert job.prompt_text is not None and job.prompt_text.endswith("<|im_start|>assistant\n")
    assert job.prompt_text.count("<|im_start|>") == 5
    # the special markers are single tokens, not spelled out
    im_start = info.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert job.prompt_ids.count(im_start) == 5
    # no limit given: the default, within the context
    assert job.sampling.max_new_tokens == DEFAULT_MAX
    assert not parsed.stream and not parsed.include_usage


def test_chat_content_parts_and_roles(info: ModelInfo, name: str) -> None:
    body = {
        "model": name,
        "messages": [
            {"role": "developer", "content": "Be nice."},
            {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42"},
        ],
    }
    parsed = parse_chat(body, info, Limits(DEFAULT_MAX))
    expected = [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": ""},
        # a template that takes no tools gets a tool's result as a user turn (api/tools.py)
        {"role": "user", "content": "<tool_response>\n42\n</tool_response>"},
    ]
    assert parsed.jobs[0].prompt_ids == _chat_ids(info, expected)
    # the template renders list content the same way
    as_parts = [dict(expected[0]), dict(body["messages"][1]), expected[2], expected[3]]  # type: ignore[index]
    assert parsed.jobs[0].prompt_ids == _chat_ids(info, as_parts)


def test_chat_maps_fields(info: ModelInfo, name: str) -> None:
    body = {
        "model": name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "temperature": 0.2,
        "top_p": 0.5,
        "seed": 11,
        "stop": "\n",
        "logprobs": True,
        "top_logprobs": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "presence_penalty": 1.0,
    }
    parsed = parse_chat(body, info, Limits(DEFAULT_MAX))
    assert parsed.stream and parsed.include_usage
    assert parsed.jobs[0].sampling == SamplingParams(
        max_new_tokens=50,
        temperature=0.2,
        top_p=0.5,
        seed=11,
        stop=("\n",),
        logprobs=True,
        top_logprobs=4,
        presence_penalty=1.0,
    )


def test_chat_max_completion_tokens_wins(info: ModelInfo, name: str) -> None:
    body = {
        "model": name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "max_completion_tokens": 9,
    }
    assert parse_chat(body, info, Limits(DEFAULT_MAX)).jobs[0].sampling.max_new_tokens == 9


def test_chat_default_max_tokens_is_capped_by_context(info: ModelInfo, name: str) -> None:
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    job = parse_chat(body, info, Limits(10**6)).jobs[0]
    assert job.sampling.max_new_tokens == info.context_length - len(job.prompt_ids)
    assert parse_chat(body, info, Limits(3)).jobs[0].sampling.max_new_tokens == 3


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": None}, "messages"),
        ({"messages": ["hi"]}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),  # bad role
        ({"messages": [{"role": "USER", "content": "hi"}]}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages"),  # no role
        ({"messages": [{"role": None, "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),  # only assistants may omit content
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),  # top_logprobs without logprobs
        ({"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"temperature": 2.5}, "temperature"),  # chat caps temperature at 2
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 65}, "n"),
        ({"stop": 1}, "stop"),
    ],
)
def test_chat_rejects(info: ModelInfo, name: str, changes: dict[str, Any], param: str) -> None:
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], **changes}
    _bad(parse_chat, body, info, param=param)


def test_chat_unknown_model_and_missing_model(info: ModelInfo) -> None:
    messages = [{"role": "user", "content": "hi"}]
    _bad(parse_chat, {"model": "llama", "messages": messages}, info, code="model_not_found")
    assert parse_chat({"messages": messages}, info, Limits(DEFAULT_MAX)).jobs  # no model: the one served


def test_chat_max_tokens_beyond_context(info: ModelInfo, name: str) -> None:
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": info.context_length - 5}
    _bad(parse_chat, body, info, code="context_length_exceeded", param="max_tokens")


# ---- /generate (SGLang) ------------------------------------------------------------------


def test_generate_top_level_shorthand(info: ModelInfo) -> None:
    body = {"text": "請介紹一下你自己", "max_new_tokens": 32, "temperature": 0.7}
    parsed = parse_generate(body, info, Limits(DEFAULT_MAX))
    job = parsed.jobs[0]
    assert job.prompt_ids == _enc(info, "請介紹一下你自己")
    assert job.prompt_text == "請介紹一下你自己"
    assert job.sampling == SamplingParams(max_new_tokens=32, temperature=0.7)
    assert not parsed.stream and not parsed.batch and parsed.rid is None and parsed.skip_special_tokens


def test_generate_sampling_params(info: ModelInfo, name: str) -> None:
    body = {
        "model": name,
        "text": "Hi",
        "max_new_tokens": 5,  # overridden by sampling_params
        "top_k": 3,  # kept: not in sampling_params
        "sampling_params": {
            "max_new_tokens": 12,
            "temperature": 0,
            "stop": ["x", "y"],
            "stop_token_ids": [9],
            "ignore_eos": True,
            "repetition_penalty": 1.3,
            "min_p": 0.05,
            "seed": 99,
            "skip_special_tokens": False,
        },
        "stream": True,
        "rid": "my-request",
        "return_logprob": True,
        "top_logprobs_num": 3,
    }
    parsed = parse_generate(body, info, Limits(DEFAULT_MAX))
    assert parsed.stream and parsed.rid == "my-request" and not parsed.skip_special_tokens
    assert parsed.jobs[0].sampling == SamplingParams(
        max_new_tokens=12,
        temperature=0.0,
        top_k=3,
        stop=("x", "y"),
        stop_token_ids=(9,),
        ignore_eos=True,
        repetition_penalty=1.3,
        min_p=0.05,
        seed=99,
        logprobs=True,
        top_logprobs=3,
    )


def test_generate_checks_a_top_level_value_that_sampling_params_overrides(info: ModelInfo) -> None:
    """sampling_params wins over the top level, but an out-of-range top-level value is still
    refused (found by the OpenAPI fuzz run: a frequency_penalty of 9.5e307 beside a valid one
    in sampling_params was served)."""
    body = {"text": "Hi", "frequency_penalty": 9.5e307, "sampling_params": {"frequency_penalty": 0.1}}
    _bad(parse_generate, body, info, param="frequency_penalty")
    _bad(parse_generate, {**body, "frequency_penalty": "high"}, info, param="frequency_penalty")
    valid = parse_generate({**body, "frequency_penalty": 1.5}, info, Limits(DEFAULT_MAX))
    assert valid.jobs[0].sampling.frequency_penalty == 0.1


def test_generate_input_ids_and_batches(info: ModelInfo) -> None:
    parsed = parse_generate(
        {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}}, info, Limits(DEFAULT_MAX)
    )
    assert parsed.jobs[0].prompt_ids == [3, 4, 5] and not parsed.batch
    parsed = parse_generate({"input_ids": [[3, 4], [5]]}, info, Limits(DEFAULT_MAX))
    assert parsed.batch and [j.prompt_ids for j in parsed.jobs] == [[3, 4], [5]]
    parsed = parse_generate({"text": ["one", "two"]}, info, Limits(DEFAULT_MAX))
    assert parsed.batch and [j.prompt_ids for j in parsed.jobs] == [_enc(info, "one"), _enc(info, "two")]


def test_generate_default_max_new_tokens(info: ModelInfo) -> None:
    assert parse_generate({"text": "x"}, info, Limits(DEFAULT_MAX)).jobs[0].sampling.max_new_tokens == 128
    assert parse_generate({"text": "x"}, info, Limits(20)).jobs[0].sampling.max_new_tokens == 20
    assert (
        parse_generate({"text": "x", "sampling_params": None}, info, Limits(20)).jobs[0].sampling.max_new_tokens == 20
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": ""}, "text"),  # empty text
        ({"text": 5}, "text"),
        ({"text": ["a", ""]}, "text"),
        ({}, "text"),
        ({"text": "x", "input_ids": [1]}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1.0]}, "input_ids"),
        ({"input_ids": [4352]}, "input_ids"),  # == vocabulary size
        ({"input_ids": "hello"}, "input_ids"),  # text where ids belong
        ({"input_ids": ["hello", "world"]}, "input_ids"),
        ({"text": "x", "sampling_params": [1]}, "sampling_params"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
        ({"text": "x", "max_new_tokens": "32"}, "max_new_tokens"),
        ({"text": "x", "temperature": "0.7"}, "temperature"),
        ({"text": "x", "sampling_params": {"stop": 1}}, "stop"),
        ({"text": "x", "sampling_params": {"n": 65}}, "n"),
        ({"text": "x", "n": 0}, "n"),
        ({"text": "x", "sampling_params": {"skip_special_tokens": "no"}}, "skip_special_tokens"),
        ({"text": ["a", "b"], "stream": True}, "stream"),
        ({"text": "x", "rid": 5}, "rid"),
        ({"text": ["a", "b"], "rid": "r"}, "rid"),
        ({"text": "x", "return_logprob": "yes"}, "return_logprob"),
        ({"text": "x", "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"text": "x", "model": "other"}, "model"),
    ],
)
def test_generate_rejects(info: ModelInfo, body: dict[str, Any], param: str) -> None:
    _bad(parse_generate, body, info, param=param)


def test_generate_model_is_optional_but_checked(info: ModelInfo, name: str) -> None:
    assert parse_generate({"text": "x", "model": name}, info, Limits(DEFAULT_MAX)).jobs
    _bad(parse_generate, {"text": "x", "model": "nope"}, info, code="model_not_found")


def test_generate_max_new_tokens_beyond_context(info: ModelInfo) -> None:
    body = {"text": "x", "sampling_params": {"max_new_tokens": info.context_length}}
    _bad(parse_generate, body, info, code="context_length_exceeded")


# ---- model info ---------------------------------------------------------------------------


def test_model_info(info: ModelInfo, tiny_model_dir: Path) -> None:
    assert info.name == tiny_model_dir.name
    assert info.context_length == 4096
    assert info.has_chat_template
    assert info.tokenizer.eos_token_id in info.eos_token_ids
    assert load_model_info(tiny_model_dir, name="alias", context_length=1000).context_length == 1000


def test_n_bias_user_and_constraints_reach_the_sampling(info: Any) -> None:
    body = {
        "model": info.name,
        "prompt": "hi",
        "n": 3,
        "logit_bias": {"5": -100, 7: 2.5},
        "user": "u1",
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    }
    (job,) = parse_completion(body, info, Limits()).jobs
    assert job.sampling.n == 3
    assert job.sampling.logit_bias == {"5": -100.0, "7": 2.5}
    assert job.sampling.json_schema == '{"type":"object"}'
    generate = parse_generate({"text": "x", "sampling_params": {"regex": "[ab]+", "n": 2}}, info, Limits())
    assert generate.jobs[0].sampling.regex == "[ab]+" and generate.jobs[0].sampling.n == 2


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}, "guided_regex": "a+"},  # two constraints
        {"guided_regex": "(unclosed"},
        {"guided_grammar": "root ::= "},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": "{not json"}}},
        {"logit_bias": [1, 2]},
    ],
)
def test_constraints_that_cannot_work_are_400s(info: Any, extra: dict[str, Any]) -> None:
    with pytest.raises(APIError) as caught:
        parse_completion({"model": info.name, "prompt": "hi", **extra}, info, Limits())
    assert caught.value.status == 400


# ---- the model's generation config as request defaults ---------------------------------
def test_generation_config_values_are_the_defaults_a_request_can_override(info: ModelInfo) -> None:
    import dataclasses

    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    model = dataclasses.replace(info, sampling_defaults=defaults)
    messages = [{"role": "user", "content": "hi"}]
    for parsed in (
        parse_completion({"model": info.name, "prompt": "hi"}, model, Limits()),
        parse_chat({"model": info.name, "messages": messages}, model, Limits()),
        parse_generate({"text": "hi", "sampling_params": {}}, model, Limits()),
    ):
        s = parsed.jobs[0].sampling
        assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    own = parse_generate({"text": "hi", "temperature": 0, "sampling_params": {"top_k": -1}}, model, Limits())
    assert (own.jobs[0].sampling.temperature, own.jobs[0].sampling.top_k, own.jobs[0].sampling.top_p) == (0, -1, 0.9)
    plain = parse_completion({"model": info.name, "prompt": "hi"}, info, Limits()).jobs[0].sampling
    assert (plain.temperature, plain.top_k, plain.repetition_penalty) == (1.0, -1, 1.0)


def test_sampling_defaults_read_only_the_sampling_keys_and_refuse_bad_values(tmp_path: Path) -> None:
    from pdserve.api.model_info import sampling_defaults

    file = tmp_path / "generation_config.json"
    assert sampling_defaults(tmp_path) == {}  # no file
    file.write_text('{"do_sample": true, "temperature": 0.7, "top_k": 20, "max_new_tokens": 99, "eos_token_id": 2}')
    assert sampling_defaults(tmp_path) == {"temperature": 0.7, "top_k": 20}
    assert isinstance(sampling_defaults(tmp_path)["temperature"], float)
    assert sampling_defaults(tmp_path, "none") == {}
    for bad in ('{"temperature": -1}', '{"top_p": 0}', '{"top_k": 2.5}', '{"repetition_penalty": "x"}', "{", "[]"):
        file.write_text(bad)
        with pytest.raises(ValueError, match=r"generation_config\.json"):
            sampling_defaults(tmp_path)
        assert sampling_defaults(tmp_path, "none") == {}
    with pytest.raises(ValueError, match="auto, none"):
        sampling_defaults(tmp_path, "vllm")


def test_continue_final_message_leaves_the_last_assistant_message_open(info: ModelInfo, name: str) -> None:
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    body = {"model": name, "messages": messages, "max_tokens": 4, "continue_final_message": True}
    parsed = parse_chat(body, info, Limits(DEFAULT_MAX))
    text = parsed.jobs[0].prompt_text
    want = info.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert text == want and text.endswith("The colour is")
    closed = parse_chat({**body, "continue_final_message": False}, info, Limits(DEFAULT_MAX)).jobs[0].prompt_text
    assert closed.endswith("<|im_start|>assistant\n")  # the default: a new reply after the last message
    for bad in (
        {**body, "add_generation_prompt": True},
        {**body, "messages": messages[:1]},
    ):
        with pytest.raises(APIError) as refused:
            parse_chat(bad, info, Limits(DEFAULT_MAX))
        assert refused.value.param == "continue_final_message"


def test_min_tokens_vllm_and_sglang(info: ModelInfo, name: str) -> None:
    """vLLM's min_tokens (completions, chat) and SGLang's min_new_tokens (/generate) set the
    floor; more than the output may hold, or with structured output, is a 400."""
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "min_tokens": 4}
    assert parse_chat(chat, info, Limits(DEFAULT_MAX)).jobs[0].sampling.min_new_tokens == 4
    completion = parse_completion({"prompt": "x", "max_tokens": 5, "min_tokens": 5}, info, Limits(DEFAULT_MAX))
    assert completion.jobs[0].sampling.min_new_tokens == 5
    for where in ({"sampling_params": {"min_new_tokens": 3}}, {"min_new_tokens": 3}):
        parsed = parse_generate({"text": "hi", **where}, info, Limits(DEFAULT_MAX))
        assert parsed.jobs[0].sampling.min_new_tokens == 3
    _bad(parse_chat, {**chat, "min_tokens": 9}, info, param="min_tokens")
    _bad(parse_completion, {"prompt": "x", "min_tokens": -1}, info, param="min_tokens")
    _bad(parse_generate, {"text": "hi", "max_new_tokens": 2, "min_new_tokens": 3}, info, param="min_new_tokens")
    _bad(parse_chat, {**chat, "response_format": {"type": "json_object"}}, info)
    weather = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    _bad(parse_chat, {**chat, "tools": [weather], "tool_choice": "required"}, info, param="min_tokens")


def test_prompt_logprobs_requests(info: ModelInfo, name: str) -> None:
    """Each API's way to ask for the prompt's log-probabilities; max_tokens 0 only where the
    prompt is shown; a request whose scores would not fit in one broker message is refused."""
    ids = list(range(3, 203))
    scored = parse_completion({"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0}, info, Limits(DEFAULT_MAX))
    job = scored.jobs[0]
    assert scored.echo_logprobs and job.sampling.prompt_logprobs == 1 and job.sampling.max_new_tokens == 1
    assert not job.show_output  # max_tokens 0: the token drawn is not shown
    vllm = parse_completion({"prompt": ids, "prompt_logprobs": 4, "logprobs": 2}, info, Limits(DEFAULT_MAX))
    assert vllm.prompt_logprobs == 4 and not vllm.echo_logprobs and vllm.jobs[0].sampling.prompt_logprobs == 4
    plain = parse_completion({"prompt": ids, "logprobs": 2}, info, Limits(DEFAULT_MAX))
    assert plain.jobs[0].sampling.prompt_logprobs is None  # the output's alone, as before
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0}
    assert parse_chat(chat, info, Limits(DEFAULT_MAX)).jobs[0].sampling.prompt_logprobs == 0
    sglang = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 10, "top_logprobs_num": 2}
    parsed = parse_generate({**sglang, "sampling_params": {"max_new_tokens": 0}}, info, Limits(DEFAULT_MAX))
    assert parsed.input_logprobs_from == 10 and parsed.jobs[0].sampling.prompt_logprobs == 2
    assert not parsed.jobs[0].show_output
    assert (
        parse_generate({"input_ids": ids, "return_logprob": True}, info, Limits(DEFAULT_MAX))
        .jobs[0]
        .sampling.prompt_logprobs
        is None
    )  # logprob_start_len -1, SGLang's default: the output's alone
    _bad(parse_completion, {"prompt": ids, "max_tokens": 0}, info, param="max_tokens")
    several = parse_completion({"prompt": ids, "prompt_logprobs": 1, "n": 3}, info, Limits(DEFAULT_MAX))
    assert several.jobs[0].sampling.n == 3 and several.jobs[0].sampling.prompt_logprobs == 1  # each sample shows them
    _bad(parse_chat, {**chat, "prompt_logprobs": 21}, info, param="prompt_logprobs")
    small = Limits(DEFAULT_MAX, max_message_bytes=1 << 14)
    assert parse_completion({"prompt": ids, "prompt_logprobs": 0}, info, small).jobs  # 200 tokens fit
    with pytest.raises(APIError) as refused:
        parse_completion({"prompt": ids, "prompt_logprobs": 5}, info, small)
    assert refused.value.code == "prompt_logprobs_too_large" and "5 alternatives" in refused.value.message


def test_cache_salt_is_a_string_carried_to_the_workers(info: ModelInfo, name: str) -> None:
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    assert (
        parse_completion({"prompt": "x", "cache_salt": "t1"}, info, Limits(DEFAULT_MAX)).jobs[0].sampling.cache_salt
        == "t1"
    )
    assert parse_chat({**chat, "cache_salt": "t2"}, info, Limits(DEFAULT_MAX)).jobs[0].sampling.cache_salt == "t2"
    assert parse_completion({"prompt": "x"}, info, Limits(DEFAULT_MAX)).jobs[0].sampling.cache_salt is None
    for bad in ("", 7, "s" * 257):
        _bad(parse_completion, {"prompt": "x", "cache_salt": bad}, info, param="cache_salt")


def test_bad_words_are_each_word_s_tokens_as_it_stands_and_after_a_space(info: ModelInfo, name: str) -> None:
    """vLLM's ``bad_words``: a word's tokens as it stands, and where a space before it gives
    another first token of the same length, those too (a word opening the text and one inside
    it); the same sequence once; on completions, chat and /generate's sampling_params."""
    tok = info.tokenizer
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    for word in ("hello", "blue sky", "  the"):
        bare, spaced = word.strip(), " " + word.strip()
        want = {tuple(tok.encode(bare, add_special_tokens=False))}
        other = tuple(tok.encode(spaced, add_special_tokens=False))
        if len(other) == len(next(iter(want))) and other[0] != next(iter(want))[0]:
            want.add(other)
        for parse, body in (
            (parse_completion, {"prompt": "x", "bad_words": [word, word]}),
            (parse_chat, {**chat, "bad_words": [word]}),
            (parse_generate, {"text": "x", "sampling_params": {"bad_words": [word]}}),
        ):
            got = parse(body, info, Limits(DEFAULT_MAX)).jobs[0].sampling.bad_words
            assert set(got) == want and len(got) == len(want), (word, got)
    _bad(parse_completion, {"prompt": "x", "bad_words": "hello"}, info, param="bad_words")
    _bad(parse_completion, {"prompt": "x", "bad_words": [""]}, info, param="bad_words")
    _bad(parse_completion, {"prompt": "x", "bad_words": [1]}, info, param="bad_words")
    _bad(parse_completion, {"prompt": "x", "bad_words": [f"w{i}" for i in range(129)]}, info, param="bad_words")
    _bad(parse_completion, {"prompt": "x", "bad_words": ["x" * 400]}, info, param="bad_words")  # over 32 tokens


def test_priority_is_vllm_s_on_completions_and_chat_and_sglang_s_on_generate(info: ModelInfo, name: str) -> None:
    """vLLM's priority (lower first) as it is; SGLang's on /generate (higher first, as SGLang
    schedules by default) negated; 0 by default; an integer within bounds."""
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    for parse, body in ((parse_completion, {"prompt": "x"}), (parse_chat, chat)):
        assert parse(body, info, Limits(DEFAULT_MAX)).jobs[0].sampling.priority == 0
        assert parse({**body, "priority": -5}, info, Limits(DEFAULT_MAX)).jobs[0].sampling.priority == -5
        _bad(parse, {**body, "priority": 1.5}, info, param="priority")
        _bad(parse, {**body, "priority": "high"}, info, param="priority")
        _bad(parse, {**body, "priority": 1 << 40}, info, param="priority")
    generate = parse_generate({"text": "hi", "priority": 7}, info, Limits(DEFAULT_MAX))
    assert generate.jobs[0].sampling.priority == -7
    batch = parse_generate({"text": ["a", "b"], "priority": -2}, info, Limits(DEFAULT_MAX))
    assert [job.sampling.priority for job in batch.jobs] == [2, 2]


@pytest.mark.parametrize(
    ("key", "value", "where"),
    [
        ("use_beam_search", True, "both"),
        ("length_penalty", 0.5, "both"),
        ("logits_processors", ["x"], "both"),
        ("guided_whitespace_pattern", " ", "both"),
        ("spaces_between_special_tokens", False, "both"),
        ("kv_transfer_params", {"do_remote_decode": True}, "both"),
        ("chat_template", "{{ messages }}", "chat"),
        ("lora_path", "adapter", "generate"),
        ("image_data", "http://x/y.png", "generate"),
        ("return_hidden_states", True, "generate"),
        ("suffix", "}", "completion"),
        ("prompt_embeds", "AAAA", "both"),
        ("best_of", 3, "completion"),
        ("modalities", ["text", "audio"], "chat"),
        ("audio", {"voice": "alloy", "format": "wav"}, "chat"),
    ],
)
def test_what_vllm_and_sglang_serve_and_pdserve_does_not_is_refused_not_ignored(
    info: ModelInfo, name: str, key: str, value: Any, where: str
) -> None:
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    bodies = {
        "both": [(parse_completion, {"prompt": "x"}), (parse_chat, chat)],
        "chat": [(parse_chat, chat)],
        "completion": [(parse_completion, {"prompt": "x"})],
        "generate": [(parse_generate, {"text": "hi"})],
    }[where]
    for parse, body in bodies:
        _bad(parse, {**body, key: value}, info, code="unsupported_parameter", param=key)
    defaults = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "spaces_between_special_tokens": True,
        "echo": False,
        "best_of": 1,
        "modalities": ["text"],
    }
    if key in defaults:  # the value that asks for nothing is taken
        for parse, body in bodies:
            assert parse({**body, key: defaults[key]}, info, Limits(DEFAULT_MAX)).jobs


def test_sglang_s_sampling_seed_is_the_seed(info: ModelInfo) -> None:
    """SGLang's ``sampling_seed`` seeds the request (``seed`` wins where both are given)."""
    seeded = parse_generate({"text": "hi", "sampling_params": {"sampling_seed": 5}}, info, Limits(DEFAULT_MAX))
    assert seeded.jobs[0].sampling.seed == 5
    both = parse_generate({"text": "hi", "sampling_params": {"sampling_seed": 5, "seed": 6}}, info, Limits(DEFAULT_MAX))
    assert both.jobs[0].sampling.seed == 6


def test_stop_regex_is_taken_as_a_pattern_or_a_list_and_a_bad_one_is_a_400(info: ModelInfo) -> None:
    """SGLang's ``stop_regex`` (in ``sampling_params`` or at the top of /generate; on
    completions and chat as an extra field, as SGLang's OpenAI API takes it): a pattern or a
    list of them; one that does not compile, matches the empty text, is too long, or too many
    of them, is a 400 naming it."""
    limits = Limits(DEFAULT_MAX)
    one = parse_generate({"text": "hi", "sampling_params": {"stop_regex": r"\d+\."}}, info, limits)
    assert one.jobs[0].sampling.stop_regex == (r"\d+\.",)
    top = parse_generate({"text": "hi", "stop_regex": ["END", "x{2}"]}, info, limits)
    assert top.jobs[0].sampling.stop_regex == ("END", "x{2}")
    chat = parse_chat(
        {"model": info.name, "messages": [{"role": "user", "content": "hi"}], "stop_regex": "a+b"}, info, limits
    )
    assert chat.jobs[0].sampling.stop_regex == ("a+b",)
    done = parse_completion({"model": info.name, "prompt": "hi", "stop_regex": ["(?i)done"]}, info, limits)
    assert done.jobs[0].sampling.stop_regex == ("(?i)done",)
    for value in ("(", "a*", "x" * 257, [""], ["a"] * 17, 3, [1]):
        _bad(parse_generate, {"text": "hi", "sampling_params": {"stop_regex": value}}, info, param="stop_regex")


def test_a_structural_tag_is_taken_in_each_api_s_form(info: ModelInfo, name: str) -> None:
    """vLLM's response_format ``structural_tag`` and ``structural_tag`` field, SGLang's in
    ``sampling_params``: xgrammar's format as it stands, the earlier ``structures`` and
    ``triggers`` as its ``triggered_tags``; one that is malformed or does not compile is a 400."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
        "triggers": ["<f"],
    }
    fmt = {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</f>"}
    triggered = {
        "type": "triggered_tags",
        "triggers": ["<f"],
        "tags": [
            {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</f>"}
        ],
    }
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    limits = Limits(DEFAULT_MAX)

    def tag_of(parsed: Any) -> dict[str, Any]:
        text = parsed.jobs[0].sampling.structural_tag
        assert parsed.jobs[0].sampling.constraint == ("structural_tag", text)
        return dict(json.loads(text))

    assert tag_of(parse_chat({**chat, "response_format": legacy}, info, limits))["format"] == triggered
    new = {"type": "structural_tag", "format": fmt}
    assert tag_of(parse_chat({**chat, "response_format": new}, info, limits))["format"] == fmt
    as_text = {"prompt": "x", "structural_tag": json.dumps(legacy)}
    assert tag_of(parse_completion(as_text, info, limits))["format"] == triggered
    sglang = {"text": "hi", "sampling_params": {"structural_tag": json.dumps(new)}}
    assert tag_of(parse_generate(sglang, info, limits))["format"] == fmt
    for bad in ("{", [], {"structures": [], "triggers": ["<f"]}, {"structures": legacy["structures"]}):
        _bad(parse_completion, {"prompt": "x", "structural_tag": bad}, info, param="structural_tag")
    wrong = {"type": "structural_tag", "format": {"type": "no-such-format"}}
    _bad(parse_chat, {**chat, "response_format": wrong}, info, param="structural_tag")
    both = {"prompt": "x", "structural_tag": json.dumps(new), "regex": "a+"}
    _bad(parse_completion, both, info, param="response_format")


def test_reasoning_effort_reaches_the_chat_template_as_vllm_hands_it() -> None:
    """OpenAI's ``reasoning_effort``: the template gets it, and ``enable_thinking`` off for
    ``none``, on otherwise; ``chat_template_kwargs`` set explicitly win; another value is a 400."""
    from pdserve.api.protocol import template_kwargs

    assert template_kwargs({"reasoning_effort": "none"}) == {"reasoning_effort": "none", "enable_thinking": False}
    assert template_kwargs({"reasoning_effort": "high"}) == {"reasoning_effort": "high", "enable_thinking": True}
    both = {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    assert template_kwargs(both) == {"reasoning_effort": "low", "enable_thinking": False}
    assert template_kwargs({}) == {}
    with pytest.raises(APIError) as refused:
        template_kwargs({"reasoning_effort": "extreme"})
    assert refused.value.param == "reasoning_effort"


def test_documents_reach_a_chat_template_that_reads_them(info: ModelInfo, name: str) -> None:
    """vLLM's ``documents``: handed to the chat template (retrieval templates render them); a
    template that reads none is not changed by them; a malformed list is a 400."""
    chat = {"model": name, "messages": [{"role": "user", "content": "what is said?"}]}
    docs = [{"title": "a note", "text": "the sky is green"}, {"text": "grass is blue"}]
    plain = parse_chat(chat, info, Limits(DEFAULT_MAX)).jobs[0].prompt_ids
    assert parse_chat({**chat, "documents": docs}, info, Limits(DEFAULT_MAX)).jobs[0].prompt_ids == plain
    tokenizer = info.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% for d in documents or [] %}[doc {{ d.get('title', loop.index) }}] {{ d['text'] }}\n{% endfor %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    try:
        ids = parse_chat({**chat, "documents": docs}, info, Limits(DEFAULT_MAX)).jobs[0].prompt_ids
        text = tokenizer.decode(ids)
        assert "[doc a note] the sky is green" in text and "[doc 2] grass is blue" in text
        assert "user: what is said?" in text
    finally:
        tokenizer.chat_template = template
    for bad in ("text", [{"text": 1}], [{}], [[("text", "x")]]):
        _bad(parse_chat, {**chat, "documents": bad}, info, param="documents")


def test_vllm_extensions_that_are_served(info: ModelInfo, name: str) -> None:
    tokenizer = info.tokenizer
    ids = list(range(10, 40))
    cut = parse_completion({"prompt": ids, "truncate_prompt_tokens": 8, "echo": True}, info, Limits(DEFAULT_MAX))
    assert cut.jobs[0].prompt_ids == ids[-8:] and cut.jobs[0].prompt_text is None  # the echo shows what was kept
    whole = parse_completion({"prompt": ids, "truncate_prompt_tokens": -1}, info, Limits(DEFAULT_MAX))
    assert whole.jobs[0].prompt_ids == ids
    _bad(parse_completion, {"prompt": ids, "truncate_prompt_tokens": 0}, info, param="truncate_prompt_tokens")
    chat = {"model": name, "messages": [{"role": "user", "content": "hello there"}], "truncate_prompt_tokens": 3}
    assert len(parse_chat(chat, info, Limits(DEFAULT_MAX)).jobs[0].prompt_ids) == 3
    plain = parse_completion({"prompt": "hello"}, info, Limits(DEFAULT_MAX)).jobs[0].prompt_ids
    bare = parse_completion({"prompt": "hello", "add_special_tokens": False}, info, Limits(DEFAULT_MAX))
    assert bare.jobs[0].prompt_ids == tokenizer.encode("hello", add_special_tokens=False)
    assert plain == tokenizer.encode("hello", add_special_tokens=True)
    kept = parse_completion(
        {"prompt": "x", "stop": ["."], "include_stop_str_in_output": True}, info, Limits(DEFAULT_MAX)
    )
    assert kept.jobs[0].keep_stop
    assert (
        parse_generate({"text": "x", "sampling_params": {"no_stop_trim": True}}, info, Limits(DEFAULT_MAX))
        .jobs[0]
        .keep_stop
    )
    assert not parse_completion({"prompt": "x"}, info, Limits(DEFAULT_MAX)).jobs[0].keep_stop
    special = parse_chat({**chat, "skip_special_tokens": False}, info, Limits(DEFAULT_MAX))
    assert not special.skip_special_tokens
    assert parse_chat({**chat, "return_tokens_as_token_ids": True}, info, Limits(DEFAULT_MAX)).tokens_as_ids
    assert parse_completion(
        {"prompt": "x", "return_tokens_as_token_ids": True}, info, Limits(DEFAULT_MAX)
    ).tokens_as_ids
    allowed = parse_completion({"prompt": "x", "allowed_token_ids": [9, 5, 9]}, info, Limits(DEFAULT_MAX))
    assert allowed.jobs[0].sampling.allowed_token_ids == (5, 9)
    _bad(parse_completion, {"prompt": "x", "allowed_token_ids": []}, info, param="allowed_token_ids")
    _bad(parse_completion, {"prompt": "x", "allowed_token_ids": [10**9]}, info, param="allowed_token_ids")
    choice = parse_chat({**chat, "guided_choice": ["yes", "no (maybe)"]}, info, Limits(DEFAULT_MAX))
    assert choice.jobs[0].sampling.regex == r"(yes|no \(maybe\))"
    _bad(parse_chat, {**chat, "guided_choice": ["a"], "guided_regex": "b"}, info, param="guided_choice")
    _bad(parse_chat, {**chat, "guided_choice": []}, info, param="guided_choice")


def test_chat_echo_takes_the_last_message_where_it_is_the_reply_s_role(info: ModelInfo, name: str) -> None:
    """vLLM's ``echo`` on chat: the last message's text leads each choice where that message is
    the reply's role (an assistant message the reply goes on with); else nothing is echoed."""
    limits = Limits(DEFAULT_MAX)
    asked = [{"role": "user", "content": "hi"}]
    going = [*asked, {"role": "assistant", "content": [{"type": "text", "text": "Well,"}]}]
    body = {"model": name, "messages": going, "continue_final_message": True, "echo": True}
    assert parse_chat(body, info, limits).echo_text == "Well,"
    assert parse_chat({"model": name, "messages": asked, "echo": True}, info, limits).echo_text == ""
    assert parse_chat({"model": name, "messages": asked}, info, limits).echo_text is None
    _bad(parse_chat, {"model": name, "messages": asked, "echo": "yes"}, info, param="echo")
