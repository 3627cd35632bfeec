"""A model named by its hub id, with its own generation config, through the whole system:
`pdserve up --model-path OWNER/NAME` with no network (``HF_HUB_OFFLINE=1``, ``HF_HOME`` a
cache laid out as ``huggingface_hub`` writes it) resolves the id once and serves it under
that name, taking the generation config's sampling values as request defaults
(``--generation-config auto``); a second `pdserve api` with ``--generation-config none``
resolves the id by itself and leaves them out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from tests.integration.conftest import free_port
from tests.integration.test_api_surface import PROMPT_IDS, hf
from tests.pdserve.test_checkpoint import FAKE_ID, hf_cache

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

# Every key a generation config may set; top_k 1 makes each default sample the penalised
# greedy token, which transformers reproduces (a penalty of 2 changes this model's output).
DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 1, "min_p": 0.05, "repetition_penalty": 2.0}
PDSERVE_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
STEPS = 10


@dataclass
class Front:
    """An HTTP API in front of the system, and what it was started with."""

    url: str
    generation_config: str
    model_dir: Path  # the snapshot the id resolved to
    tiny_model_dir: Path  # the same weights, for transformers


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, Path]:
    """A Hugging Face cache holding the tiny model, with a generation config, as :data:`FAKE_ID`."""
    home = tmp_path_factory.mktemp("hf")
    edit = {"generation_config.json": {"do_sample": True, **DEFAULTS}}
    return home, hf_cache(home, tiny_model_dir, edit=edit)


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    hf_home: tuple[Path, Path],
    nats_for_module: Any,
    system_control: Any,
) -> Iterator[Any]:
    """`pdserve up --mode unified --model-path OWNER/NAME`, offline (``--generation-config`` auto)."""
    start, stop = system_control
    env = {"HF_HOME": str(hf_home[0]), "HF_HUB_OFFLINE": "1"}
    s = start(tmp_path_factory.mktemp("up"), Path(FAKE_ID), nats_for_module.url, "--mode", "unified", env=env)
    yield s
    stop(s)


@pytest.fixture(scope="module")
def api_without_defaults(
    tmp_path_factory: pytest.TempPathFactory, hf_home: tuple[Path, Path], nats_for_module: Any, system: Any
) -> Iterator[str]:
    """A second API, `pdserve api --model-path OWNER/NAME --generation-config none`, on the
    same broker: it resolves the id by itself and sends to the same worker."""
    port = free_port()
    env = {**os.environ, "HF_HOME": str(hf_home[0]), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "pdserve", "api", "--model-path", FAKE_ID, "--generation-config", "none"]
    argv += ["--nats-url", nats_for_module.url, "--port", str(port)]
    log = tmp_path_factory.mktemp("api") / "api.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _healthy(url):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(params=["auto", "none"])
def front(request: pytest.FixtureRequest, hf_home: tuple[Path, Path], tiny_model_dir: Path, system: Any) -> Front:
    url = system.url if request.param == "auto" else request.getfixturevalue("api_without_defaults")
    return Front(url, request.param, hf_home[1], tiny_model_dir)


async def post(front: Front, path: str, body: dict[str, Any]) -> Any:
    async with httpx.AsyncClient(base_url=front.url, timeout=120) as http:
        r = await http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_the_hub_id_is_served_under_its_name_from_the_cached_snapshot(front: Front) -> None:
    async with httpx.AsyncClient(base_url=front.url, timeout=30) as http:
        models = (await http.get("/v1/models")).json()["data"]
        info = (await http.get("/get_model_info")).json()
        workers = (await http.get("/workers")).json()
        by_id = await http.get(f"/v1/models/{FAKE_ID}")  # a hub id holds a '/'
    assert [m["id"] for m in models] == [FAKE_ID]
    assert by_id.status_code == 200 and by_id.json() == models[0]
    assert Path(models[0]["root"]) == front.model_dir.resolve()
    assert {w["model"] for w in workers} == {FAKE_ID}
    assert info["served_model_name"] == FAKE_ID and info["generation_config"] == front.generation_config
    assert info["preferred_sampling_params"] == (DEFAULTS if front.generation_config == "auto" else {})


async def test_requests_that_set_nothing_sample_with_the_generation_config(front: Front) -> None:
    client = openai.AsyncOpenAI(base_url=front.url + "/v1", api_key="none", max_retries=0, timeout=120)
    penalised = hf(front.tiny_model_dir, PROMPT_IDS, STEPS, [RepetitionPenaltyLogitsProcessor(2.0)])
    plain = hf(front.tiny_model_dir, PROMPT_IDS, STEPS)
    assert penalised != plain
    implicit = {"max_new_tokens": STEPS, "ignore_eos": True, "seed": 7}
    out = await post(front, "/generate", {"input_ids": PROMPT_IDS, "sampling_params": implicit})
    expected = DEFAULTS if front.generation_config == "auto" else PDSERVE_DEFAULTS
    explicit = await post(front, "/generate", {"input_ids": PROMPT_IDS, "sampling_params": {**implicit, **expected}})
    assert out["output_ids"] == explicit["output_ids"]
    completion = await client.completions.create(
        model=FAKE_ID, prompt=PROMPT_IDS, max_tokens=STEPS, seed=7, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text == out["text"]  # the OpenAI route takes the same defaults
    if front.generation_config == "none":
        assert out["output_ids"] not in (penalised, plain)  # sampled at temperature 1
        return
    assert out["output_ids"] == penalised
    # a request's own value wins over the model's
    own = await post(
        front,
        "/generate",
        {"input_ids": PROMPT_IDS, "sampling_params": {**implicit, "repetition_penalty": 1.0}},
    )
    assert own["output_ids"] == plain
    messages = [{"role": "user", "content": "Tell me a story."}]
    tokenizer = AutoTokenizer.from_pretrained(front.model_dir)
    chat_ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    chat = await client.chat.completions.create(
        model=FAKE_ID, messages=messages, max_tokens=STEPS, extra_body={"ignore_eos": True}
    )
    expected_chat = hf(front.tiny_model_dir, chat_ids, STEPS, [RepetitionPenaltyLogitsProcessor(2.0)])
    assert chat.choices[0].message.content == tokenizer.decode(expected_chat, skip_special_tokens=True)
