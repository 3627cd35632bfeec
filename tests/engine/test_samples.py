"""What a request asks of sampling beyond the basics: ``n`` samples of one prompt sharing
its KV, penalties and ``logit_bias`` (against ``transformers``' logits processors), and
structured output (xgrammar token masks): on the real tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pdserve.engine.engine import Engine
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.outputs import RequestError
from pdserve.schemas import SamplingParams
from pdserve.schemas.sampling import sample_rid
from tests.engine.test_engine import hf_greedy, iter_outputs, make_engine, random_prompts, run_all

PROMPT = random_prompts(1, 4000, seed=7, low=37, high=37)[0]  # 37 tokens: two full pages and a partial one


def test_n_greedy_samples_are_identical_equal_transformers_and_share_one_prefill(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, page_size=16)
    engine.add_request("g", PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, n=4))
    outs = run_all(engine)
    (expected,) = hf_greedy(tiny_model_dir, [PROMPT], 12)
    assert outs == {sample_rid("g", i): expected for i in range(4)}
    assert engine.stats.prompt_tokens == len(PROMPT)  # one prefill
    assert engine.stats.batch_rows < 4 + 4 * 12  # the prompt was not computed per sample
    assert engine.pages.num_used_pages == 0
    engine.pages.check_invariants()


def test_n_samples_share_the_prompts_full_pages(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, page_size=16)
    engine.add_request("g", PROMPT, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, n=3))
    while not engine.scheduler.running:
        engine.step()
    seqs = list(engine.scheduler.running)
    assert len(seqs) == 3
    shared = seqs[0].page_table[:2]
    assert all(s.page_table[:2] == shared for s in seqs)
    assert all(engine.pages.ref_count(p) == 3 for p in shared)
    assert len({s.page_table[2] for s in seqs}) == 3  # the partial page was copied
    run_all(engine)
    assert engine.pages.num_used_pages == 0


def test_n_seeded_samples_differ_and_each_equals_its_own_seed(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=3.0, seed=123, ignore_eos=True)  # the tiny model is peaked
    engine = make_engine(tiny_model_dir)
    engine.add_request("g", PROMPT, SamplingParams(**{**_fields(params), "n": 4}))
    outs = run_all(engine)
    samples = [outs[sample_rid("g", i)] for i in range(4)]
    assert len({tuple(s) for s in samples}) == 4
    for i in (0, 3):  # sample i is the request alone with seed + i: how a lone sample resumes
        alone = make_engine(tiny_model_dir)
        alone.add_request("a", PROMPT, params.for_sample(i))
        assert run_all(alone)["a"] == samples[i]


def test_n_samples_over_the_prefill_decode_hand_off(tiny_model_dir: Path) -> None:
    """Prefill draws every sample's first token and holds the prompt's KV once; decode
    imports it once and forks it; the samples equal a unified run's."""
    params = SamplingParams(max_new_tokens=8, temperature=0.9, seed=5, ignore_eos=True, n=3)
    unified = make_engine(tiny_model_dir)
    unified.add_request("g", PROMPT, params)
    expected = run_all(unified)

    prefill, decode = make_engine(tiny_model_dir), make_engine(tiny_model_dir)
    prefill.add_request("g", PROMPT, params, prefill_only=True)
    firsts = {o.rid: o for o in iter_outputs(prefill)}
    assert sorted(firsts) == [sample_rid("g", i) for i in range(3)] and all(o.held for o in firsts.values())
    pages, num_tokens = prefill.held_pages("g")
    assert num_tokens == len(PROMPT)
    samples = [(i, firsts[sample_rid("g", i)].token_ids[0]) for i in range(3)]
    seq = decode.reserve_import("g", PROMPT, [], params, samples)
    assert seq is not None
    n = -(-num_tokens // decode.pages.page_size)
    decode.runner.pool.tensor[seq.page_table[:n]] = prefill.runner.pool.tensor[pages[:n]]  # the one transfer
    decode.commit_import(seq)
    assert prefill.release("g") and prefill.pages.num_used_pages == 0
    outs = run_all(decode)
    assert {rid: firsts[rid].token_ids + outs[rid] for rid in outs} == expected
    assert decode.pages.num_used_pages == 0


@pytest.mark.parametrize("prefill_only", [False, True])
def test_n_samples_each_carry_the_prompt_s_log_probabilities(tiny_model_dir: Path, prefill_only: bool) -> None:
    """An ``n > 1`` request asking for its prompt's log-probabilities: the prompt is scored
    once (its head's prefill, in chunks past the prefix cache) and every sample's first output
    carries the same scores, those of the request with ``n`` 1; a prefill worker's samples
    too (their first tokens go to the client before the hand-off). No later output has them."""
    params = SamplingParams(max_new_tokens=4, temperature=0.9, seed=11, ignore_eos=True, prompt_logprobs=2)
    alone = make_engine(tiny_model_dir, chunked_prefill_size=16)
    alone.add_request("a", PROMPT, params)
    (want,) = [o.prompt_logprobs for o in iter_outputs(alone) if o.prompt_logprobs is not None]
    engine = make_engine(tiny_model_dir, chunked_prefill_size=16)
    engine.add_request("warm", PROMPT, SamplingParams(max_new_tokens=1, temperature=0.0))  # the prefix cached
    run_all(engine)
    engine.add_request("g", PROMPT, SamplingParams(**{**_fields(params), "n": 3}), prefill_only=prefill_only)
    scored: dict[str, list[int]] = {}
    for o in iter_outputs(engine):
        if o.prompt_logprobs is not None:
            assert o.index == 0 and o.rid not in scored
            scored[o.rid] = o.prompt_logprobs
    assert sorted(scored) == [sample_rid("g", i) for i in range(3)]
    for got in scored.values():
        assert got.ranks == want.ranks and got.top_ids == want.top_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    assert engine.stats.scored_prompt_tokens == len(PROMPT) - 1  # scored once
    if prefill_only:
        assert engine.release("g")
    assert engine.pages.num_used_pages == 0


def test_a_sample_can_be_aborted_alone_or_with_its_request(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.add_request("g", PROMPT, SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True, n=3))
    while len(engine.scheduler.running) < 3:
        engine.step()
    assert engine.abort(sample_rid("g", 1))
    engine.step()
    assert len(engine.scheduler.running) == 2
    assert engine.abort("g")
    run_all(engine)
    assert engine.pages.num_used_pages == 0


def test_n_too_large_or_resumed_is_refused(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_num_seqs=4)
    with pytest.raises(RequestError, match="n is 5"):
        engine.add_request("g", PROMPT, SamplingParams(n=5))
    with pytest.raises(RequestError, match="resume each sample"):
        engine.add_request("g", PROMPT, SamplingParams(n=2), output_ids=[5])


# ---- penalties and logit_bias against transformers --------------------------------------
class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented formula: mu[j] -= c[j] * frequency + (c[j] > 0) * presence, over
    the generated tokens only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processed(model_dir: Path, prompt: list[int], steps: int, processors: list[LogitsProcessor]) -> list[int]:
    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        g = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            logits_processor=LogitsProcessorList(processors),
        )
    return g[0, len(prompt) :].tolist()


def test_penalties_and_bias_equal_transformers_logits_processors(tiny_model_dir: Path) -> None:
    (plain,) = hf_greedy(tiny_model_dir, [PROMPT], 16)
    banned, boosted = plain[0], 1234
    bias = {str(banned): -100.0, str(boosted): 4.0}
    cases = [
        (SamplingParams(frequency_penalty=1.5, presence_penalty=0.5), [OpenAIPenalties(len(PROMPT), 1.5, 0.5)]),
        (SamplingParams(repetition_penalty=1.8), [RepetitionPenaltyLogitsProcessor(1.8)]),
        (SamplingParams(logit_bias=bias), [SequenceBiasLogitsProcessor([[[banned], -100.0], [[boosted], 4.0]])]),
    ]
    engine = make_engine(tiny_model_dir)
    expected = {}
    for i, (params, processors) in enumerate(cases):
        full = SamplingParams(**{**_fields(params), "max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})
        engine.add_request(f"c{i}", PROMPT, full)
        expected[f"c{i}"] = hf_processed(tiny_model_dir, PROMPT, 16, processors)
    outs = run_all(engine)
    assert outs == expected
    assert outs["c0"] != plain and outs["c2"] != plain  # each did something
    assert banned not in outs["c2"]


def test_bad_words_equal_transformers_no_bad_words(mixing_model_dir: Path) -> None:
    """vLLM's ``bad_words`` as token sequences: a one-token word is never drawn, a two-token
    word's last token is barred only right after its first; greedy output equals ``generate``
    with ``NoBadWordsLogitsProcessor`` over the same sequences (whose tails here lie in the
    output: transformers reads the prompt too, vLLM the output alone)."""
    (plain,) = hf_greedy(mixing_model_dir, [PROMPT], 16)
    k = next(i for i in range(2, 12) if plain[i] not in plain[:i] and plain[i] != PROMPT[-1])
    pair = (plain[k], plain[k + 1])
    cases = {"one": ((plain[0],),), "pair": (pair,), "both": ((plain[0],), pair)}
    engine = make_engine(mixing_model_dir)
    expected = {}
    for name, words in cases.items():
        params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, bad_words=words)
        engine.add_request(name, PROMPT, params)
        expected[name] = hf_processed(
            mixing_model_dir, PROMPT, 16, [NoBadWordsLogitsProcessor([list(w) for w in words])]
        )
    outs = run_all(engine)
    assert outs == expected
    assert plain[0] not in outs["one"] and outs["pair"][: k + 1] == plain[: k + 1] and outs["pair"][k + 1] != pair[1]
    for out in outs.values():
        assert all(out[i : i + 2] != list(pair) for i in range(len(out) - 1)) or out is outs["one"]


def test_a_bad_word_bars_its_last_token_after_the_rest() -> None:
    """The sampler's rule alone: a one-token word everywhere, a longer one only where the output
    ends with its other tokens (not the prompt: vLLM's reading), ids past the vocabulary ignored."""
    from pdserve.engine.sampler import Sampler, SampleRequest

    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=0.0, bad_words=((5,), (1, 2, 7), (3, 99)))
    logits = torch.zeros(3, 10)
    rows = [
        SampleRequest(params, [1, 2], []),  # the prompt ends with 1, 2: not the output's
        SampleRequest(params, [0], [4, 1, 2]),
        SampleRequest(params, [0], [3]),  # 99 is past the vocabulary
    ]
    out = sampler.processed(logits, rows)
    barred = [set(torch.nonzero(out[i] == float("-inf")).flatten().tolist()) for i in range(3)]
    assert barred == [{5}, {5, 7}, {5}]
    # a word of more than one token reads the output: such rows wait for their tokens (no
    # overlapped step, drafts verified after their own tokens), as penalties do
    assert params.reads_history and not SamplingParams(bad_words=((5,),)).reads_history


def test_a_row_that_reads_its_history_takes_unoverlapped_steps_counted(tiny_model_dir: Path) -> None:
    """A penalized row's next step waits for its token (the slower path), counted; plain rows
    beside it take overlapped steps as before, and the draws are the plain steps' draws."""
    runs = []
    for overlap in (False, True):
        engine = make_engine(tiny_model_dir, overlap_schedule=overlap, model_impl="pdserve")
        assert engine.overlap is overlap and engine.runner.fast is not None
        engine.runner.fast.use_gemv = False  # interpreted, it is slow; the greedy tests cover it
        engine.add_request("plain", PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        run_all(engine)
        assert engine.stats.history_unoverlapped_steps == 0  # the normal path
        assert (engine.stats.overlapped_steps > 0) is overlap
        engine.add_request(
            "pen", PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
        )
        runs.append(run_all(engine))
        assert (engine.stats.history_unoverlapped_steps > 0) is overlap
    assert runs[0] == runs[1]


# ---- structured output -----------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def _text(engine: Engine, ids: list[int]) -> str:
    assert engine.detokenize is not None
    return engine.detokenize(ids)


def test_json_schema_outputs_validate_at_temperature_one(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    schema = json.dumps(SCHEMA)
    for i in range(12):
        engine.add_request(
            f"j{i}", PROMPT[: 5 + i], SamplingParams(max_new_tokens=200, temperature=1.0, json_schema=schema)
        )
    engine.add_request(
        "n", PROMPT, SamplingParams(max_new_tokens=200, temperature=1.0, seed=9, json_schema=schema, n=4)
    )
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    for o in iter_outputs(engine):
        tokens.setdefault(o.rid, []).extend(o.token_ids)
        reasons[o.rid] = o.finish_reason
    assert len(tokens) == 16
    assert set(reasons.values()) == {"stop"}  # each ended with its grammar, none ran out
    for ids in tokens.values():
        jsonschema.validate(json.loads(_text(engine, ids)), SCHEMA)
    assert engine.stats.grammar_refusals == 0  # every sampled token was one its mask allowed


def test_a_structural_tag_constrains_the_tagged_part(tiny_model_dir: Path) -> None:
    """xgrammar's structural tag: a sequence of a tag (its begin, a city name by a regular
    expression, its end) and a JSON object, at temperature one, over several seeds. (JSON
    between tags may hold any whitespace, which a random model can spin on: a short one.)"""
    city = {
        "type": "tag",
        "begin": "<city>",
        "content": {"type": "regex", "pattern": "[A-Z][a-z]{2,6}"},
        "end": "</city>",
    }
    flag = {"type": "json_schema", "json_schema": {"type": "boolean"}}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [city, flag]}}
    engine = make_engine(tiny_model_dir)
    for i in range(4):
        params = SamplingParams(max_new_tokens=60, temperature=1.0, seed=i, structural_tag=json.dumps(tag))
        engine.add_request(f"t{i}", PROMPT[: 5 + i], params)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    for o in iter_outputs(engine):
        tokens.setdefault(o.rid, []).extend(o.token_ids)
        reasons[o.rid] = o.finish_reason
    texts = [_text(engine, ids) for ids in tokens.values()]
    for text in texts:
        assert re.fullmatch(r"<city>[A-Z][a-z]{2,6}</city>\s*(true|false)\s*", text), text
    assert set(reasons.values()) == {"stop"} and engine.stats.grammar_refusals == 0


def test_a_token_its_grammar_refuses_is_counted_and_logged(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The masks make it impossible; if a bug ever lets one through (a refused token leaves
    the matcher where it was, so the output goes on off the grammar), it is not silent."""
    engine = make_engine(tiny_model_dir)
    seq = engine.add_request("j", PROMPT[:5], SamplingParams(max_new_tokens=8, json_schema=json.dumps(SCHEMA)))
    assert seq.matcher is not None
    tokenizer = engine.grammars._info  # type: ignore[union-attr]
    refused = next(i for i, b in enumerate(tokenizer.decoded_vocab) if b == b"x")  # JSON starts with "{"
    with caplog.at_level("ERROR", logger="pdserve.engine.appending"):
        engine._append(seq, refused, None, was_decode=False)
    assert engine.stats.grammar_refusals == 1
    assert any("broke its sequence's grammar" in r.getMessage() for r in caplog.records)


def test_constrained_steps_overlap_and_draw_what_plain_steps_draw(tiny_model_dir: Path) -> None:
    """A constrained row's next step is launched before its token is read: its grammar is
    handed the token on the way (before the mask is filled), and the draws are the ones
    waited-for steps make. (Short constraints: the interpreted kernels are slow.)"""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    schema["additionalProperties"] = False
    patterns = {"r0": "[a-f]{9}", "r1": "[0-9]{4}-[a-z]{3}"}
    runs = []
    for overlap in (False, True):
        engine = make_engine(tiny_model_dir, overlap_schedule=overlap, model_impl="pdserve")
        assert engine.overlap is overlap and engine.runner.fast is not None
        engine.runner.fast.use_gemv = False  # interpreted, it is slow; the greedy tests cover it
        engine.add_request("j", PROMPT, SamplingParams(temperature=1.0, seed=40, json_schema=json.dumps(schema)))
        for i, (rid, pattern) in enumerate(patterns.items()):
            engine.add_request(rid, PROMPT[: 20 + i], SamplingParams(temperature=1.0, seed=3 + i, regex=pattern))
        runs.append(run_all(engine))
        assert (engine.stats.overlapped_steps > 0) is overlap
        assert engine.pages.num_used_pages == 0
    plain, overlapped = runs
    assert overlapped == plain
    jsonschema.validate(json.loads(_text(engine, plain.pop("j"))), schema)
    for rid, ids in plain.items():
        assert re.fullmatch(patterns[rid], _text(engine, ids))


def test_regex_and_ebnf_constraints_hold(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    pattern = r"[a-c]{3}-[0-9]{2,4}"
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    engine.add_request("r", PROMPT, SamplingParams(max_new_tokens=40, temperature=1.0, seed=1, regex=pattern, n=3))
    engine.add_request("e", PROMPT, SamplingParams(max_new_tokens=40, temperature=1.0, seed=2, ebnf=grammar, n=3))
    outs = run_all(engine)
    for i in range(3):
        assert re.fullmatch(pattern, _text(engine, outs[sample_rid("r", i)]))
        assert re.fullmatch(r"yes|no|maybe [0-9]", _text(engine, outs[sample_rid("e", i)]))


def test_a_constraint_that_does_not_compile_is_refused(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    with pytest.raises(RequestError, match="does not compile"):
        engine.compile_constraint(SamplingParams(json_schema="{not json"))
    with pytest.raises(RequestError, match="does not compile"):
        engine.add_request("x", PROMPT, SamplingParams(ebnf="root ::= "))


def _fields(params: SamplingParams) -> dict[str, object]:
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


def test_masks_keep_control_characters_out_of_json_rows_only(tiny_model_dir: Path) -> None:
    """A batch mixing a JSON-schema row, a regex row and an unconstrained row: only the JSON
    row loses the tokens holding control characters (strict JSON parsers refuse them raw);
    the regex row keeps what its pattern allows, the free row everything; all rows JSON:
    the same masks as each row alone."""
    from transformers import AutoTokenizer

    from pdserve.engine.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    grammars = Grammars(tokenizer, 4096, [tokenizer.eos_token_id])
    control = [i for i, text in enumerate(grammars._info.decoded_vocab) if text and any(b < 0x20 for b in text)]
    assert control, "the tiny tokenizer has tokens with control characters"

    def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
        bits = bitmask[row].numpy().view("uint32")
        return {w * 32 + b for w in range(len(bits)) for b in range(32) if (int(bits[w]) >> b) & 1}

    schema = SamplingParams(json_schema=json.dumps({"type": "string"}))
    regex = SamplingParams(regex=r'"[\s\S]*"')  # a quoted string of anything, control characters too
    mixed = grammars.masks([grammars.matcher(schema), grammars.matcher(regex), None], torch.device("cpu"))
    quote = [tokenizer.convert_tokens_to_ids('"')]
    after_quote = grammars.masks(
        [
            grammars.matcher(schema, quote),
            grammars.matcher(regex, quote),
            None,
        ],
        torch.device("cpu"),
    )
    json_row, regex_row, free_row = (allowed(after_quote, r) for r in range(3))
    assert not json_row & set(control)  # inside a JSON string: no raw control character
    assert regex_row & set(control)  # the regex's [\s\S] admits them
    assert free_row >= set(range(4096))
    assert allowed(mixed, 2) >= set(range(4096))
    alone = grammars.masks([grammars.matcher(schema, quote)], torch.device("cpu"))
    both = grammars.masks([grammars.matcher(schema, quote)] * 2, torch.device("cpu"))
    assert allowed(alone, 0) == json_row == allowed(both, 0) == allowed(both, 1)


def test_masks_filled_over_threads_equal_one_thread(tiny_model_dir: Path) -> None:
    """32 constrained rows (JSON and regex) walked to their ends by random allowed tokens,
    each step's token handed over through ``advance``: the masks filled by four threads
    (rows dealt out among them) are the one thread's, step for step, and a matcher reads
    terminated exactly when xgrammar says so."""
    import random

    from transformers import AutoTokenizer

    from pdserve.engine.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = [SamplingParams(json_schema=json.dumps(SCHEMA)), SamplingParams(regex=r"[a-c]{2,5}-[0-9]{1,3}")]
    one, four = (Grammars(tokenizer, 4096, [tokenizer.eos_token_id], threads=n) for n in (1, 4))
    assert four.threads == 4
    rows = [[g.matcher(params[i % 2]) for i in range(32)] for g in (one, four)]
    rng = random.Random(5)
    advance: list[tuple[int, int] | None] | None = None
    for step in range(200):
        masks = [g.masks(ms, torch.device("cpu"), advance) for g, ms in zip((one, four), rows, strict=True)]
        assert torch.equal(masks[0], masks[1]), f"step {step}"
        for ms in rows:
            for m in ms:
                assert m.is_terminated == bool(m._matcher.is_terminated())
        if all(m.is_terminated for m in rows[0]):
            break
        bits = masks[0].numpy().view("uint32")
        tokens = []
        for r, m in enumerate(rows[0]):
            allowed = [w * 32 + b for w in range(bits.shape[1]) for b in range(32) if (int(bits[r, w]) >> b) & 1]
            tokens.append(None if m.is_terminated else (step, rng.choice(allowed)))
        advance = tokens
    else:
        raise AssertionError("the rows did not all end")
    assert all(m.seen > 0 for m in rows[1])


def test_a_vocabulary_wider_than_the_tokenizer_keeps_its_padding_out_of_xgrammar(tiny_model_dir: Path) -> None:
    """Logits wider than the tokenizer (a model's vocabulary rounded up): xgrammar knows the
    tokenizer's ids only (its padding ids would be "special tokens" that every accept scans);
    a constrained row refuses every padding id, a free row allows them, and the tokenizer's
    part of each mask is what a vocabulary of the tokenizer's size gives."""
    from transformers import AutoTokenizer

    from pdserve.engine.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    n = len(tokenizer)
    wide, exact = (
        Grammars(tokenizer, n + 3000, [tokenizer.eos_token_id]),
        Grammars(tokenizer, n, [tokenizer.eos_token_id]),
    )
    assert wide.text_vocab == n and len(wide._info.special_token_ids) == len(exact._info.special_token_ids)
    schema = SamplingParams(json_schema=json.dumps(SCHEMA))
    regex = SamplingParams(regex=r"[a-c]{2,5}")
    for step in range(3):  # the buffers in turn, each reused
        masks = wide.masks([wide.matcher(schema), None, wide.matcher(regex)], torch.device("cpu"))
        same = exact.masks([exact.matcher(schema), None, exact.matcher(regex)], torch.device("cpu"))
        assert masks.shape == (3, -(-(n + 3000) // 32)), step
        words = n // 32  # the tiny tokenizer's size is a multiple of 32
        assert torch.equal(masks[:, :words], same[:, :words])
        assert not masks[[0, 2], words:].any() and bool((masks[1] == -1).all())


def test_a_constrained_string_never_spells_a_utf16_surrogate(tiny_model_dir: Path) -> None:
    """xgrammar's character classes let 0xED be followed by 0xA0-0xBF: a UTF-16 surrogate,
    which is not UTF-8 and decodes as three U+FFFD (a JSON name of 10 characters by the
    grammar's count came back 12 long, CI stop 41 and 2026-12-04). A row whose output ends
    in a lone 0xED refuses the tokens that begin with 0xA0-0xBF, keeps 0x80-0x9F (U+D000-
    U+D7FF, Hangul among them); a JSON row never takes a token with a surrogate inside."""
    from transformers import AutoTokenizer

    from pdserve.engine.grammar import Grammars, _printable_mask, utf8_tail

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    grammars = Grammars(tokenizer, 4096, [tokenizer.eos_token_id])
    vocab = grammars._info.decoded_vocab

    def byte_token(b: int) -> int:
        return next(i for i, text in enumerate(vocab) if text == bytes([b]))

    def allowed(bitmask: torch.Tensor) -> set[int]:
        bits = bitmask[0].numpy().view("uint32")
        return {w * 32 + b for w in range(len(bits)) for b in range(32) if (int(bits[w]) >> b) & 1}

    schema = SamplingParams(json_schema=json.dumps({"type": "string"}))
    quote = [tokenizer.convert_tokens_to_ids('"')]
    ed = grammars.matcher(schema, [*quote, byte_token(0xED)])
    assert ed.after_ed
    after = allowed(grammars.masks([ed], torch.device("cpu")))
    assert byte_token(0x9F) in after and byte_token(0x80) in after  # U+D7C0..: real characters
    assert not {byte_token(b) for b in range(0xA0, 0xC0)} & after  # surrogates
    hangul = grammars.matcher(schema, [*quote, byte_token(0xED), byte_token(0x9E)])
    assert not hangul.after_ed  # two of three bytes in: the third is any continuation byte
    assert not grammars.matcher(schema, [*quote, byte_token(0xE8)]).after_ed
    # the static part, and the state machine
    bits = _printable_mask([b"a", b"\xed\xa0\x80", b"x\x01", b"\xed\x9e"], 4).numpy().view("uint32")
    assert int(bits[0]) & 0b1111 == 0b1001
    assert utf8_tail(b"ab\xed") == b"\xed" and utf8_tail(b"\xe8\xa9") == b"\xe8\xa9"
    assert (
        utf8_tail(b"\xe8\xa9\x9e") == b"" and utf8_tail(b"ab") == b"" and utf8_tail(b"\xf0\x9f\x98") == b"\xf0\x9f\x98"
    )
