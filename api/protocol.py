"""Request bodies of the three generation APIs, validated into one internal form.

Everything a client can get wrong is a 400 with an OpenAI-style body, raised before
anything is published.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from pdserve.api import constraints, reasoning, tools
from pdserve.api.errors import bad_request
from pdserve.api.model_info import ModelInfo
from pdserve.schemas import SamplingParams
from pdserve.schemas.sampling import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT,
    MAX_PRIORITY,
    MAX_SAMPLES,
    MAX_STOP_REGEX,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    stop_pattern,
)
from pdserve.schemas.tokens import prompt_logprobs_bytes

MAX_COMPLETION_LOGPROBS = 5
MAX_BATCH = 256  # prompts in one request, by default
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
INT64 = 2**63


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: ``default_max_tokens`` where it sets no limit;
    prompts of at most ``max_prompt_tokens`` and at most ``max_output_tokens`` new tokens
    (``None``: the model's context decides); at most ``max_batch`` prompts."""

    default_max_tokens: int = 1024
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_batch: int = MAX_BATCH
    max_message_bytes: int | None = None  # the broker's largest message: bounds a prompt's log-probabilities

    def default_for(self, wanted: int) -> int:
        """``wanted`` new tokens, or fewer if the server allows fewer."""
        return min(wanted, self.max_output_tokens) if self.max_output_tokens else wanted


@dataclass
class Job:
    """One generation: prompt ids, how to sample, how to answer."""

    prompt_ids: list[int]
    sampling: SamplingParams
    prompt_text: str | None = None
    show_output: bool = True  # False: max_tokens 0 (scoring a prompt): the one token drawn is not shown
    keep_stop: bool = False  # the stop string that ended the text stays in it (vLLM's include_stop_str_in_output)


@dataclass
class Parsed:
    jobs: list[Job]
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    echo: bool = False
    skip_special_tokens: bool = True
    rid: str | list[str] | None = None  # /generate: one id, or one per prompt of a batch
    batch: bool = False  # the client sent a list of prompts
    tools: tools.ToolRequest | None = None  # chat: the tools shown, whose calls are read back
    thinking: bool | None = None  # chat: None, no reasoning split; else whether the prompt opened the thinking
    # The prompt's log-probabilities, as each API shows them: vLLM's ``prompt_logprobs`` field
    # (completions and chat), the legacy completions' ``echo`` with ``logprobs`` (the prompt's
    # tokens lead the choice's logprobs), SGLang's ``logprob_start_len`` (-1: none).
    prompt_logprobs: int | None = None
    echo_logprobs: bool = False
    input_logprobs_from: int = -1
    text_in_logprobs: bool = False  # /generate: SGLang's return_text_in_logprobs
    tokens_as_ids: bool = False  # completions, chat: vLLM's return_tokens_as_token_ids
    token_ids: bool = False  # completions, chat: vLLM's return_token_ids (the prompt's and each choice's ids)
    # chat: vLLM's ``echo``: the last message's text, which each choice's content begins with
    # (where that message is the reply's role: an assistant message the reply goes on with)
    echo_text: str | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return body


# ---- typed getters -------------------------------------------------------------
def _number(
    body: dict[str, Any], key: str, default: float | None, low: float | None = None, high: float | None = None
) -> float | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{key}' must be a number", key)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad_request(f"'{key}' must be between {low} and {high}; got {value}", key)
    return float(value)


def _int(
    body: dict[str, Any], key: str, default: int | None, low: int | None = None, high: int | None = None
) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise bad_request(f"'{key}' must be an integer", key)
    if not -INT64 <= value < INT64:  # past what the wire format carries
        raise bad_request(f"'{key}' is out of range; got {value}", key)
    if low is not None and value < low:
        raise bad_request(f"'{key}' must be at least {low}; got {value}", key)
    if high is not None and value > high:
        raise bad_request(f"'{key}' must be at most {high}; got {value}", key)
    return value


def _f(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = _number(body, key, default, low, high)
    return default if value is None else value


def _i(body: dict[str, Any], key: str, default: int, low: int) -> int:
    value = _int(body, key, default, low)
    return default if value is None else value


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean", key)
    return value


def _stops(body: dict[str, Any], key: str = "stop") -> tuple[str, ...]:
    value = body.get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request(f"'{key}' must be a string or a list of strings", key)
    if len(value) > MAX_STOP_STRINGS:
        raise bad_request(f"'{key}' may hold at most {MAX_STOP_STRINGS} strings", key)
    if any(not s for s in value):
        raise bad_request(f"'{key}' strings must not be empty", key)
    return tuple(value)


def _token_ids(value: Any, key: str, vocab: int | None = None) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"'{key}' must be a list of integers", key)
    if any(t < 0 or (vocab is not None and t >= vocab) for t in value):
        raise bad_request(f"'{key}' holds a token id outside the vocabulary", key)
    return list(value)


# ---- what other servers take and pdserve does not ------------------------------------
def _set(value: Any) -> bool:
    return value not in (None, False, 0, "", [], {})


# vLLM's request extensions pdserve does not serve, each with whether a value asks for
# something (then a 400 ``unsupported_parameter``, never ignored); the rest of vLLM's are served.
VLLM_UNSERVED: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("use_beam_search", _set),
    ("length_penalty", lambda v: v not in (None, 1, 1.0)),
    ("logits_processors", _set),
    ("guided_whitespace_pattern", _set),
    ("spaces_between_special_tokens", lambda v: v is False),
    ("kv_transfer_params", _set),
    ("vllm_xargs", _set),
    ("prompt_embeds", _set),
)
# OpenAI's own parameters that ask for what pdserve does not do (a value that asks nothing passes).
COMPLETION_UNSERVED: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("suffix", _set),  # text inserted after the completion (fill-in-the-middle)
    ("best_of", lambda v: v not in (None, 1)),  # several drawn, the best returned
)
CHAT_UNSERVED: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("modalities", lambda v: v not in (None, ["text"])),  # audio out
    ("audio", _set),
    ("chat_template", _set),  # a template in the request: vLLM takes it only when told to trust requests
    ("mm_processor_kwargs", _set),
)
SGLANG_UNSERVED: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("lora_path", _set),
    ("image_data", _set),
    ("audio_data", _set),
    ("video_data", _set),
    ("input_embeds", _set),
    ("custom_logit_processor", _set),
    ("return_hidden_states", _set),
    ("session_params", _set),
)


def unserved(src: dict[str, Any], table: tuple[tuple[str, Callable[[Any], bool]], ...]) -> None:
    """A 400 for the first key of ``table`` that ``src`` sets to a value asking for something."""
    for key, asks in table:
        if key in src and asks(src[key]):
            raise bad_request(f"'{key}' is not supported by this server", key, "unsupported_parameter")


def truncated(body: dict[str, Any], ids: list[int], text: str | None) -> tuple[list[int], str | None]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``k`` tokens (the text then goes,
    an echo shows those tokens)."""
    k = _int(body, "truncate_prompt_tokens", None, -1)
    if k is None or k == -1 or len(ids) <= k:  # -1: to the model's context, which any prompt here fits
        return ids, text
    if k == 0:
        raise bad_request("'truncate_prompt_tokens' must be at least 1 (or -1)", "truncate_prompt_tokens")
    return ids[-k:], None


def _stop_regex(src: dict[str, Any]) -> tuple[str, ...]:
    """SGLang's ``stop_regex``: a pattern or a list of them, each compiled here (a 400 names it)."""
    patterns = _stops(src, "stop_regex")
    for p in patterns:
        if len(p) > MAX_STOP_REGEX:
            raise bad_request(f"'stop_regex' patterns may have at most {MAX_STOP_REGEX} characters", "stop_regex")
        compiled = stop_pattern(p)
        if compiled is None:
            raise bad_request(f"'stop_regex' {p!r} is not a valid regular expression", "stop_regex")
        if compiled.fullmatch("") is not None:
            raise bad_request(f"'stop_regex' {p!r} matches the empty text", "stop_regex")
    return patterns


def _keep_stop(src: dict[str, Any]) -> bool:
    """vLLM's ``include_stop_str_in_output``, SGLang's ``no_stop_trim``."""
    return _bool(src, "include_stop_str_in_output", False) or _bool(src, "no_stop_trim", False)


# ---- common sampling -------------------------------------------------------------
def _sampling(
    src: dict[str, Any],
    max_tokens: int,
    info: ModelInfo,
    limits: Limits,
    num_prompt: int,
    logprobs: bool,
    top_logprobs: int,
    n: int = 1,
    body: dict[str, Any] | None = None,
    prompt_logprobs: int | None = None,
    priority: int = 0,
) -> SamplingParams:
    """``src``: where the sampling keys are (``/generate``: its merged ``sampling_params``);
    ``body``: the whole body (``response_format`` lives there); ``priority``: lower first
    (:func:`priority`)."""
    if limits.max_prompt_tokens is not None and num_prompt > limits.max_prompt_tokens:
        raise bad_request(
            f"the prompt has {num_prompt} tokens; this server takes at most {limits.max_prompt_tokens}",
            "prompt",
            "prompt_too_long",
        )
    if limits.max_output_tokens is not None and max_tokens > limits.max_output_tokens:
        raise bad_request(
            f"max tokens {max_tokens} is more than this server allows ({limits.max_output_tokens})",
            "max_tokens",
            "max_tokens_too_large",
        )
    room = info.context_length - num_prompt
    if num_prompt >= info.context_length:
        raise bad_request(
            f"the prompt has {num_prompt} tokens; the model's context is {info.context_length} tokens",
            "prompt",
            "context_length_exceeded",
        )
    if max_tokens > room:
        raise bad_request(
            f"max tokens {max_tokens} plus the prompt's {num_prompt} tokens exceed the model's context of {info.context_length}",
            "max_tokens",
            "context_length_exceeded",
        )
    floor_key = "min_new_tokens" if "min_new_tokens" in src else "min_tokens"  # SGLang's, vLLM's
    floor = _int(src, floor_key, 0, 0, max_tokens)
    if prompt_logprobs is not None:
        _check_scoring(num_prompt, prompt_logprobs, limits)
    stop_ids = src.get("stop_token_ids")
    body = src if body is None else body
    default = info.sampling_defaults  # the model's generation config, where the request is silent
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=floor or 0,
            temperature=_f(
                src, "temperature", default.get("temperature", 1.0), 0.0, 2.0 if "messages" in src else 100.0
            ),
            top_p=_f(src, "top_p", default.get("top_p", 1.0), 0.0, 1.0),
            top_k=_i(src, "top_k", int(default.get("top_k", -1)), -1),
            min_p=_f(src, "min_p", default.get("min_p", 0.0), 0.0, 1.0),
            seed=_int(src, "seed", None, 0, 2**63 - 1),
            stop=_stops(src),
            stop_token_ids=tuple(_token_ids(stop_ids, "stop_token_ids") if stop_ids is not None else ()),
            stop_regex=_stop_regex(src),
            ignore_eos=_bool(src, "ignore_eos", False),
            frequency_penalty=_f(src, "frequency_penalty", 0.0, -2.0, 2.0),
            presence_penalty=_f(src, "presence_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=_f(src, "repetition_penalty", default.get("repetition_penalty", 1.0), 0.0, 10.0),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
            n=n,
            logit_bias=constraints.logit_bias(src, len(info.tokenizer)),
            allowed_token_ids=_allowed(src, info),
            bad_words=_bad_words(src, info),
            cache_salt=_cache_salt(src),
            priority=priority,
            **constraints.constraint(body, src),
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _check_scoring(num_prompt: int, k: int, limits: Limits) -> None:
    """A prompt's log-probabilities travel in one message (each sample's first, where ``n`` > 1)."""
    size = prompt_logprobs_bytes(num_prompt, k)
    if limits.max_message_bytes is not None and size > limits.max_message_bytes:
        raise bad_request(
            f"the log-probabilities of a {num_prompt}-token prompt with {k} alternatives each would take about "
            f"{size} bytes, more than the broker's messages hold ({limits.max_message_bytes}): ask for fewer "
            "alternatives or a shorter prompt",
            "prompt_logprobs",
            "prompt_logprobs_too_large",
        )


def priority(body: dict[str, Any], higher_first: bool = False) -> int:
    """A request's ``priority`` as the engines order it, lower first: vLLM's as it is
    (lower values first, 0 the default); SGLang's (``/generate``, ``higher_first``: higher
    values first, as SGLang schedules by default) negated."""
    value = _int(body, "priority", 0, -MAX_PRIORITY, MAX_PRIORITY)
    assert value is not None
    return -value if higher_first else value


def _cache_salt(src: dict[str, Any]) -> str | None:
    """vLLM's ``cache_salt``: a non-empty string, or none."""
    value = src.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_CACHE_SALT:
        raise bad_request(f"'cache_salt' must be a string of 1 to {MAX_CACHE_SALT} characters", "cache_salt")
    return value


def _bad_words(src: dict[str, Any], info: ModelInfo) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words``: each word's tokens as it stands and, where that tokenizes to
    another first token of the same length, after a space (a word starting the text and one
    inside it); a sequence once."""
    value = src.get("bad_words")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise bad_request("'bad_words' must be a list of strings", "bad_words")
    if len(value) > MAX_BAD_WORDS // 2:  # (each word is at most two sequences)
        raise bad_request(f"'bad_words' may hold at most {MAX_BAD_WORDS // 2} words", "bad_words")
    out: dict[tuple[int, ...], None] = {}
    for word in value:
        bare = word.strip()
        if not bare:
            raise bad_request("'bad_words' strings must not be empty", "bad_words")
        ids = tuple(info.tokenizer.encode(bare, add_special_tokens=False))
        spaced = tuple(info.tokenizer.encode(" " + bare, add_special_tokens=False))
        out[ids] = None
        if spaced and len(spaced) == len(ids) and spaced[0] != ids[0]:
            out[spaced] = None
    if any(len(w) > MAX_BAD_WORD_TOKENS for w in out):
        raise bad_request(f"each of 'bad_words' may be at most {MAX_BAD_WORD_TOKENS} tokens long", "bad_words")
    return tuple(out)


def _allowed(src: dict[str, Any], info: ModelInfo) -> tuple[int, ...]:
    value = src.get("allowed_token_ids")
    if value is None:
        return ()
    ids = _token_ids(value, "allowed_token_ids", len(info.tokenizer))
    if not ids:
        raise bad_request("'allowed_token_ids' must not be empty", "allowed_token_ids")
    return tuple(sorted(set(ids)))


def check_model(body: dict[str, Any], info: ModelInfo) -> None:
    """``model``, if given, must be the one served (a request without it gets that one, as
    vLLM and SGLang take it)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model not in info.names:
        raise bad_request(info.not_found(model), "model", "model_not_found")


def _n(body: dict[str, Any]) -> int:
    n = _int(body, "n", 1, 1, MAX_SAMPLES)
    assert n is not None
    if n > 1 and body.get("best_of") not in (None, n):
        raise bad_request("'best_of' other than n is not supported", "best_of")
    return n


def _user(body: dict[str, Any]) -> None:
    """OpenAI's ``user``: an end-user id for the operator's logs; only its type is checked."""
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("'user' must be a string", "user")


def _default_max(info: ModelInfo, num_prompt: int, default: int) -> int:
    return max(min(default, info.context_length - num_prompt), 1)


def _encode(info: ModelInfo, text: str, param: str, special: bool = True) -> list[int]:
    if info.max_prompt_chars and len(text) > info.max_prompt_chars:  # refused without tokenizing it
        raise bad_request(
            f"'{param}' has {len(text)} characters, far more than the model's context of {info.context_length} tokens",
            param,
            "context_length_exceeded",
        )
    ids = info.tokenizer.encode(text, add_special_tokens=special)
    if not ids:
        raise bad_request(f"'{param}' must not be empty", param)
    return list(ids)


def _prompts(
    value: Any, info: ModelInfo, key: str, max_batch: int = MAX_BATCH, special: bool = True
) -> tuple[list[tuple[list[int], str | None]], bool]:
    """A string, a list of ids, a list of strings or a list of id lists; ``special``: texts
    encoded with the tokenizer's special tokens (a BOS), as vLLM's ``add_special_tokens``."""
    vocab = len(info.tokenizer)
    if isinstance(value, list) and len(value) > max_batch and any(isinstance(v, (str, list)) for v in value[:1]):
        raise bad_request(
            f"'{key}' holds {len(value)} prompts; at most {max_batch} per request", key, "batch_too_large"
        )
    if key == "input_ids" and (
        isinstance(value, str) or (isinstance(value, list) and any(isinstance(v, str) for v in value))
    ):
        raise bad_request("'input_ids' must be a list of token ids (or a list of such lists)", key)
    if isinstance(value, str):
        if not value:
            raise bad_request(f"'{key}' must not be empty", key)
        return [(_encode(info, value, key, special), value)], False
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [(_token_ids(value, key, vocab), None)], False
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        if any(not v for v in value):
            raise bad_request(f"'{key}' must not hold empty strings", key)
        return [(_encode(info, v, key, special), v) for v in value], True
    if isinstance(value, list) and value and all(isinstance(v, list) and v for v in value):
        return [(_token_ids(v, key, vocab), None) for v in value], True
    raise bad_request(f"'{key}' must be a non-empty string, list of strings, or list of token ids", key)


# ---- /v1/completions ----------------------------------------------------------------
def parse_completion(body: dict[str, Any], info: ModelInfo, limits: Limits) -> Parsed:
    check_model(body, info)
    n = _n(body)
    _user(body)
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt")
    unserved(body, VLLM_UNSERVED + COMPLETION_UNSERVED)
    special = _bool(body, "add_special_tokens", True)
    prompts, batch = _prompts(body["prompt"], info, "prompt", limits.max_batch, special)
    prompts = [truncated(body, ids, text) for ids, text in prompts]
    stream = _bool(body, "stream", False)
    if batch and stream:
        raise bad_request("streaming takes a single prompt", "stream")
    logprobs = _int(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    echo = _bool(body, "echo", False)
    shown = _int(body, "prompt_logprobs", None, 0, MAX_TOP_LOGPROBS)  # vLLM's
    echo_logprobs = echo and logprobs is not None
    scoring = max(logprobs or 0, shown or 0) if echo_logprobs or shown is not None else None
    jobs = []
    for ids, text in prompts:
        # 0 (legacy OpenAI, vLLM): the prompt alone, echoed or scored
        max_tokens = _int(
            body, "max_tokens", limits.default_for(COMPLETION_MAX_TOKENS), 0 if echo or shown is not None else 1
        )
        assert max_tokens is not None
        sampling = _sampling(
            body,
            max(max_tokens, 1),
            info,
            limits,
            len(ids),
            logprobs is not None,
            logprobs or 0,
            n,
            None,
            scoring,
            priority(body),
        )
        jobs.append(Job(ids, sampling, text, show_output=max_tokens > 0, keep_stop=_keep_stop(body)))
    return Parsed(
        jobs,
        stream=stream,
        include_usage=_stream_usage(body),
        continuous_usage=_continuous_usage(body),
        echo=echo,
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        batch=batch,
        prompt_logprobs=shown,
        echo_logprobs=echo_logprobs,
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids", False),
        token_ids=_bool(body, "return_token_ids", False),
    )


def _stream_options(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("stream_options")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return options


def _stream_usage(body: dict[str, Any]) -> bool:
    return _bool(_stream_options(body), "include_usage", False)


def _continuous_usage(body: dict[str, Any]) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: the usage so far on every chunk."""
    return _bool(_stream_options(body), "continuous_usage_stats", False)


# ---- /v1/chat/completions -----------------------------------------------------------
_ROLES = {"system", "user", "assistant", "tool", "developer"}


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages, checked, as chat templates take them: text content, an assistant's
    ``tool_calls`` (arguments as objects), a tool result's ``tool_call_id`` and ``name``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(f"messages[{i}].role must be one of {sorted(_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content parts must be text parts", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant":
            calls = tools.message_tool_calls(m, i)
            if calls:
                message["tool_calls"] = calls
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise bad_request(f"messages[{i}].{key} must be a string", "messages")
                    message[key] = m[key]
        out.append(message)
    return out


# apply_chat_template's own parameters and the template's inputs: not for a request to set
_RESERVED_TEMPLATE_KEYS = {
    "messages",
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: more variables for the chat template (Qwen3's
    ``enable_thinking``, for one); and its ``documents`` (retrieved texts for a template that
    takes them, as transformers hands them over)."""
    value = body.get("chat_template_kwargs")
    effort = _reasoning_effort(body) | _documents(body)
    if value is None:
        return effort
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    taken = sorted(_RESERVED_TEMPLATE_KEYS & value.keys())
    if taken:
        raise bad_request(f"'chat_template_kwargs' may not set {', '.join(taken)}", "chat_template_kwargs")
    return effort | value  # (what the request sets explicitly wins)


MAX_DOCUMENTS = 256


def _documents(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``documents``: a list of objects of strings (e.g. ``title``, ``text``), for the
    chat template's ``documents`` (a template that reads none ignores them)."""
    value = body.get("documents")
    if value is None:
        return {}
    if (
        not isinstance(value, list)
        or len(value) > MAX_DOCUMENTS
        or not all(
            isinstance(d, dict) and d and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
            for d in value
        )
    ):
        raise bad_request(
            f"'documents' must be a list of at most {MAX_DOCUMENTS} objects whose values are strings", "documents"
        )
    return {"documents": value}


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _reasoning_effort(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``reasoning_effort``, as vLLM hands it to the chat template: the value as
    ``reasoning_effort``, and ``enable_thinking`` off for ``none``, on otherwise (a template
    that reads neither is not changed by it)."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}


def prompt_mode(body: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[bool, bool]:
    """vLLM's ``add_generation_prompt`` (default: on unless continuing) and
    ``continue_final_message`` (the reply goes on with the last, assistant, message)."""
    carry_on = _bool(body, "continue_final_message", False)
    generation = _bool(body, "add_generation_prompt", not carry_on)
    if carry_on and generation:
        raise bad_request(
            "give at most one of add_generation_prompt and continue_final_message", "continue_final_message"
        )
    if carry_on and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs an assistant message last", "continue_final_message")
    return generation, carry_on


def render_chat(
    info: ModelInfo,
    messages: list[dict[str, Any]],
    request: tools.ToolRequest | None,
    generation: bool = True,
    kwargs: dict[str, Any] | None = None,
    carry_on: bool = False,
) -> str:
    """The prompt: the chat template over the messages, given the tools where it takes them
    (else pdserve's system message names them) and ``kwargs``, open at the end for the reply
    (``generation``) or for more of the last message (``carry_on``); a template's own refusal
    is a 400."""
    from jinja2 import TemplateError

    extra: dict[str, Any] = dict(kwargs or {})
    if carry_on:
        extra["continue_final_message"] = True
    if info.tool_format.native:
        if request is not None and request.shown:
            extra["tools"] = list(request.tools)
    elif info.tool_format.name is not None:  # pdserve's system message and hermes calls
        messages = tools.plain_messages(messages, request)
    try:
        text = info.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False, **extra)
    except TemplateError as exc:
        raise bad_request(f"the model's chat template refused these messages: {exc}", "messages") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:  # a value the template cannot use
        param = "chat_template_kwargs" if kwargs else "messages"
        raise bad_request(f"the model's chat template failed on this request: {exc!r}", param) from None
    assert isinstance(text, str)
    return text


def parse_chat(body: dict[str, Any], info: ModelInfo, limits: Limits) -> Parsed:
    check_model(body, info)
    n = _n(body)
    _user(body)
    tool_request = tools.parse_tools(body, info.tool_format)
    messages = chat_messages(body)
    if not info.has_chat_template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    generation, carry_on = prompt_mode(body, messages)
    text = render_chat(info, messages, tool_request, generation, template_kwargs(body), carry_on)
    echo_text = None
    if _bool(body, "echo", False):  # the reply's role: the assistant's, or the last message's when continued
        last = messages[-1]
        role = "assistant" if generation else last["role"]
        echo_text = (last.get("content") or "") if last["role"] == role else ""
    unserved(body, VLLM_UNSERVED + CHAT_UNSERVED)
    ids, _ = truncated(body, _encode(info, text, "messages", special=_bool(body, "add_special_tokens", False)), text)
    ceiling = limits.max_output_tokens or info.context_length - 1  # both are checked, the first given is used
    max_tokens = _int(body, "max_completion_tokens", None, 1, ceiling)
    legacy_max = _int(body, "max_tokens", None, 1, ceiling)
    if max_tokens is None:
        max_tokens = legacy_max
    if max_tokens is None:
        max_tokens = _default_max(info, len(ids), limits.default_for(limits.default_max_tokens))
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, 0, 20) or 0
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    shown = _int(body, "prompt_logprobs", None, 0, MAX_TOP_LOGPROBS)  # vLLM's
    sampling = _sampling(body, max_tokens, info, limits, len(ids), logprobs, top, n, None, shown, priority(body))
    if tool_request is not None and tool_request.forced:
        if sampling.constraint is not None:
            raise bad_request(
                "tool_choice 'required' or a named function constrains the output itself: drop response_format",
                "tool_choice",
            )
        schema = tool_request.schema()
        constraints.check("json_schema", schema)
        if sampling.min_new_tokens:
            raise bad_request("min_tokens does not go with a forced tool choice (structured output)", "min_tokens")
        sampling = dataclasses.replace(sampling, json_schema=schema)
    return Parsed(
        [Job(ids, sampling, text, keep_stop=_keep_stop(body))],
        stream=_bool(body, "stream", False),
        include_usage=_stream_usage(body),
        continuous_usage=_continuous_usage(body),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        tools=tool_request if tool_request is not None and tool_request.shown else None,
        # a reply held to a JSON Schema is all answer (the grammar leaves no room to think)
        thinking=None if not info.reasoning.on or sampling.json_schema else reasoning.opens_thinking(text),
        prompt_logprobs=shown,
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids", False),
        token_ids=_bool(body, "return_token_ids", False),
        echo_text=echo_text,
    )


# ---- /generate (SGLang) ---------------------------------------------------------------
_SGLANG_SAMPLING = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
    "n",
    "skip_special_tokens",
    "no_stop_trim",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "logit_bias",
)


def parse_generate(body: dict[str, Any], info: ModelInfo, limits: Limits) -> Parsed:
    """SGLang's ``/generate``: ``text`` or ``input_ids``, ``sampling_params``; the
    sampling keys may also sit at the top level, as SGLang accepts them."""
    check_model(body, info)
    params = body.get("sampling_params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise bad_request("'sampling_params' must be an object", "sampling_params")
    top = {k: body[k] for k in _SGLANG_SAMPLING if k in body}
    merged = {**top, **params}
    unserved(body, SGLANG_UNSERVED)
    if "sampling_seed" in merged and merged.get("seed") is None:  # SGLang's name for the seed
        merged["seed"] = merged["sampling_seed"]
    rank = priority(body, higher_first=True)  # SGLang's request field: higher values first
    if ("text" in body) == ("input_ids" in body):
        raise bad_request("give exactly one of 'text' and 'input_ids'", "text")
    key = "text" if "text" in body else "input_ids"
    prompts, batch = _prompts(body[key], info, key, limits.max_batch)
    stream = _bool(body, "stream", False)
    if batch and stream:
        raise bad_request("streaming takes a single prompt", "stream")
    want_logprobs = _bool(body, "return_logprob", False)
    top_num = _int(body, "top_logprobs_num", 0, 0, 20) or 0
    start = _int(body, "logprob_start_len", -1, -1)  # SGLang's: the prompt's log-probabilities from there
    assert start is not None
    if start >= 0 and not want_logprobs:
        raise bad_request("'logprob_start_len' needs 'return_logprob': true", "logprob_start_len")
    if merged.get("prompt_logprobs") is not None:
        raise bad_request("on /generate, ask with 'return_logprob' and 'logprob_start_len'", "prompt_logprobs")

    def job(src: dict[str, Any], ids: list[int], text: str | None) -> Job:
        max_new = _int(src, "max_new_tokens", None, 0 if start >= 0 else 1)  # 0: the prompt scored alone
        if max_new is None:
            max_new = _default_max(info, len(ids), limits.default_for(min(limits.default_max_tokens, 128)))
        if start >= len(ids):
            raise bad_request(
                f"'logprob_start_len' {start} is past the prompt's {len(ids)} tokens", "logprob_start_len"
            )
        scoring = top_num if start >= 0 else None
        sampling = _sampling(
            src, max(max_new, 1), info, limits, len(ids), want_logprobs, top_num, _n(src), body, scoring, rank
        )
        return Job(ids, sampling, text, show_output=max_new > 0, keep_stop=_keep_stop(src))

    if top.keys() & params.keys():  # a top-level value that sampling_params overrides is still checked
        job({**merged, **top}, *prompts[0])
    jobs = [job(merged, ids, text) for ids, text in prompts]
    rid = body.get("rid")
    if batch and rid is not None:
        if not (isinstance(rid, list) and len(rid) == len(jobs) and all(isinstance(r, str) and r for r in rid)):
            raise bad_request("for a batch, 'rid' must be a list of request ids, one per prompt", "rid")
        if len(set(rid)) != len(rid):
            raise bad_request("the request ids of a batch must differ", "rid")
    elif rid is not None and not (isinstance(rid, str) and rid):
        raise bad_request("'rid' must be a non-empty string", "rid")
    return Parsed(
        jobs,
        stream=stream,
        skip_special_tokens=_bool(merged, "skip_special_tokens", True),
        rid=rid,
        batch=batch,
        input_logprobs_from=start,
        text_in_logprobs=_bool(body, "return_text_in_logprobs", False),
    )
