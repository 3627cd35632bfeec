"""Incremental detokenization and exact stop-string cutting for streamed output."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import regex

from pdserve.schemas.sampling import stop_match, stop_pattern

log = logging.getLogger(__name__)
TIMEOUTS = [0]  # stop_regex patterns this process gave up (a search past its time limit)

# Characters of text a stop_regex's partial match at the end may hold back (a pattern such as
# ``.*END`` could otherwise hold the whole text): past them, text streams as it comes
REGEX_HOLD = 256


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window (from the last emitted boundary), and holds back a
    delta that ends in an incomplete UTF-8 sequence (U+FFFD) until the next token
    completes it, so multi-byte characters split across tokens come out whole.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        # A fast tokenizer's own decode gives the same text when no clean-up runs after it,
        # without the wrapper's per-call conversions (a tenth of the API's time per token).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", True) else backend

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens))
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character comes out as U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


class StopMatcher:
    """Cuts text at the first stop string or stop_regex match; holds back a tail that may
    begin one (a regex's partial match, at most :data:`REGEX_HOLD` characters of it).
    ``matched``: the stop string or the pattern that ended the text; ``matched_text``: the
    text it matched."""

    def __init__(self, stops: Sequence[str], regexes: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.patterns = [(p, c) for p in regexes if (c := stop_pattern(p)) is not None]
        self.buffer = ""
        self.matched: str | None = None
        self.matched_text = ""

    def feed(self, text: str) -> str:
        """Text safe to emit now. After a match, returns nothing more."""
        if self.matched is not None:
            return ""
        if not self.stops and not self.patterns:
            return text
        self.buffer += text
        first: tuple[int, int, str] | None = None  # (start, end, what matched)
        for s in self.stops:
            i = self.buffer.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, i + len(s), s)
        for p, compiled in list(self.patterns):
            m = self._search(p, compiled, self.buffer)
            if m is not None and (first is None or m.start() < first[0]):
                first = (m.start(), m.end(), p)
        if first is not None:
            self.matched, self.matched_text = first[2], self.buffer[first[0] : first[1]]
            out, self.buffer = self.buffer[: first[0]], ""
            return out
        hold = self._partial_tail()
        for p, compiled in list(self.patterns):
            m = self._search(p, compiled, self.buffer[-REGEX_HOLD:], partial=True)
            if m is not None:
                hold = max(hold, min(len(self.buffer), REGEX_HOLD) - m.start())
        out = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(self.buffer) - hold :]
        return out

    def _search(
        self, pattern: str, compiled: regex.Pattern[str], text: str, partial: bool = False
    ) -> regex.Match[str] | None:
        """:func:`stop_match`; a pattern whose search runs past its time limit is given up for
        this text (it stops nothing after), counted in :data:`TIMEOUTS` and logged."""
        try:
            return stop_match(compiled, text, partial)
        except TimeoutError:
            self.patterns = [(p, c) for p, c in self.patterns if p != pattern]
            TIMEOUTS[0] += 1
            log.warning("a stop_regex took too long: not searched again", extra={"pattern": pattern[:64]})
            return None

    def flush(self) -> str:
        if self.matched is not None:
            return ""
        out, self.buffer = self.buffer, ""
        return out

    def _partial_tail(self) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buffer)), best, -1):
                if self.buffer.endswith(s[:k]):
                    best = k
                    break
        return best
