"""Workloads: what each benchmark request asks for.

A request's prompt is built in one of three forms, chosen from the backend:

* ``ids`` — a list of token ids (``/generate`` ``input_ids`` or an OpenAI ``prompt`` list):
  exact prompt lengths; needs ``--tokenizer``.
* ``text`` — a string; its length is exact when a tokenizer is given (measured by encoding
  it) and otherwise estimated (about 4 characters per token). Servers that report usage
  replace the estimate with their own count.
* ``chat`` — a list of chat messages (``openai-chat``); lengths are estimates since the
  server applies its chat template.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("pdserve.bench")

WORDS = (
    "the of and to in is was for on are with as at be by this from that have or an they which one you were "
    "her all she there would their we him been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three states himself few house use during without "
    "again place around however home small found thought went say part once general high upon school every "
    "does got united left number course war until always away something fact though water less public put think "
    "almost hand enough far took head yet government system better set told nothing night end why called didn "
    "eyes find going look asked later knew point next program city business give group toward young days let room"
).split()

SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048
CHARS_PER_TOKEN = 4.0


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int] | list[dict[str, str]]
    prompt_len: int  # tokens: exact when ``exact`` else an estimate
    output_len: int
    exact: bool = False
    group: int | None = None
    conversation: int | None = None
    turn: int | None = None

    @property
    def is_chat(self) -> bool:
        return bool(self.prompt) and isinstance(self.prompt, list) and isinstance(self.prompt[0], dict)


# ---- tokenizer -----------------------------------------------------------------------
class Tokenizer:
    """A Hugging Face tokenizer loaded from a local path: the fast ``tokenizers`` library
    when there is a ``tokenizer.json`` (quick to import), ``transformers`` otherwise."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        self.path = str(p)
        self._hf: Any = None
        self._fast: Any = None
        if file.name.endswith(".json") and file.exists():
            from tokenizers import Tokenizer as FastTokenizer

            self._fast = FastTokenizer.from_file(str(file))
            special = set(self._fast.get_added_tokens_decoder())
            size = self._fast.get_vocab_size(with_added_tokens=True)
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(p))
            special = set(self._hf.all_special_ids) | set(getattr(self._hf, "added_tokens_decoder", {}) or {})
            size = len(self._hf)
        self.vocab_size = size
        self.normal_ids = [i for i in range(size) if i not in special]
        if not self.normal_ids:
            raise ValueError(f"tokenizer {path}: no ordinary tokens")

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=False).ids)
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return str(self._fast.decode(list(ids), skip_special_tokens=True))
        return str(self._hf.decode(list(ids), skip_special_tokens=True))

    def count(self, text: str) -> int:
        return len(self.encode(text))


def estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


# ---- building blocks ---------------------------------------------------------------------
class _Maker:
    """Random content of a given token length, in the requested form."""

    def __init__(self, rng: random.Random, tokenizer: Tokenizer | None, form: str) -> None:
        if form == "ids" and tokenizer is None:
            raise ValueError("token-id prompts need --tokenizer")
        self.rng = rng
        self.tok = tokenizer
        self.form = form

    def ids(self, n: int) -> list[int]:
        assert self.tok is not None
        return self.rng.choices(self.tok.normal_ids, k=n)

    def text(self, n: int) -> str:
        """About ``n`` tokens of text: decoded random ids with a tokenizer, else ~n tokens
        of random words (a word and its space are roughly 1.3 tokens in English BPEs, so
        use 3 words per 4 tokens)."""
        if self.tok is not None:
            return self.tok.decode(self.ids(n))
        return " ".join(self.rng.choices(WORDS, k=max(1, round(n * 0.75))))

    def length(self, text: str) -> tuple[int, bool]:
        if self.tok is not None:
            return self.tok.count(text), self.form == "text"
        return estimate_tokens(text), False


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    if not 0 <= ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1); got {ratio}")
    lo = max(1, math.floor(mean * (1 - ratio)))
    hi = max(lo, math.ceil(mean * (1 + ratio)) if ratio else mean)
    return [rng.randint(lo, hi) for _ in range(n)]


def length_bounds(mean: int, ratio: float) -> tuple[int, int]:
    lo = max(1, math.floor(mean * (1 - ratio)))
    return lo, max(lo, math.ceil(mean * (1 + ratio)) if ratio else mean)


# ---- random --------------------------------------------------------------------------
def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    tokenizer: Tokenizer | None,
    form: str,
    short_fraction: float = 0.0,
    short_len: int = 96,
) -> list[BenchRequest]:
    """Prompts and output lengths drawn uniformly from ``[len*(1-r), len*(1+r)]``; with
    ``short_fraction``, that share of the prompts (chosen at random) is drawn around
    ``short_len`` instead of ``input_len`` (a mixed workload of short and long prompts)."""
    if not 0.0 <= short_fraction <= 1.0:
        raise ValueError(f"--short-fraction must be in [0, 1]; got {short_fraction}")
    rng = random.Random(seed)
    make = _Maker(rng, tokenizer, form)
    ins = _lengths(rng, n, input_len, range_ratio)
    outs = _lengths(rng, n, output_len, range_ratio)
    if short_fraction:
        shorts = _lengths(rng, n, short_len, range_ratio)
        ins = [s if rng.random() < short_fraction else i for i, s in zip(ins, shorts, strict=True)]
    out: list[BenchRequest] = []
    for i_len, o_len in zip(ins, outs, strict=True):
        if form == "ids":
            out.append(BenchRequest(make.ids(i_len), i_len, o_len, exact=True))
            continue
        text = make.text(i_len)
        length, exact = make.length(text)
        prompt: Any = [{"role": "user", "content": text}] if form == "chat" else text
        out.append(BenchRequest(prompt, length, o_len, exact=exact))
    return out


# ---- ShareGPT ------------------------------------------------------------------------------
_HUMAN = {"human", "user"}
_GPT = {"gpt", "assistant", "chatgpt", "bard", "bing", "model"}


def sharegpt_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the reply that follows it) of every usable conversation."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        if not isinstance(entry, dict):
            continue
        convs = entry.get("conversations") or entry.get("conversation") or []
        if not isinstance(convs, list):
            continue
        for i in range(len(convs) - 1):
            a, b = convs[i], convs[i + 1]
            if not (isinstance(a, dict) and isinstance(b, dict)):
                break
            if a.get("from") in _HUMAN and b.get("from") in _GPT:
                q, r = a.get("value"), b.get("value")
                if isinstance(q, str) and isinstance(r, str) and q and r:
                    pairs.append((q, r))
                break
            if a.get("from") in _HUMAN:
                break  # the first human turn has no reply: skip the conversation
    return pairs


def sharegpt_requests(
    path: str | Path,
    n: int,
    seed: int,
    tokenizer: Tokenizer | None,
    form: str,
    fixed_output_len: int | None = None,
    max_prompt_len: int = SHAREGPT_MAX_PROMPT,
    max_total_len: int = SHAREGPT_MAX_TOTAL,
) -> list[BenchRequest]:
    """Shuffled (seeded) ShareGPT conversations, filtered as the usual tools do: prompt and
    reply at least 4 tokens, prompt at most 1024, prompt + reply at most 2048."""
    pairs = sharegpt_pairs(path)
    rng = random.Random(seed)
    rng.shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) >= n:
            break
        if tokenizer is not None:
            ids = tokenizer.encode(prompt)
            p_len = len(ids)
            o_len = fixed_output_len or tokenizer.count(reply)
        else:
            ids = []
            p_len = estimate_tokens(prompt)
            o_len = fixed_output_len or estimate_tokens(reply)
        if p_len < SHAREGPT_MIN_LEN or (fixed_output_len is None and o_len < SHAREGPT_MIN_LEN):
            continue
        if p_len > max_prompt_len or (fixed_output_len is None and p_len + o_len > max_total_len):
            continue
        if form == "ids":
            out.append(BenchRequest(ids, p_len, o_len, exact=True))
        elif form == "chat":
            out.append(BenchRequest([{"role": "user", "content": prompt}], p_len, o_len))
        else:
            out.append(BenchRequest(prompt, p_len, o_len, exact=tokenizer is not None))
    if not out:
        raise ValueError(f"{path}: no conversation passed the filters")
    if len(out) < n:
        log.warning("the ShareGPT file has %d usable conversations; reusing them for %d requests", len(out), n)
        out = [out[i % len(out)] for i in range(n)]
    return out


# ---- shared-prefix multi-turn chat -------------------------------------------------------
def prefix_chat_requests(
    n: int,
    num_groups: int,
    prefix_len: int,
    turn_len: int,
    output_len: int,
    num_turns: int,
    seed: int,
    tokenizer: Tokenizer | None,
    form: str,
) -> list[BenchRequest]:
    """``num_groups`` groups, each with its own system prompt of ``prefix_len`` tokens shared
    by all its conversations; each conversation has ``num_turns`` user turns of
    ``turn_len`` tokens. The request for turn ``t`` holds the system prompt, the earlier
    user turns and a fixed synthetic assistant reply (``output_len`` tokens) after each,
    then the new user turn; so a server with prefix caching reuses the system prompt
    across a group and the whole history across a conversation's turns. (The replies are
    synthetic rather than the server's own so the requests are independent of each other
    and identical across servers being compared.)

    Requests are ordered turn by turn (all first turns, then all second turns ...) so that
    a conversation's earlier turns are sent before its later ones; groups interleave.
    """
    if num_groups < 1 or num_turns < 1:
        raise ValueError("--num-groups and --num-turns must be at least 1")
    rng = random.Random(seed)
    make = _Maker(rng, tokenizer, form)
    per_group = max(1, math.ceil(n / (num_groups * num_turns)))

    def piece(length: int) -> Any:
        return make.ids(length) if form == "ids" else make.text(length)

    systems = [piece(prefix_len) for _ in range(num_groups)]
    convs = [
        [
            ([piece(turn_len) for _ in range(num_turns)], [piece(output_len) for _ in range(num_turns - 1)])
            for _ in range(per_group)
        ]
        for _ in range(num_groups)
    ]
    out: list[BenchRequest] = []
    for t in range(num_turns):
        for c in range(per_group):
            for g in range(num_groups):
                users, replies = convs[g][c]
                if form == "ids":
                    ids: list[int] = list(systems[g])
                    for k in range(t):
                        ids += users[k] + replies[k]
                    ids += users[t]
                    req = BenchRequest(ids, len(ids), output_len, exact=True)
                elif form == "chat":
                    msgs = [{"role": "system", "content": systems[g]}]
                    for k in range(t):
                        msgs += [{"role": "user", "content": users[k]}, {"role": "assistant", "content": replies[k]}]
                    msgs.append({"role": "user", "content": users[t]})
                    est = prefix_len + (t + 1) * turn_len + t * output_len
                    req = BenchRequest(msgs, est, output_len)
                else:
                    parts = [f"System: {systems[g]}"]
                    for k in range(t):
                        parts += [f"User: {users[k]}", f"Assistant: {replies[k]}"]
                    parts += [f"User: {users[t]}", "Assistant:"]
                    text = "\n\n".join(parts)
                    length, exact = make.length(text)
                    req = BenchRequest(text, length, output_len, exact=exact)
                req.group, req.conversation, req.turn = g, c, t
                out.append(req)
                if len(out) == n:
                    return out
    return out
