"""A prompt's own log-probabilities through the whole system (`pdserve up`, both modes, the
tiny model in float32) against ``transformers``' log-softmax of the same prompt: what
lm-evaluation-harness's loglikelihood tasks send (``echo`` with ``logprobs`` and
``max_tokens`` 1 or 0 on /v1/completions, prompts as token ids), vLLM's ``prompt_logprobs``
on completions and chat (streamed too), SGLang's ``logprob_start_len`` on /generate; a prompt
already in the prefix cache is computed again; and the requests that cannot be served."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

PROMPT_IDS = [(31 * i + 7) % 4000 + 3 for i in range(150)]
TOLERANCE = 2e-4  # float32 through different kernels and batch shapes


@pytest.fixture(scope="module", params=["pd", "unified"])
def system(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    nats_for_module: Any,
    system_control: Any,
) -> Iterator[Any]:
    start, stop = system_control
    # chunks of 64 tokens: a prompt is scored over several prefill steps
    s = start(
        tmp_path_factory.mktemp(request.param), tiny_model_dir, nats_for_module.url, "--mode", request.param,
        "--chunked-prefill-size", "64",
    )  # fmt: skip
    yield s
    stop(s)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.Tensor:
    """log-softmax of every position of PROMPT_IDS (row p: the distribution of token p + 1)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([PROMPT_IDS])).logits[0].float(), dim=-1)


@pytest.fixture
def client(system: Any) -> Any:
    return openai.AsyncOpenAI(base_url=system.url + "/v1", api_key="none", max_retries=0, timeout=120)


def expected(reference: torch.Tensor) -> list[float]:
    return reference[torch.arange(len(PROMPT_IDS) - 1), torch.tensor(PROMPT_IDS[1:])].tolist()


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst < TOLERANCE, worst


async def post(system: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=system.url, timeout=120) as http:
        return await http.post(path, json=body)


async def test_lm_eval_loglikelihood_request(system: Any, client: Any, reference: torch.Tensor) -> None:
    """lm-evaluation-harness's local-completions loglikelihood request: ids in, echo, logprobs
    1, max_tokens 1; it reads token_logprobs and top_logprobs of the continuation. The prompt
    went through once before (its KV is in the prefix cache): it is computed again."""
    warm = await client.completions.create(model=system.model_name, prompt=PROMPT_IDS, max_tokens=1, temperature=0)
    assert warm.usage.prompt_tokens == len(PROMPT_IDS)
    again = await client.completions.create(model=system.model_name, prompt=PROMPT_IDS, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the cache holds it
    out = await client.completions.create(
        model=system.model_name, prompt=PROMPT_IDS, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(PROMPT_IDS) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert_close(lp.token_logprobs[1 : len(PROMPT_IDS)], expected(reference))
    tokenizer = AutoTokenizer.from_pretrained(system.model_dir)
    for p in range(1, len(PROMPT_IDS)):  # the most likely token among each position's alternatives
        best = tokenizer.decode([int(reference[p - 1].argmax())])
        assert best in lp.top_logprobs[p]
    assert lp.tokens[: len(PROMPT_IDS)] == [tokenizer.decode([t]) for t in PROMPT_IDS]
    assert choice.text.startswith(tokenizer.decode(PROMPT_IDS))
    assert lp.text_offset == sorted(lp.text_offset)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # scored in full
    assert out.usage.completion_tokens == 1
    # the output token's own log-probability, as without echo
    assert lp.token_logprobs[-1] == pytest.approx(float(reference[-1, again_token(again, tokenizer)]), abs=TOLERANCE)


def again_token(completion: Any, tokenizer: Any) -> int:
    ids = tokenizer.encode(completion.choices[0].text, add_special_tokens=False)
    assert len(ids) == 1
    return int(ids[0])


async def test_max_tokens_zero_scores_the_prompt_alone(system: Any, client: Any, reference: torch.Tensor) -> None:
    out = await client.completions.create(
        model=system.model_name, prompt=PROMPT_IDS, max_tokens=0, logprobs=2, echo=True
    )
    choice = out.choices[0]
    assert len(choice.logprobs.tokens) == len(PROMPT_IDS)
    assert_close(choice.logprobs.token_logprobs[1:], expected(reference))
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs[1:])
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0
    streamed = await client.completions.create(
        model=system.model_name, prompt=PROMPT_IDS, max_tokens=0, logprobs=2, echo=True, stream=True
    )
    pieces = [c async for c in streamed]
    tokens = [t for c in pieces for ch in c.choices if ch.logprobs for t in ch.logprobs.token_logprobs]
    assert tokens[0] is None
    assert_close(tokens[1:], expected(reference))
    bad = await post(system, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 0})  # nothing to show
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


async def test_vllm_prompt_logprobs_on_completions_and_chat(system: Any, reference: torch.Tensor) -> None:
    r = await post(system, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 3, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT_IDS)
    want = expected(reference)
    for p, entry in enumerate(entries[1:], start=1):
        own = entry[str(PROMPT_IDS[p])]
        assert abs(own["logprob"] - want[p - 1]) < TOLERANCE
        assert own["rank"] == int((reference[p - 1] > reference[p - 1, PROMPT_IDS[p]]).sum()) + 1
        top = sorted(entry.values(), key=lambda e: e["rank"])
        assert top[0]["rank"] == 1 and abs(top[0]["logprob"] - float(reference[p - 1].max())) < TOLERANCE
        assert len(entry) in (2, 3)  # the prompt's token and the two most likely (it may be one)
    tokenizer = AutoTokenizer.from_pretrained(system.model_dir)
    messages = [{"role": "user", "content": "Name three colours."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    body = {"messages": messages, "max_tokens": 4, "prompt_logprobs": 0, "stream": True}
    async with httpx.AsyncClient(base_url=system.url, timeout=120) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = [line async for line in stream.aiter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[6:]) for line in lines]
    carrying = [c for c in chunks if c["choices"] and "prompt_logprobs" in c["choices"][0]]
    assert len(carrying) == 1 and carrying[0] is chunks[0]  # on the first chunk, once
    entries = carrying[0]["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    assert all(set(e) == {str(t)} for e, t in zip(entries[1:], prompt[1:], strict=True))  # no alternatives asked


async def test_sglang_input_logprobs(system: Any, reference: torch.Tensor) -> None:
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 5,
        "top_logprobs_num": 3,
    }
    r = await post(system, "/generate", body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT_IDS[5:]
    assert_close([e[0] for e in entries], expected(reference)[4:])
    assert [len(t) for t in meta["input_top_logprobs"]] == [3] * (len(PROMPT_IDS) - 5)
    assert r.json()["output_ids"] == [] and meta["completion_tokens"] == 0
    assert all(e[2] is None for e in entries)  # no text unless asked
    whole = await post(
        system,
        "/generate",
        {**body, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 2}, "return_text_in_logprobs": True},
    )
    meta = whole.json()["meta_info"]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert len(meta["output_token_logprobs"]) == 2
    tokenizer = AutoTokenizer.from_pretrained(system.model_dir)
    for _, token, text in meta["input_token_logprobs"] + meta["output_token_logprobs"]:
        assert text == tokenizer.decode([token])  # SGLang's return_text_in_logprobs
    assert all(text == tokenizer.decode([t]) for top in meta["input_top_logprobs"][1:] for _, t, text in top)


async def test_every_sample_shows_the_prompt_s_log_probabilities(system: Any, reference: torch.Tensor) -> None:
    """With ``n`` > 1 the prompt is computed once and every choice shows its scores, as vLLM
    serves them: the legacy ``echo`` with ``logprobs`` (whole and streamed: each choice's first
    piece starts with the prompt's tokens), vLLM's ``prompt_logprobs``, and SGLang's
    ``logprob_start_len`` on /generate."""
    want = expected(reference)
    body = {"prompt": PROMPT_IDS, "max_tokens": 2, "n": 3, "temperature": 1.0, "seed": 7, "echo": True, "logprobs": 1}
    r = await post(system, "/v1/completions", {**body, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    for c in choices:
        assert_close(c["logprobs"]["token_logprobs"][1 : len(PROMPT_IDS)], want)
        entries = c["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(PROMPT_IDS)
        assert_close([e[str(t)]["logprob"] for e, t in zip(entries[1:], PROMPT_IDS[1:], strict=True)], want)
    assert r.json()["usage"]["prompt_tokens"] == len(PROMPT_IDS) and r.json()["usage"]["completion_tokens"] == 6
    async with httpx.AsyncClient(base_url=system.url, timeout=120) as http:
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            lines = [line async for line in stream.aiter_lines() if line.startswith("data: {")]
    firsts: dict[int, Any] = {}
    for chunk in (json.loads(line[6:]) for line in lines):
        for c in chunk["choices"]:
            firsts.setdefault(c["index"], c)
    assert sorted(firsts) == [0, 1, 2]
    for c in firsts.values():  # each choice's first piece: the prompt echoed with its scores
        assert_close(c["logprobs"]["token_logprobs"][1 : len(PROMPT_IDS)], want)
    sglang = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": 1, "n": 2},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    r = await post(system, "/generate", sglang)
    assert r.status_code == 200, r.text
    bodies = r.json()
    assert isinstance(bodies, list) and len(bodies) == 2
    for b in bodies:
        assert_close([e[0] for e in b["meta_info"]["input_token_logprobs"][1:]], want)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT_IDS, "prompt_logprobs": 21}, "prompt_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": -1},
            "prompt_logprobs",
        ),
        ("/generate", {"input_ids": PROMPT_IDS, "logprob_start_len": 2}, "logprob_start_len"),
        ("/generate", {"input_ids": PROMPT_IDS, "return_logprob": True, "logprob_start_len": 150}, "logprob_start_len"),
        ("/generate", {"input_ids": PROMPT_IDS, "sampling_params": {"prompt_logprobs": 1}}, "prompt_logprobs"),
        ("/generate", {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ],
)
async def test_requests_that_cannot_be_served(system: Any, path: str, body: dict[str, Any], param: str) -> None:
    r = await post(system, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_scored_tokens_are_counted(system: Any) -> None:
    async def scored() -> float:
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(system.url + "/metrics")).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("pdserve_prompt_tokens_scored_total{")
        )

    await asyncio.sleep(1.2)  # two heartbeats: the earlier tests' counts reach the registry
    before = await scored()
    r = await post(system, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200
    for _ in range(50):  # the workers' counters reach the registry with their heartbeats
        if await scored() >= before + len(PROMPT_IDS) - 1:
            break
        await asyncio.sleep(0.1)
    assert await scored() == before + len(PROMPT_IDS) - 1
