"""Incremental detokenization with the real byte-level BPE tokenizer, and stop-string cutting."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import regex
from transformers import AutoTokenizer

from pdserve.api import detokenizer
from pdserve.api.detokenizer import REGEX_HOLD, IncrementalDetokenizer, StopMatcher

TEXTS = [
    "請介紹一下你自己",
    "请介绍一下你自己，好吗？我想知道更多。",
    "Hello, world! How are you today?",
    "emoji 😀🚀👍🏽 and a ZWJ sequence 👩‍💻 then flags 🇯🇵🇫🇷",
    "mixed 中文 English 123 ½ ∑ Ω «» — “quotes” … ∞",
    "not in the corpus: 안녕하세요 مرحبا नमस्ते ሰላም 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𠜎𠜱",
    "  leading, trailing and    multiple   spaces  ",
    "line one\nline two\n\n\ttabbed\r\nwindows line\n",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "😀",
    "中",
    "🧑‍🤝‍🧑👨‍👩‍👧‍👦🏳️‍🌈",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _stream(tokenizer: Any, ids: list[int], step: int = 1, skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    return deltas


def test_texts_span_several_tokens_per_character(tokenizer: Any) -> None:
    """Sanity check of the fixture: some characters really are split across tokens."""
    split = 0
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        split += sum("\ufffd" in tokenizer.decode([i]) for i in ids)
    assert split > 20


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_reproduces_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == text  # NFC text round-trips through this tokenizer
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == full
    # valid text never shows a replacement character mid-stream
    assert not any("\ufffd" in d for d in deltas), deltas
    assert deltas[-1] == ""  # nothing was left over for flush


@pytest.mark.parametrize("step", [2, 3, 5])
@pytest.mark.parametrize("text", [TEXTS[0], TEXTS[3], TEXTS[5]])
def test_several_tokens_per_add(tokenizer: Any, text: str, step: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids, step)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_every_delta_is_whole_characters(tokenizer: Any) -> None:
    """Each emitted prefix of the stream is a prefix of the final text (never revised)."""
    text = "".join(TEXTS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    emitted = ""
    for i, token in enumerate(ids):
        emitted += detok.add([token])
        assert text.startswith(emitted), i
        # held back at most a few tokens (an incomplete character)
        assert len(detok.ids) - detok._read <= 4
    assert emitted + detok.flush() == text


def test_random_utf8_text(tokenizer: Any) -> None:
    rng = random.Random(0)
    alphabet = "abc xyz中文字符😀🚀👍🏽é\n\tΩ∑한국어"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        expected = tokenizer.decode(ids)
        deltas = _stream(tokenizer, ids)
        assert "".join(deltas) == expected
        assert not any("\ufffd" in d for d in deltas)


def test_special_tokens(tokenizer: Any) -> None:
    text = "Hello<|im_end|>\n<|im_start|>assistant\n中文"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=True)) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=False)) == tokenizer.decode(
        ids, skip_special_tokens=False
    )
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=False)) == text


def test_incomplete_character_is_held_then_flushed(tokenizer: Any) -> None:
    ids = tokenizer.encode("ab😀", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "\ufffd" in pieces[-1]  # the emoji's last byte(s) come in a separate token
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.add([i]) for i in ids[:-1])
    assert "\ufffd" not in out
    assert out == "ab"  # the incomplete emoji is held back
    # the stream ends without the last byte: flush gives what there is (a U+FFFD)
    tail = detok.flush()
    assert tail.startswith("\ufffd") or tail == ""
    assert detok.flush() == ""


def test_empty_add(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add([]) == ""
    assert detok.flush() == ""


# ---- StopMatcher ----------------------------------------------------------------------


def _feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    return "".join(matcher.feed(p) for p in pieces) + matcher.flush()


def _reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    hits = [(text.find(s), i, s) for i, s in enumerate(stops) if s and s in text]
    if not hits:
        return text, None
    pos, _, stop = min(hits)
    return text[:pos], stop


def test_no_stops_passes_everything_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == "abc"
    assert m.feed("") == ""
    assert m.flush() == ""
    assert m.matched is None
    assert StopMatcher(["", ""]).feed("xyz") == "xyz"  # empty stop strings are ignored


def test_cuts_before_stop_in_one_feed() -> None:
    m = StopMatcher(["END"])
    assert m.feed("hello END world") == "hello "
    assert m.matched == "END"
    assert m.feed("more") == ""
    assert m.flush() == ""


def test_earliest_stop_wins() -> None:
    m = StopMatcher(["world", "lo"])
    assert m.feed("hello world") == "hel"
    assert m.matched == "lo"
    m = StopMatcher(["o w", "d"])
    assert m.feed("hello world") == "hell"
    assert m.matched == "o w"


def test_stop_split_across_many_feeds() -> None:
    m = StopMatcher(["<|stop|>"])
    out = ""
    for ch in "answer: 42<|stop|> ignored":
        out += m.feed(ch)
    assert out == "answer: 42"
    assert m.matched == "<|stop|>"
    assert m.flush() == ""


def test_holds_back_only_possible_prefixes() -> None:
    m = StopMatcher(["world"])
    assert m.feed("hello wor") == "hello "  # "wor" may begin "world"
    assert m.buffer == "wor"
    assert m.feed("m") == "worm"  # it did not
    assert m.buffer == ""
    assert m.feed("w") == ""
    assert m.feed("x") == "wx"
    # a string that cannot begin any stop is emitted at once
    m = StopMatcher(["xyz"])
    assert m.feed("abc") == "abc"
    assert m.feed("ax") == "a"
    assert m.buffer == "x"
    assert m.flush() == "x"


def test_holds_longest_possible_prefix() -> None:
    m = StopMatcher(["abab c"])
    assert m.feed("xabab") == "x"
    assert m.buffer == "abab"
    assert m.feed("ab") == "ab"  # "ababab": the tail "abab" may still begin the stop
    assert m.buffer == "abab"
    assert m.feed(" c!") == ""
    assert m.matched == "abab c"


def test_flush_returns_held_tail_without_match() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("the end ST") == "the end "
    assert m.flush() == "ST"
    assert m.matched is None
    assert m.flush() == ""


def test_match_across_held_tail_and_new_text() -> None:
    m = StopMatcher(["</s>", "\n\n"])
    assert m.feed("line\n") == "line"
    assert m.feed("\nmore") == ""
    assert m.matched == "\n\n"


def test_stop_at_very_start() -> None:
    m = StopMatcher(["Q:"])
    assert m.feed("Q:") == ""
    assert m.matched == "Q:"


def _independent(stops: list[str]) -> bool:
    return not any(a != b and a in b for a in stops for b in stops)


def test_random_splits_match_reference() -> None:
    """Cut exactly at the earliest stop however the text is split into feeds.

    (Stops that are substrings of other stops are left out: there the streamed answer
    rightly depends on which completes first.)
    """
    rng = random.Random(0)
    alphabet = "ab c\n中😀"
    checked = 0
    while checked < 400:
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        if not _independent(stops):
            continue
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        expected, stop = _reference(text, stops)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(0, 12))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        m = StopMatcher(stops)
        emitted = ""
        for piece in pieces:
            emitted += m.feed(piece)
            assert expected.startswith(emitted)
            # only a possible stop prefix is ever held back
            if m.matched is None and m.buffer:
                assert any(s.startswith(m.buffer[i:]) for s in stops for i in range(len(m.buffer)))
                assert len(m.buffer) < max(map(len, stops))
        emitted += m.flush()
        assert emitted == expected, (text, stops, pieces)
        assert m.matched == stop
        checked += 1


def test_detokenizer_and_stop_matcher_together(tokenizer: Any) -> None:
    text = "第一行答案😀\n\n第二行"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    m = StopMatcher(["😀\n\n"])
    out = "".join(m.feed(detok.add([i])) for i in ids) + m.feed(detok.flush()) + m.flush()
    assert out == "第一行答案"


# ---- StopMatcher: stop_regex ---------------------------------------------------------


@pytest.mark.parametrize(
    ("patterns", "stops", "text", "out", "matched", "matched_text"),
    [
        ([r"\d+\."], [], "step 12. then", "step ", r"\d+\.", "12."),
        ([r"\n\n+"], [], "a\nb\n\n\nc", "a\nb", r"\n\n+", None),  # (its length: as the pieces came)
        ([r"(?i)the end"], ["zzz"], "and THE END", "and ", r"(?i)the end", "THE END"),
        ([r"b+"], ["a"], "xa bb", "x", "a", "a"),  # the earliest of strings and patterns
        ([r"[.!?] "], [], "no stop here", "no stop here", None, ""),
        ([r"\b", r"x(?=y)"], [], "ab xz xy", "ab xz ", r"x(?=y)", "x"),  # an empty match is no stop
    ],
)
def test_a_stop_regex_cuts_the_text_before_its_first_match_in_any_pieces(
    patterns: list[str], stops: list[str], text: str, out: str, matched: str | None, matched_text: str | None
) -> None:
    """The text stops as soon as a match is there: a greedy pattern's match is as long as
    the pieces had made it by then."""
    for size in (1, 2, 3, len(text)):
        m = StopMatcher(stops, patterns)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert _feed_all(m, pieces) == out, size
        assert m.matched == matched
        if matched_text is not None:
            assert m.matched_text == matched_text
        elif matched is not None:
            assert regex.fullmatch(matched, m.matched_text) and text.startswith(out + m.matched_text)


def test_a_stop_regex_holds_back_what_may_begin_a_match_and_no_more_than_its_limit() -> None:
    m = StopMatcher([], [r"</answer>"])
    assert m.feed("42 </ans") == "42 "
    assert m.buffer == "</ans"
    assert m.feed("wers") == "</answers"  # it did not match
    # a match that may run on is held up to REGEX_HOLD characters: a longer one is not found
    short = StopMatcher([], [r"a[^!]*END"])
    assert short.feed("x a" + "b" * 100) == "x "
    assert short.feed("bEND!") == "" and short.matched_text == "a" + "b" * 101 + "END"
    long = StopMatcher([], [r"a[^!]*END"])
    assert long.feed("x a" + "b" * 100) == "x "
    assert long.feed("b" * (REGEX_HOLD + 1)) == "a" + "b" * (REGEX_HOLD + 101)
    assert long.feed("END!") + long.flush() == "END!" and long.matched is None


def test_a_stop_regex_past_its_time_limit_is_given_up_and_counted() -> None:
    """A pattern that backtracks without end (here once the text is 30 characters long) stops
    nothing after its first search past the limit; the text flows; the API counts it."""
    before = detokenizer.TIMEOUTS[0]
    m = StopMatcher(["END"], [r"(?:.|..)+$a", r"b{3}"])
    assert m.feed("a" * 10) == ""  # it may begin a match: held
    assert m.feed("a" * 40) == "a" * 50 and detokenizer.TIMEOUTS[0] == before + 1
    assert [p for p, _ in m.patterns] == [r"b{3}"]
    assert m.feed("xbbbEND") == "x" and m.matched == r"b{3}"
