"""The API surface clients call, through the whole system (`pdserve up` on a real
nats-server and the real tiny model), in both modes, with the official `openai` client:
``n`` samples, penalties and ``logit_bias``, ``top_logprobs`` in streams, ``user``,
structured output (``response_format``, SGLang's ``regex``/``ebnf``), the tokenizer
endpoints, ``/version``, ``/get_server_info`` and ``/flush_cache``."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList
from transformers.generation.logits_process import SequenceBiasLogitsProcessor

from tests.engine.test_samples import OpenAIPenalties

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPT_IDS = [(17 * i + 5) % 4000 + 3 for i in range(40)]
ALIAS = "org/alias-model"  # --served-model-alias: a name with a '/', as a hub id has


@pytest.fixture(scope="module", params=["pd", "unified"])
def system(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    nats_for_module: Any,
    system_control: Any,
) -> Iterator[Any]:
    start, stop = system_control
    mode = request.param
    s = start(
        tmp_path_factory.mktemp(mode),
        tiny_model_dir,
        nats_for_module.url,
        *("--mode", mode, "--enable-flush-cache", "--served-model-alias", ALIAS),
    )
    s.mode = mode
    yield s
    stop(s)


@pytest.fixture
def client(system: Any) -> Any:
    return openai.AsyncOpenAI(base_url=system.url + "/v1", api_key="none", max_retries=0, timeout=120)


def hf(model_dir: Path, prompt: list[int], steps: int, processors: list[Any] = ()) -> list[int]:  # type: ignore[assignment]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            logits_processor=LogitsProcessorList(list(processors)),
        )
    return out[0, len(prompt) :].tolist()


async def generate(system: Any, body: dict[str, Any]) -> Any:
    async with httpx.AsyncClient(base_url=system.url, timeout=120) as http:
        r = await http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- the model's names ---------------------------------------------------------------------
async def test_the_openai_client_lists_retrieves_and_calls_the_model_by_its_names(system: Any, client: Any) -> None:
    """``/v1/models`` lists the served name then the alias; ``models.retrieve`` finds either
    (404 ``model_not_found`` for another); a request naming the alias gets the served model,
    named as served (as vLLM answers its further names)."""
    assert [m.id for m in (await client.models.list()).data] == [system.model_name, ALIAS]
    for name in (system.model_name, ALIAS):
        assert (await client.models.retrieve(name)).id == name
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
    by_name, by_alias = [
        await client.completions.create(model=m, prompt=PROMPT_IDS, max_tokens=6, temperature=0)
        for m in (system.model_name, ALIAS)
    ]
    assert by_alias.choices[0].text == by_name.choices[0].text and by_alias.model == system.model_name


# ---- n -------------------------------------------------------------------------------
async def test_n_greedy_samples_are_identical_and_equal_transformers(system: Any, client: Any) -> None:
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 4}
    outs = await generate(system, {"input_ids": PROMPT_IDS, "sampling_params": params})
    assert len(outs) == 4
    expected = hf(system.model_dir, PROMPT_IDS, 12)
    assert [o["output_ids"] for o in outs] == [expected] * 4
    completion = await client.completions.create(
        model=system.model_name, prompt=PROMPT_IDS, max_tokens=12, temperature=0, n=4, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert len({c.text for c in completion.choices}) == 1
    assert completion.usage.prompt_tokens == len(PROMPT_IDS)  # the prompt once
    assert completion.usage.completion_tokens == 4 * 12


async def test_n_seeded_samples_differ_and_chat_streams_every_choice(system: Any, client: Any) -> None:
    completion = await client.completions.create(
        model=system.model_name,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=3.0,
        seed=11,
        n=4,
        extra_body={"ignore_eos": True},
    )
    assert len({c.text for c in completion.choices}) == 4
    again = await client.completions.create(
        model=system.model_name,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=3.0,
        seed=11,
        n=4,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in completion.choices]  # seeded: reproducible

    stream = await client.chat.completions.create(
        model=system.model_name,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=1.0,
        n=3,
        logprobs=True,
        top_logprobs=3,
        user="user-42",
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text: dict[int, str] = {}
    tops: dict[int, int] = {}
    finished: set[int] = set()
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
            for entry in (choice.logprobs.content if choice.logprobs else None) or []:
                assert len(entry.top_logprobs) == 3
                tops[choice.index] = tops.get(choice.index, 0) + 1
            if choice.finish_reason is not None:
                assert choice.finish_reason == "length"
                finished.add(choice.index)
    assert finished == {0, 1, 2} and tops == {0: 8, 1: 8, 2: 8}
    assert usage is not None and usage.completion_tokens == 3 * 8


# ---- penalties and bias ----------------------------------------------------------------
async def test_penalties_and_logit_bias_equal_transformers_logits_processors(system: Any, client: Any) -> None:
    plain = hf(system.model_dir, PROMPT_IDS, 10)
    bias = {str(plain[0]): -100, "1234": 3}
    params = {
        "max_new_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "frequency_penalty": 1.2,
        "presence_penalty": 0.4,
        "logit_bias": bias,
    }
    out = await generate(system, {"input_ids": PROMPT_IDS, "sampling_params": params})
    processors = [
        OpenAIPenalties(len(PROMPT_IDS), 1.2, 0.4),
        SequenceBiasLogitsProcessor([[[plain[0]], -100.0], [[1234], 3.0]]),
    ]
    assert out["output_ids"] == hf(system.model_dir, PROMPT_IDS, 10, processors)
    assert out["output_ids"] != plain
    openai_body: dict[str, Any] = {  # the OpenAI spelling of the same request, streamed and not
        "model": system.model_name,
        "prompt": PROMPT_IDS,
        "max_tokens": 10,
        "temperature": 0,
        "frequency_penalty": 1.2,
        "presence_penalty": 0.4,
        "logit_bias": bias,
        "extra_body": {"ignore_eos": True},
    }
    completion = await client.completions.create(**openai_body)
    assert completion.choices[0].text == out["text"]
    stream = await client.completions.create(**openai_body, stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == out["text"]


async def test_min_tokens_holds_off_stop_tokens_and_strings(system: Any, client: Any) -> None:
    """vLLM's min_tokens and SGLang's min_new_tokens: the stop token the greedy output takes
    first is held off for 5 tokens, as ``generate``'s ``min_new_tokens`` holds off an end token;
    a stop string counts only in the text after the first min_tokens tokens, streamed or not."""
    plain = hf(system.model_dir, PROMPT_IDS, 12)
    stop = plain[0]
    out = await generate(
        system,
        {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 12, "min_new_tokens": 5, "temperature": 0,
                                                      "stop_token_ids": [stop], "ignore_eos": True}},
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(system.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        held = model.generate(
            torch.tensor([PROMPT_IDS]), max_new_tokens=12, min_new_tokens=5, do_sample=False, eos_token_id=[stop]
        )[0, len(PROMPT_IDS) :].tolist()
    assert out["output_ids"] == held and len(held) > 5 and stop not in held[:5]
    quick = await generate(
        system, {"input_ids": PROMPT_IDS, "max_new_tokens": 12, "stop_token_ids": [stop], "temperature": 0}
    )
    assert quick["output_ids"] == [stop]  # without the floor
    tokenizer = AutoTokenizer.from_pretrained(system.model_dir)
    word = tokenizer.decode(plain[:1])
    body: dict[str, Any] = {"model": system.model_name, "prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0,
                            "stop": [word], "extra_body": {"ignore_eos": True, "min_tokens": 3}}  # fmt: skip
    whole = await client.completions.create(**body)
    text = tokenizer.decode(plain[:3])
    assert whole.choices[0].text.startswith(text) and len(whole.choices[0].text) >= len(text)
    assert word not in whole.choices[0].text[len(text) :]  # cut at its first occurrence after the floor
    stream = await client.completions.create(**body, stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == whole.choices[0].text
    none = await client.completions.create(**{**body, "extra_body": {"ignore_eos": True}})
    assert none.choices[0].text == ""  # the first token's text is the stop string


async def test_vllm_extensions_through_the_system(system: Any, client: Any) -> None:
    """guided_choice answers one of the choices; allowed_token_ids is ``generate`` with every
    other token's logit masked; include_stop_str_in_output keeps the stop string;
    truncate_prompt_tokens computes the prompt's last tokens only."""
    choices = ["red", "green (dark)", "blue."]
    for _ in range(3):
        reply = await client.chat.completions.create(
            model=system.model_name,
            messages=[{"role": "user", "content": "A colour?"}],
            temperature=1.0,
            extra_body={"guided_choice": choices},
        )
        assert reply.choices[0].message.content in choices
    allowed = [17, 400, 1234, 3000]
    out = await client.completions.create(
        model=system.model_name, prompt=PROMPT_IDS, max_tokens=8, temperature=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )  # fmt: skip
    mask = torch.full((1, 5000), float("-inf"))
    mask[0, allowed] = 0.0

    class Only:
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return scores + mask[:, : scores.shape[1]]

    tokenizer = AutoTokenizer.from_pretrained(system.model_dir)
    assert out.choices[0].text == tokenizer.decode(hf(system.model_dir, PROMPT_IDS, 8, [Only()]))
    plain = hf(system.model_dir, PROMPT_IDS, 6)
    word = tokenizer.decode(plain[2:3])
    body = {"model": system.model_name, "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "stop": [word]}
    trimmed = await client.completions.create(**body)
    kept = await client.completions.create(**body, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == trimmed.choices[0].text + word and kept.choices[0].finish_reason == "stop"
    cut = await client.completions.create(
        model=system.model_name, prompt=PROMPT_IDS, max_tokens=4, temperature=0,
        extra_body={"truncate_prompt_tokens": 10, "ignore_eos": True},
    )  # fmt: skip
    assert cut.usage.prompt_tokens == 10
    assert cut.choices[0].text == tokenizer.decode(hf(system.model_dir, PROMPT_IDS[-10:], 4))
    named = await client.completions.create(
        model=system.model_name, prompt=PROMPT_IDS, max_tokens=4, temperature=0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    ids = PROMPT_IDS + hf(system.model_dir, PROMPT_IDS, 4)
    assert named.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in named.choices[0].logprobs.top_logprobs[1:] for k in top)


async def test_bad_words_through_the_system(system: Any, client: Any) -> None:
    """vLLM's ``bad_words``: the output is ``generate``'s with ``NoBadWordsLogitsProcessor`` over
    the word's token sequences (as the API tokenizes it), and never holds them."""
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    from pdserve.api.model_info import load_model_info
    from pdserve.api.protocol import Limits, parse_completion

    tokenizer = AutoTokenizer.from_pretrained(system.model_dir)
    plain = hf(system.model_dir, PROMPT_IDS, 6)
    word = tokenizer.decode(plain[:1])
    body = {"prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "bad_words": [word], "ignore_eos": True}
    words = parse_completion(body, load_model_info(system.model_dir), Limits(64)).jobs[0].sampling.bad_words
    assert words
    out = await client.completions.create(
        model=system.model_name, prompt=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=0,
        extra_body={"bad_words": [word], "ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    ids = [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]
    assert ids == hf(system.model_dir, PROMPT_IDS, 6, [NoBadWordsLogitsProcessor([list(w) for w in words])])
    assert ids != plain and all(ids[i : i + len(w)] != list(w) for w in words for i in range(len(ids)))


async def test_return_token_ids_gives_the_prompt_s_and_each_choice_s_ids(system: Any, client: Any) -> None:
    """vLLM's ``return_token_ids``: on completions each choice's ``token_ids`` (its output) and
    ``prompt_token_ids``; on chat the response's ``prompt_token_ids`` (the templated prompt)
    and each choice's ``token_ids``; streamed, the ids of each piece, the prompt's once (a
    completion choice's first piece, a chat stream's first chunk)."""
    want = hf(system.model_dir, PROMPT_IDS, 5)
    body = {
        "prompt": PROMPT_IDS,
        "max_tokens": 5,
        "temperature": 0,
        "n": 2,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    r = await generate_raw_path(system, "/v1/completions", body)
    assert [(c["token_ids"], c["prompt_token_ids"]) for c in r["choices"]] == [(want, PROMPT_IDS)] * 2
    chunks = await stream_path(system, "/v1/completions", {**body, "stream": True})
    for index in (0, 1):
        pieces = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert [t for p in pieces for t in p["token_ids"]] == want
        assert [p.get("prompt_token_ids") for p in pieces if "prompt_token_ids" in p] == [PROMPT_IDS]
        assert "prompt_token_ids" in pieces[0]
    tokenizer = AutoTokenizer.from_pretrained(system.model_dir)
    messages = [{"role": "user", "content": "Name three colours."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    chat = {"messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    whole = await generate_raw_path(system, "/v1/chat/completions", chat)
    assert whole["prompt_token_ids"] == prompt
    assert whole["choices"][0]["token_ids"] == hf(system.model_dir, prompt, 4)
    chunks = await stream_path(system, "/v1/chat/completions", {**chat, "stream": True})
    assert [c.get("prompt_token_ids") for c in chunks if "prompt_token_ids" in c] == [prompt]
    assert "prompt_token_ids" in chunks[0]
    assert [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    plain = await generate_raw_path(system, "/v1/completions", {**body, "return_token_ids": False})
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])


async def test_cache_salt_keeps_a_prompt_s_cached_prefix_to_its_own_salt(system: Any, client: Any) -> None:
    """vLLM's ``cache_salt``: a prompt computed under one salt is found cached by a request
    with the same salt and not by one with another salt or none; the answers are the same."""
    prompt = [(37 * i + 11) % 4000 + 3 for i in range(96)]

    async def ask(salt: str | None) -> Any:
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt else {})
        return await client.completions.create(
            model=system.model_name, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )

    def cached(reply: Any) -> int:
        details = reply.usage.prompt_tokens_details
        return details.cached_tokens if details else 0

    first = await ask("tenant-a")
    assert cached(first) == 0
    other, plain, again = await ask("tenant-b"), await ask(None), await ask("tenant-a")
    assert cached(other) == 0 and cached(plain) == 0 and cached(again) > 0
    assert {r.choices[0].text for r in (first, other, plain, again)} == {first.choices[0].text}


async def test_a_request_s_priority_takes_its_lane_and_answers_as_any(system: Any, client: Any) -> None:
    """vLLM's ``priority`` on completions and chat, SGLang's on /generate: a request of a
    higher priority than the default travels the urgent queue to the workers; every answer
    is the one without it, and transformers'."""
    prompt = PROMPT_IDS
    want = hf(system.model_dir, prompt, 6)
    texts = set()
    for priority in (-3, 0, 4):
        reply = await client.completions.create(
            model=system.model_name,
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            extra_body={"priority": priority, "ignore_eos": True, "return_token_ids": True},
        )
        assert reply.choices[0].token_ids == want
        texts.add(reply.choices[0].text)
    async with httpx.AsyncClient(timeout=60) as http:
        body = {"input_ids": prompt, "priority": 9, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        body["sampling_params"]["ignore_eos"] = True
        generated = (await http.post(system.url + "/generate", json=body)).json()
        assert generated["output_ids"] == want
        bad = await http.post(system.url + "/v1/completions", json={"prompt": "x", "priority": "urgent"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    assert len(texts) == 1


async def test_continuous_usage_stats_count_every_chunk(system: Any) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so far
    (the prompt, and every sample's tokens sent up to it), the last chunk's equal to the final
    usage chunk's; on completions and chat."""
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT_IDS, "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        options = {"include_usage": True, "continuous_usage_stats": True}
        full = {
            **body,
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": options,
        }
        chunks = await stream_path(system, path, full)
        pieces, end = [c for c in chunks if c["choices"]], chunks[-1]
        assert not end["choices"] and all("usage" in c for c in pieces)
        done = [c["usage"]["completion_tokens"] for c in pieces]
        assert done == sorted(done) and done[-1] == end["usage"]["completion_tokens"] == 5 * body.get("n", 1)
        assert {c["usage"]["prompt_tokens"] for c in pieces} == {end["usage"]["prompt_tokens"]}
    plain = await stream_path(system, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 2, "stream": True})
    assert all("usage" not in c for c in plain)


async def generate_raw_path(system: Any, path: str, body: dict[str, Any]) -> Any:
    async with httpx.AsyncClient(base_url=system.url, timeout=120) as http:
        r = await http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def stream_path(system: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=system.url, timeout=120) as http:
        async with http.stream("POST", path, json=body) as stream:
            lines = [line async for line in stream.aiter_lines() if line.startswith("data: {")]
    return [json.loads(line[6:]) for line in lines]


async def test_chat_echo_leads_each_choice_with_the_message_it_continues(system: Any) -> None:
    """vLLM's ``echo`` with ``continue_final_message``: each choice's content is the last
    (assistant) message's text and then the continuation, whole and streamed; without it the
    continuation alone."""
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    body = {"model": system.model_name, "messages": messages, "continue_final_message": True, "max_tokens": 5}
    body |= {"temperature": 0, "n": 2}
    plain = await generate_raw_path(system, "/v1/chat/completions", body)
    echoed = await generate_raw_path(system, "/v1/chat/completions", {**body, "echo": True})
    for a, b in zip(plain["choices"], echoed["choices"], strict=True):
        assert b["message"]["content"] == "One, two," + a["message"]["content"]
    events = await stream_path(system, "/v1/chat/completions", {**body, "echo": True, "stream": True})
    for k in range(2):
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"][0]["index"] == k)
        assert text == echoed["choices"][k]["message"]["content"]


# ---- structured output -------------------------------------------------------------------
async def test_json_schema_output_always_validates_100_samples_at_temperature_1(system: Any, client: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    async def ask(i: int) -> list[str]:
        reply = await client.chat.completions.create(
            model=system.model_name,
            messages=[{"role": "user", "content": f"Person number {i}, as JSON."}],
            temperature=1.0,
            max_tokens=300,
            n=4,
            response_format=fmt,
        )
        assert {c.finish_reason for c in reply.choices} == {"stop"}
        return [c.message.content for c in reply.choices]

    texts = [t for batch in await asyncio.gather(*(ask(i) for i in range(25))) for t in batch]
    assert len(texts) == 100
    await asyncio.sleep(1.2)  # two heartbeats: the workers' counters reach the registry
    async with httpx.AsyncClient(timeout=10) as http:
        metrics = (await http.get(system.url + "/metrics")).text
    refusals = [line for line in metrics.splitlines() if line.startswith("pdserve_grammar_refusals_total{")]
    assert refusals and all(line.endswith(" 0.0") for line in refusals), refusals  # every token its mask allowed
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    stream = await client.completions.create(
        model=system.model_name,
        prompt="JSON:",
        max_tokens=300,
        temperature=1.0,
        stream=True,
        extra_body={"response_format": fmt},
    )
    streamed = "".join([c.choices[0].text async for c in stream if c.choices])
    jsonschema.validate(json.loads(streamed), SCHEMA)
    # any object: the random model may not close it within max_tokens, but it is one from the start
    anything = await client.completions.create(
        model=system.model_name, prompt="JSON:", max_tokens=5, extra_body={"response_format": {"type": "json_object"}}
    )
    assert anything.choices[0].text.startswith("{")


async def test_sglang_regex_and_ebnf_constraints(system: Any) -> None:
    regex = r"(red|green|blue)-[0-9]{3}"
    outs = await generate(
        system, {"text": "Pick:", "sampling_params": {"max_new_tokens": 30, "temperature": 1.0, "regex": regex, "n": 3}}
    )
    assert all(re.fullmatch(regex, o["text"]) for o in outs)
    ebnf = 'root ::= "(" ("ab" | "cd" | "ef") ")"'
    out = await generate(
        system, {"text": "Go:", "sampling_params": {"max_new_tokens": 30, "temperature": 1.0, "ebnf": ebnf}}
    )
    assert re.fullmatch(r"\((ab|cd|ef)\)", out["text"])
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


# ---- tokenizer and info endpoints ----------------------------------------------------------
async def test_tokenize_and_detokenize_round_trip_equal_the_tokenizer(system: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(system.model_dir)
    text = "Hello, wörld! 你好 🙂 tokens"
    async with httpx.AsyncClient(base_url=system.url, timeout=30) as http:
        tok = (await http.post("/tokenize", json={"model": system.model_name, "prompt": text})).json()
        assert tok["tokens"] == tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
        assert tok["max_model_len"] > 0
        back = (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()
        assert back["prompt"] == tokenizer.decode(tok["tokens"]) == text
        messages = [{"role": "user", "content": "hi"}]
        chat = (await http.post("/tokenize", json={"messages": messages, "return_token_strs": True})).json()
        templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat["tokens"] == tokenizer.encode(templated, add_special_tokens=False)
        assert len(chat["token_strs"]) == chat["count"]
        version = (await http.get("/version")).json()
        assert version["version"]
        info = (await http.get("/get_server_info")).json()
        assert info["served_model_name"] == system.model_name and info["enable_flush_cache"] is True
        assert info["disaggregation_mode"] == system.mode
        model = (await http.get("/get_model_info")).json()
        assert model["served_model_name"] == system.model_name
        for body in ({"prompt": 5}, {}, {"tokens": [-1]}, {"tokens": "x"}):
            path = "/detokenize" if "tokens" in body else "/tokenize"
            r = await http.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_flush_cache_empties_every_workers_prefix_cache(system: Any) -> None:
    prompt = [(7 * i + 11) % 4000 + 3 for i in range(200)]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    await generate(system, body)
    cached = (await generate(system, body))["meta_info"]["cached_tokens"]
    assert cached >= 128
    async with httpx.AsyncClient(base_url=system.url, timeout=30) as http:
        r = await http.post("/flush_cache")
    assert r.status_code == 200, r.text
    flushed = r.json()
    assert flushed["flushed"] and len(flushed["workers"]) == (2 if system.mode == "pd" else 1)
    assert sum(w["pages_freed"] for w in flushed["workers"]) > 0
    assert (await generate(system, body))["meta_info"]["cached_tokens"] == 0


async def test_health_generate_answers_with_one_token_through_the_pipeline(system: Any) -> None:
    async with httpx.AsyncClient(base_url=system.url, timeout=30) as http:
        before = (await http.get("/health")).json()["requests"]["requests"]
        r = await http.get("/health_generate")
        after = (await http.get("/health")).json()["requests"]["requests"]
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok" and 0 < r.json()["seconds"] < 20
    assert after == before + 1  # a request of its own went through the gateway


async def test_abort_request_ends_a_stream_and_its_samples_with_abort(system: Any) -> None:
    """SGLang's /abort_request: a request streaming (one of n samples, and a single one)
    ends at once with finish reason ``abort``, its workers' pages given back; a bad body is a
    400; an unknown id ends nothing."""
    long = {"sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}, "stream": True}
    async with httpx.AsyncClient(base_url=system.url, timeout=60) as http:

        async def stream_until_aborted(body: dict[str, Any], rid: str) -> list[dict[str, Any]]:
            events: list[dict[str, Any]] = []
            async with http.stream("POST", "/generate", json={**body, "rid": rid}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        aborted = (await http.post("/abort_request", json={"rid": rid})).json()["aborted"]
                        assert aborted == [rid] or sorted(aborted) == [f"{rid}#0", f"{rid}#1"], aborted
            return events

        tag = uuid.uuid4().hex[:8]  # (request ids are kept by the broker's dedup window)
        one = await stream_until_aborted({"text": "tell me", **long}, f"to-abort-{tag}")
        assert one[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(one[-1]["output_ids"]) < 3000
        two = await stream_until_aborted(
            {"text": "tell me", **long, "sampling_params": {**long["sampling_params"], "n": 2}}, f"to-abort-n-{tag}"
        )
        assert {e["index"] for e in two if e["meta_info"]["finish_reason"]} == {0, 1}
        assert all(e["meta_info"]["finish_reason"]["type"] == "abort" for e in two if e["meta_info"]["finish_reason"])
        assert (await http.post("/abort_request", json={"rid": "nobody"})).json() == {"aborted": []}
        for bad, param in (
            ({}, "rid"),
            ({"rid": ""}, "rid"),
            ({"rid": 5}, "rid"),
            ({"rid": "x", "abort_all": True}, "rid"),
            ({"abort_all": False}, "abort_all"),
            ({"rid": "x", "abort_all": False}, "abort_all"),
        ):
            r = await http.post("/abort_request", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, bad
        deadline = asyncio.get_running_loop().time() + 20
        while True:  # the workers cancelled it: every page back
            listing = (await http.get("/workers")).json()
            if all(w["pages_used"] == 0 and w["requests_in_flight"] == 0 for w in listing):
                break
            assert asyncio.get_running_loop().time() < deadline, listing
            await asyncio.sleep(0.2)


BAD = [
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"user": 5}, "user"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, None),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
async def test_bad_parameters_are_openai_style_400s(
    system: Any, client: Any, extra: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=system.model_name, prompt="hi", max_tokens=4, extra_body=extra)
    body = caught.value.body
    error = body.get("error", body) if isinstance(body, dict) else {}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    r = await generate_raw(system, {"text": "hi", "sampling_params": {"regex": "(unclosed"}})
    assert r.status_code == 400


async def generate_raw(system: Any, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=system.url, timeout=30) as http:
        return await http.post("/generate", json=body)
