"""Speculative decoding for structured output (``engine/speculative.py`` with
``engine/grammar.py``): a draft is cut before the first token its grammar refuses, each verify
row is judged under the grammar's mask after the draft tokens before it, the matcher is left
where it was; greedy output with a JSON schema, a regex or an EBNF grammar is token for token
the output without speculation (with drafts verified and accepted), sampled output keeps the
constrained distribution. On the real tiny model and its tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.grammar import Grammars
from pdserve.engine.loader import build_engine
from pdserve.engine.outputs import RequestOutput, VerifyResult
from pdserve.engine.sampler import Sampler, SampleRequest
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative import Speculator, verify
from pdserve.schemas import SamplingParams
from tests.engine.test_speculative import CHI2_DF5_999, chi2, draw_verifies

CPU = torch.device("cpu")
ALWAYS = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4, "speculative_cost_ratio": 0.0}

# An array of records: the keys and punctuation the schema forces come back record after
# record, so the n-gram index proposes them and the target (under the mask) takes them.
ROWS_SCHEMA = {
    "type": "array",
    "minItems": 3,
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
}
# xgrammar's JSON (``any_whitespace=False``) separates with ", " and ": "
ROWS_EXAMPLE = '[{"name": "ann", "ok": true}, {"name": "bob", "ok": false}, {"name": "cy", "ok": true}]'
PATTERN = r"((ab|cd)-){4,6}[0-9]{2}"
EBNF = 'root ::= item item item item\nitem ::= "<" ("x" | "y") ">"'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> Grammars:
    return Grammars(tokenizer, 4096, [tokenizer.eos_token_id])


def _token(grammars: Grammars, text: bytes) -> int:
    return grammars._vocab.index(text)


def _allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    bits = bitmask[row].numpy().view("uint32")
    return {w * 32 + b for w in range(len(bits)) for b in range(32) if (int(bits[w]) >> b) & 1}


# ---- the cut -------------------------------------------------------------------------
def test_a_draft_is_cut_before_the_first_token_its_grammar_refuses(grammars: Grammars, tokenizer: Any) -> None:
    """The matcher takes the draft on trial and is rolled back: it stands where it stood
    (same mask, nothing seen, not terminated), also after a stop token the grammar ended with."""
    t = {c: _token(grammars, c.encode()) for c in "abcdx-12"}
    m = grammars.matcher(SamplingParams(regex=r"[a-c]{3}-[0-9]{2}"))
    before = _allowed(grammars.masks([m], CPU))
    assert m.draft_prefix([t[c] for c in "abc-1x2"]) == 5
    assert m.draft_prefix([t["d"], t["a"]]) == 0
    assert m.seen == 0 and not m.is_terminated and _allowed(grammars.masks([m], CPU)) == before
    eos = tokenizer.eos_token_id
    whole = [t[c] for c in "abc-12"]
    assert m.draft_prefix([*whole, eos, t["a"]]) == len(whole) + 1  # nothing after the end
    assert not m.is_terminated and not m._matcher.is_terminated()
    for token in whole[:3]:  # the real matcher goes on as if no draft had been tried
        assert m.accept(token)
    assert m.draft_prefix([t["1"]]) == 0 and m.draft_prefix([t["-"], t["1"], t["2"], eos]) == 4
    assert m.seen == 3 and not m.is_terminated

    # the speculator cuts and counts; it drafts nothing for a matcher not caught up
    speculator = Speculator(EngineConfig(**ALWAYS))  # type: ignore[arg-type]
    seq = Sequence("s", [1, 2, 3], SamplingParams(regex=r"[a-c]{3}-[0-9]{2}"), matcher=m, output_ids=whole[:3])
    assert speculator.cut(seq, [t[c] for c in "-1xa"]) == [t["-"], t["1"]]
    assert speculator.stats.grammar_cut == 2
    seq.output_ids = whole[:2]
    assert speculator.cut(seq, [t["-"]]) == [] and speculator.stats.grammar_cut == 2


def test_the_cut_refuses_what_the_masks_refuse_beyond_the_grammar(grammars: Grammars, tokenizer: Any) -> None:
    """A JSON row's masks refuse tokens holding control characters, and after a lone 0xED byte
    the tokens beginning 0xA0-0xBF (a UTF-16 surrogate): its drafts are cut there too, the
    0xED taken on trial included; a regex row that admits control characters keeps them."""
    vocab = grammars._vocab
    quote = [tokenizer.convert_tokens_to_ids('"')]
    json_row = grammars.matcher(SamplingParams(json_schema=json.dumps({"type": "string"})), quote)
    regex_row = grammars.matcher(SamplingParams(regex=r'"[\s\S]*"'), quote)
    regex_allows = _allowed(grammars.masks([regex_row], CPU))
    control = next(i for i, text in enumerate(vocab[:4096]) if any(b < 0x20 for b in text) and i in regex_allows)
    assert json_row.draft_prefix([control]) == 0 and regex_row.draft_prefix([control]) == 1

    def byte(b: int) -> int:
        return _token(grammars, bytes([b]))

    assert json_row.draft_prefix([byte(0xED), byte(0xA0)]) == 1  # a surrogate: cut after the 0xED
    assert json_row.draft_prefix([byte(0xED), byte(0x9E), byte(0x80)]) == 3  # U+D780: a real character
    assert not json_row.after_ed and json_row.seen == 1


def test_verify_rows_get_the_masks_after_each_draft_prefix(grammars: Grammars) -> None:
    """``draft_masks``: row ``t`` of a sequence is the mask its grammar gives after
    ``draft[:t]`` (the mask of a matcher that took those tokens), a row without a grammar
    allows everything; past a token the grammar refuses, the rows repeat the one that refuses
    it; the matchers stand where they stood."""
    schema = SamplingParams(json_schema=json.dumps(ROWS_SCHEMA))
    regex = SamplingParams(regex=PATTERN)

    def ids(text: str) -> list[int]:
        return [_token(grammars, c.encode()) for c in text]

    start = ids('[{"na')
    m_json = grammars.matcher(schema, start)
    m_regex = grammars.matcher(regex, ids("ab-"))
    d_json = ids('me": "')
    d_regex = ids("cd-x-")  # "x" refused
    before = (_allowed(grammars.masks([m_json], CPU)), _allowed(grammars.masks([m_regex], CPU)))
    masks = grammars.draft_masks([(m_json, d_json), (None, [5, 6]), (m_regex, d_regex)], CPU).clone()
    assert masks.shape == (len(d_json) + 1 + 3 + len(d_regex) + 1, 128)
    row = 0
    for t in range(len(d_json) + 1):
        expected = grammars.masks([grammars.matcher(schema, start + d_json[:t])], CPU)
        assert torch.equal(masks[row], expected[0]), t
        row += 1
    for _ in range(3):
        assert bool((masks[row] == -1).all())
        row += 1
    for t in range(len(d_regex) + 1):
        expected = grammars.masks([grammars.matcher(regex, ids("ab-") + d_regex[: min(t, 3)])], CPU)
        assert torch.equal(masks[row], expected[0]), t
        row += 1
    assert (_allowed(grammars.masks([m_json], CPU)), _allowed(grammars.masks([m_regex], CPU))) == before
    assert m_json.seen == len(start) and m_regex.seen == 3


# ---- verification under the masks ----------------------------------------------------
def _mask(allowed: set[int]) -> int:
    word = sum(1 << i for i in allowed)
    return word - (1 << 32) if word >= 1 << 31 else word  # as int32


@pytest.mark.parametrize("draft", [[1, 4], [3, 1], [1, 0]])
def test_verify_under_masks_keeps_the_constrained_distribution(draft: list[int]) -> None:
    """Six tokens; row 0 allows {0, 1, 2, 5}, row 1 {1, 3, 4}. The first emitted token is
    distributed as row 0's masked distribution whatever the draft (a draft token the mask
    refuses is never kept), the second (after the kept draft token) as row 1's; greedy rows
    take the masked argmax; the logits are not written."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 0.5, 1.0, 3.0, 0.0, 1.5], [0.0, 1.0, 2.0, 0.5, -0.5, 1.0], [1.0] * 6])
    kept = logits.clone()
    masks = torch.tensor([[_mask({0, 1, 2, 5})], [_mask({1, 3, 4})], [-1]], dtype=torch.int32)
    masked = logits.masked_fill(torch.tensor([[0, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1], [0] * 6], dtype=bool), -1e30)
    p = [torch.softmax(masked[i], -1).tolist() for i in range(3)]
    sampler = Sampler(CPU)
    sampler.reseed(99)
    results, first, second = draw_verifies(
        sampler, logits, draft, SamplingParams(temperature=1.0, max_new_tokens=8), masks=masks
    )
    assert chi2(first, p[0]) < CHI2_DF5_999
    if p[0][draft[0]] > 0:
        assert chi2(second, p[1]) < CHI2_DF5_999
    assert max(r.accepted for r in results) <= (0 if draft[0] == 3 else 1 if draft[1] == 0 else 2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    rows = [[SampleRequest(greedy, [1], [], index=t) for t in range(3)]]
    assert verify(sampler, logits, [[0, 1]], rows, masks)[0].tokens == [0, 1, 0]  # 3, then 2: the raw argmaxes
    assert verify(sampler, logits, [[0, 2]], rows, masks)[0].tokens == [0, 1]
    assert verify(sampler, logits, [[3, 1]], rows, masks)[0].tokens == [0]
    assert torch.equal(logits, kept)


# ---- the engine ----------------------------------------------------------------------
def _requests(tokenizer: Any, **sampling: Any) -> dict[str, tuple[list[int], SamplingParams]]:
    ask = tokenizer.encode(f"Repeat this JSON exactly: {ROWS_EXAMPLE}\nRepeated: ")
    return {
        "json": (ask, SamplingParams(max_new_tokens=120, json_schema=json.dumps(ROWS_SCHEMA), **sampling)),
        "regex": (
            tokenizer.encode("ab-cd-ab-cd-ab-12 again: "),
            SamplingParams(max_new_tokens=40, regex=PATTERN, **sampling),
        ),
        "ebnf": (tokenizer.encode("<x><y><x><y> again: "), SamplingParams(max_new_tokens=40, ebnf=EBNF, **sampling)),
        "free": (ask, SamplingParams(max_new_tokens=24, ignore_eos=True, **sampling)),
    }


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    while engine.has_work():
        for o in engine.step():
            assert o.index == len(tokens.get(o.rid, []))
            tokens.setdefault(o.rid, []).extend(o.token_ids)
            reasons[o.rid] = o.finish_reason
    engine.pages.check_invariants()
    assert engine.stats.grammar_refusals == 0  # every token appended was one its grammar took
    return {"tokens": tokens, "reasons": reasons}


def _check_outputs(engine: Engine, tokens: dict[str, list[int]], reasons: dict[str, str | None]) -> None:
    assert engine.detokenize is not None
    jsonschema.validate(json.loads(engine.detokenize(tokens["json"])), ROWS_SCHEMA)
    assert re.fullmatch(PATTERN, engine.detokenize(tokens["regex"]))
    assert re.fullmatch(r"(<[xy]>){4}", engine.detokenize(tokens["ebnf"]))
    assert reasons["json"] == reasons["regex"] == reasons["ebnf"] == "stop"  # each ended with its grammar


@pytest.mark.parametrize("impl", ["auto", "transformers"])  # auto: the CPU pass
def test_constrained_greedy_output_with_speculation_is_the_output_without(
    tiny_model_dir: Path, tokenizer: Any, impl: str
) -> None:
    """JSON schema, regex and EBNF rows (and a free one beside them) draft, have drafts cut by
    their grammars and verified under its masks, and emit exactly the tokens plain decoding
    emits; the counters, the cut included, reach Prometheus."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.workers.metrics import _Speculative

    requests = _requests(tokenizer, temperature=0.0)
    base = {"max_total_tokens": 8192, "model_impl": impl}
    unspeculated = build_engine(tiny_model_dir, EngineConfig(**base))  # type: ignore[arg-type]
    plain = _run(unspeculated, requests)
    engine = build_engine(tiny_model_dir, EngineConfig(**base, **ALWAYS))  # type: ignore[arg-type]
    assert engine.speculator is not None
    verified: dict[str, int] = {}
    accepted: dict[str, int] = {}
    record = engine.speculator.record

    def counting(seq: Sequence, drafted: int, accepted_: int, emitted: int) -> None:
        verified[seq.rid] = verified.get(seq.rid, 0) + 1
        accepted[seq.rid] = accepted.get(seq.rid, 0) + accepted_
        record(seq, drafted, accepted_, emitted)

    engine.speculator.record = counting  # type: ignore[method-assign]
    ours = _run(engine, requests)
    assert ours == plain
    _check_outputs(engine, ours["tokens"], ours["reasons"])
    for rid in ("json", "regex", "ebnf"):  # the constrained rows' drafts were verified, and paid
        assert verified.get(rid, 0) > 0 and accepted.get(rid, 0) > 0, rid
    spec = engine.stats.spec
    assert spec is not None and spec.grammar_cut > 0
    assert engine.stats.steps < unspeculated.stats.steps
    registry = CollectorRegistry()
    registry.register(_Speculative(spec))
    text = generate_latest(registry).decode()
    assert f"pdserve_spec_grammar_cut_tokens_total {float(spec.grammar_cut)}" in text


@pytest.mark.slow
def test_the_default_model_repeats_json_under_its_schema_with_speculation(smollm2_dir: Path) -> None:
    """SmolLM2-135M-Instruct as served, asked to repeat JSON given in the prompt under a JSON
    schema: the drafts (the prompt's JSON) pass the grammar, most are accepted, and the
    output is token for token the output without speculation, in far fewer steps."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    person = {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}}
    item = {"type": "object", "properties": person, "required": list(person), "additionalProperties": False}
    schema = json.dumps({"type": "array", "items": item})
    people = [("Alice", "Paris", 31), ("Bob", "London", 45), ("Carol", "Berlin", 27)]
    example = json.dumps([{"name": n, "city": c, "age": a} for n, c, a in people])
    messages = [{"role": "user", "content": f"Repeat this JSON exactly: {example}"}]
    prompt = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    requests = {"j": (prompt, SamplingParams(max_new_tokens=96, temperature=0.0, json_schema=schema))}
    unspeculated = build_engine(smollm2_dir, EngineConfig(max_total_tokens=4096))
    plain = _run(unspeculated, requests)
    engine = build_engine(smollm2_dir, EngineConfig(max_total_tokens=4096, **ALWAYS))  # type: ignore[arg-type]
    ours = _run(engine, requests)
    assert ours == plain and ours["reasons"]["j"] == "stop"
    assert engine.detokenize is not None and json.loads(engine.detokenize(ours["tokens"]["j"])) == json.loads(example)
    spec = engine.stats.spec
    assert spec is not None and spec.accepted > spec.drafted / 2
    assert engine.stats.steps < unspeculated.stats.steps / 2


def test_a_verify_that_takes_the_grammars_stop_token_ends_the_request_there(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    """A prompt holding the constrained answer and its stop token: a draft runs into the end
    of the grammar, the verify accepts the stop token (the grammar terminates on it) and the
    request stops there, the bonus token after it dropped (never fed to the matcher), as
    plain decoding ends."""
    regex = SamplingParams(max_new_tokens=40, temperature=0.0, regex=PATTERN)
    ask = tokenizer.encode("ab-cd-ab-cd-ab-12 again: ")
    first = _run(build_engine(tiny_model_dir, EngineConfig(max_total_tokens=8192)), {"r": (ask, regex)})
    requests = {"r": (ask + first["tokens"]["r"] + ask, regex)}
    plain = _run(build_engine(tiny_model_dir, EngineConfig(max_total_tokens=8192)), requests)
    engine = build_engine(tiny_model_dir, EngineConfig(max_total_tokens=8192, **ALWAYS))  # type: ignore[arg-type]
    ends: list[tuple[list[int], int, RequestOutput]] = []
    append = engine._append_verified

    def appending(v: VerifyResult) -> RequestOutput:
        out = append(v)
        if out.finish_reason is not None:
            ends.append((v.tokens, v.accepted, out))
        return out

    engine._append_verified = appending  # type: ignore[method-assign]
    ours = _run(engine, requests)
    assert ours == plain and ours["reasons"]["r"] == "stop"
    ((tokens, accepted, out),) = ends  # the request ended in a verify ...
    stop = out.token_ids[-1]
    assert tokens.index(stop) < accepted  # ... on a draft token: the grammar's stop token
    assert out.finish_reason == "stop" and len(out.token_ids) < len(tokens)  # the bonus token dropped
    assert re.fullmatch(PATTERN, engine.detokenize(ours["tokens"]["r"]))  # type: ignore[misc]


def test_constrained_steps_with_speculation_and_overlap(tiny_model_dir: Path, tokenizer: Any) -> None:
    """The overlapped path (the fast path, kernels interpreted), only constrained rows: steps
    left queued on the device (their grammars catch up at the next launch) alternate with
    verifies (at a cost ratio where drafts pay some of the time), and the greedy tokens are
    the plain engine's. The regex and EBNF rows only: interpreted, the JSON row's 120 tokens
    were most of the suite's slowest engine test."""
    requests = {rid: r for rid, r in _requests(tokenizer, temperature=0.0).items() if rid in ("regex", "ebnf")}
    runs = []
    for knobs in ({}, {**ALWAYS, "speculative_cost_ratio": 0.3}):
        config = EngineConfig(max_total_tokens=8192, overlap_schedule=True, model_impl="pdserve", **knobs)  # type: ignore[arg-type]
        engine = build_engine(tiny_model_dir, config)
        assert engine.overlap and engine.runner.fast is not None
        engine.runner.fast.use_gemv = False  # interpreted, it is slow
        runs.append(_run(engine, requests))
    plain, ours = runs
    assert ours == plain
    spec = engine.stats.spec
    assert spec is not None and spec.verifies > 0 and spec.accepted > 0 and spec.unoverlapped_steps > 0
    assert engine.stats.overlapped_steps > 0


def test_constrained_sampling_with_speculation_keeps_to_the_grammar(tiny_model_dir: Path, tokenizer: Any) -> None:
    """Sampled (seeded) constrained rows with drafts: every output follows its grammar, no
    token was refused, drafts were verified, and the seeded run is reproducible."""
    requests = _requests(tokenizer, temperature=1.0, seed=11)
    runs = []
    for _ in range(2):
        engine = build_engine(tiny_model_dir, EngineConfig(max_total_tokens=8192, **ALWAYS))  # type: ignore[arg-type]
        runs.append(_run(engine, requests))
        _check_outputs(engine, runs[-1]["tokens"], runs[-1]["reasons"])
        spec = engine.stats.spec
        assert spec is not None and spec.verifies > 0 and spec.accepted > 0
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_speculation_on_a_gpu_is_the_output_without(
    tiny_model_dir: Path, tokenizer: Any, overlap: bool
) -> None:
    """On a GPU (the fast path, CUDA graphs, float32 so that no near tie separates the runs):
    the verify rows' masks staged in pinned buffers and copied with the step, with and
    without overlap; JSON, regex and EBNF rows beside a free one emit the tokens plain
    decoding emits, drafts cut by their grammars and verified."""
    requests = _requests(tokenizer, temperature=0.0)
    runs = []
    for knobs in ({}, ALWAYS):
        config = EngineConfig(device="cuda", max_total_tokens=8192, overlap_schedule=overlap, **knobs)  # type: ignore[arg-type]
        engine = build_engine(tiny_model_dir, config, dtype="float32")
        assert engine.runner.fast is not None and engine.overlap == overlap
        runs.append(_run(engine, requests))
    plain, ours = runs
    assert ours == plain
    _check_outputs(engine, ours["tokens"], ours["reasons"])
    spec = engine.stats.spec
    assert spec is not None and spec.verifies > 0 and spec.accepted > 0 and spec.grammar_cut > 0
