"""Structured output: JSON Schema, regular-expression and EBNF constraints as token masks.

xgrammar compiles a constraint against the model's vocabulary once (cached by its text)
and keeps one matcher per sequence; before each step the host fills the masks of the
constrained rows (a few tens of microseconds each, while the device runs the forward pass
it has just been given), and the sampler applies them to the logits. The matcher
advances with every token the sequence keeps; when it completes, the sequence may end
only as the grammar allows (it then stops at end of sequence). xgrammar releases the GIL
inside its calls, so a step's rows can be dealt out to threads (``--grammar-threads``),
each advancing its rows' matchers by the previous step's token and filling their masks.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from pdserve.schemas import SamplingParams

MAX_COMPILED = 256  # constraints kept compiled (LRU)
ROWS_PER_THREAD = 8  # fewer constrained rows than this a thread are not worth handing out


# Threads that advance matchers and fill masks by default. Spreading 64 rows over 2-8 threads
# measured no better on the H200 machines' 16 cores (bench/grammar_host.py: 9.3 ms a step on
# one thread, 7.8 on two, 9.6 on four, 11.5 on eight).
DEFAULT_GRAMMAR_THREADS = 1


class GrammarError(ValueError):
    """A constraint that does not compile (a malformed schema, regex or grammar)."""


def check_constraint(kind: str, spec: str) -> None:
    """Raise :class:`GrammarError` unless ``spec`` parses as a ``kind`` constraint (no
    tokenizer needed: what the API checks before it publishes)."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(spec)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(spec)
        else:
            raise GrammarError(f"unknown constraint kind {kind!r}")
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(f"the {kind} constraint does not compile: {_first_line(exc)}") from None


class Matcher:
    """One sequence's place in its grammar. ``json``: its grammar is a JSON Schema's."""

    def __init__(self, matcher: Any, json: bool = False, vocab: Sequence[bytes] = ()) -> None:
        self._matcher = matcher
        self.json = json
        self._vocab = vocab  # each token's bytes (xgrammar's decoded vocabulary)
        self._tail = b""  # the output's trailing bytes of a UTF-8 sequence not yet complete
        self.seen = 0  # output tokens taken so far
        self.refused: list[tuple[int, int]] = []  # (output index, token) the grammar refused: a bug
        # A matcher terminates only on accepting a stop token: asked only then (each call
        # into xgrammar costs 1-2 us, and a step asked every row two or three times).
        self._stops = frozenset(matcher.stop_token_ids)
        self._terminated = bool(matcher.is_terminated())
        self._trial: list[tuple[bytes, bool]] = []  # draft tokens taken on trial: the state before each

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar refuses it (the mask should prevent that)."""
        self.seen += 1
        if self._terminated:
            return False
        ok = bool(self._matcher.accept_token(token))
        if not ok:  # sampled under this matcher's own mask: never expected (the engine counts it)
            self.refused.append((self.seen - 1, token))
        elif token < len(self._vocab):
            self._tail = utf8_tail(self._tail + self._vocab[token])
        if ok and token in self._stops:
            self._terminated = bool(self._matcher.is_terminated())
        return ok

    def accept_at(self, index: int, token: int) -> None:
        """Advance by output token ``index`` unless it was taken already: an overlapped step
        hands the matcher its token early, before the token is appended (see
        ``Engine._catch_up``)."""
        if index == self.seen:
            self.accept(token)
        elif index > self.seen:
            raise AssertionError(f"output token {index} reached a matcher that has taken {self.seen}")

    def try_accept(self, token: int) -> bool:
        """Advance by a speculative draft token on trial, if this row's mask would allow it
        (the grammar takes it; a JSON row, no control character or surrogate in it; after a
        lone 0xED, no 0xA0-0xBF first byte); False, and no change, if not. Not output
        (``seen`` stays); :meth:`undo` rolls the trial tokens back."""
        if self._terminated:
            return False
        text = self._vocab[token] if token < len(self._vocab) else b""
        if text and ((self.json and not _printable(text)) or (self._tail == b"\xed" and 0xA0 <= text[0] < 0xC0)):
            return False
        if not self._matcher.accept_token(token):
            return False
        self._trial.append((self._tail, self._terminated))
        if token < len(self._vocab):
            self._tail = utf8_tail(self._tail + text)
        if token in self._stops:
            self._terminated = bool(self._matcher.is_terminated())
        return True

    def undo(self) -> None:
        """Roll back the draft tokens :meth:`try_accept` took (xgrammar's rollback)."""
        if self._trial:
            self._matcher.rollback(len(self._trial))
            self._tail, self._terminated = self._trial[0]
            self._trial.clear()

    def draft_prefix(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar takes in turn, each one its row's
        mask would allow after the ones before it (:meth:`try_accept`); the matcher is left
        where it was."""
        n = 0
        try:
            for token in draft:
                if not self.try_accept(token):
                    break
                n += 1
        finally:
            self.undo()
        return n

    @property
    def is_terminated(self) -> bool:
        return self._terminated

    @property
    def after_ed(self) -> bool:
        """Whether the output ends in a lone 0xED lead byte, which xgrammar lets a continuation
        byte 0xA0-0xBF follow: a UTF-16 surrogate, not UTF-8 (it decodes as three U+FFFD)."""
        return self._tail == b"\xed"

    def fill(self, row: torch.Tensor) -> None:
        """Write the next token's mask into ``row`` (one contiguous row of words)."""
        self._matcher.fill_next_token_bitmask(row)


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe (a worker compiles
    in a thread at admission, the engine makes matchers on its loop)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = (), threads: int | None = None
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        stop = list(stop_token_ids) or None
        # xgrammar is told the tokenizer's ids only: the logits' padding ids past them (a model's
        # vocabulary rounded up) would be its "special tokens", which every accept scans (41 us
        # an accept with 147,712 of them, 7 with none). A constrained row never allows them.
        self.text_vocab = min(vocab_size, max(len(tokenizer), max(stop_token_ids, default=-1) + 1))
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.text_vocab, stop_token_ids=stop)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=2)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self._words = -(-self.text_vocab // 32)  # the words xgrammar writes of a row
        # each token's bytes, read once: xgrammar builds the list anew at every access (100 ms
        # at a 150k vocabulary), and every matcher holds it
        self._vocab: list[bytes] = self._info.decoded_vocab
        self._plain = _printable_mask(self._vocab, self.text_vocab)  # the words xgrammar writes
        # xgrammar's character classes admit UTF-16 surrogates (0xED 0xA0-0xBF ...), which are not
        # UTF-8: a row whose output ends in 0xED refuses tokens that begin with 0xA0-0xBF.
        self._not_after_ed = _first_byte_mask(self._vocab, self.text_vocab, range(0xA0, 0xC0)).numpy()
        # Host masks in turn, pinned for a device (the one written is never one still on its
        # way over: its copy's event is waited for first), with a view of each row's words.
        self._staged: list[list[_Stage]] = [[], []]  # masks' and draft masks' (speculative verifies)
        self._next_stage = [0, 0]
        self._plain_on: dict[torch.device, torch.Tensor] = {}
        # xgrammar lets go of the GIL inside accept and fill: rows spread over threads run at once.
        self.threads = DEFAULT_GRAMMAR_THREADS if threads is None else max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, "grammar") if self.threads > 1 else None

    def compile(self, sampling: SamplingParams) -> Any:
        """The compiled constraint of ``sampling`` (cached); :class:`GrammarError` if it does not compile."""
        constraint = sampling.constraint
        assert constraint is not None
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
                return compiled
        kind, spec = constraint
        try:
            if kind == "json_schema":
                compiled = self._compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(spec)
            elif kind == "structural_tag":
                compiled = self._compiler.compile_structural_tag(spec)
            else:
                compiled = self._compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"the {kind} constraint does not compile: {_first_line(exc)}") from None
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, sampling: SamplingParams, output_ids: Sequence[int] = ()) -> Matcher:
        """A matcher at the start of ``sampling``'s constraint, advanced past ``output_ids``
        (a resumed request's tokens); :class:`GrammarError` if they break the grammar."""
        m = Matcher(
            self._xgr.GrammarMatcher(self.compile(sampling)),
            json=sampling.json_schema is not None,
            vocab=self._vocab,
        )
        for token in output_ids:
            if not m.accept(token):
                raise GrammarError("the tokens already generated do not follow the constraint")
        return m

    def masks(
        self,
        matchers: Sequence[Matcher | None],
        device: torch.device,
        advance: Sequence[tuple[int, int] | None] | None = None,
    ) -> torch.Tensor:
        """The rows' token bitmasks (``int32 [rows, ceil(vocab / 32)]``, on ``device``); a row
        without a matcher allows every token. ``advance``: per row, an output token
        ``(index, token)`` its matcher takes first (``Matcher.accept_at``), or ``None``.
        On the CPU the masks are a host buffer used in turn with one other: valid until the
        call after next (the sampler applies them at once)."""
        rows = len(matchers)
        stage = self._stage(rows, pinned=device.type != "cpu")
        json_rows = self._fill(matchers, stage, rows, advance)
        return self._finish(stage, rows, json_rows, device)

    def draft_masks(self, drafts: Sequence[tuple[Matcher | None, Sequence[int]]], device: torch.device) -> torch.Tensor:
        """The bitmasks of speculative verify rows: ``len(draft) + 1`` rows a sequence, row
        ``t`` its grammar's mask after ``draft[:t]`` (the matcher walks the draft on trial and
        is rolled back: ``Matcher.try_accept``, ``undo``); a sequence without a matcher allows
        every token. If the grammar refuses ``draft[t]`` (drafts are cut before, so never
        expected), the rows after it repeat row ``t``: that row refuses ``draft[t]``, so no
        row after it is read. Buffers of their own, two in turn, as :meth:`masks`'s."""
        rows = sum(len(draft) + 1 for _, draft in drafts)
        stage = self._stage(rows, pinned=device.type != "cpu", ring=1)
        view = stage.host[:rows].numpy()
        dirty = stage.tail_dirty
        json_rows: list[int] = []
        start = 0
        for m, draft in drafts:
            end = start + len(draft) + 1
            if m is None:
                view[start:end] = -1
                if dirty is not None:
                    dirty[start:end] = True
                start = end
                continue
            if dirty is not None:
                view[start:end, self._words :] = 0
                dirty[start:end] = False
            if m.json:
                json_rows += range(start, end)
            try:
                for row, token in zip(range(start, end), [*draft, None], strict=True):
                    self._fill_row(m, stage, view, row)
                    if token is not None and not m.try_accept(token):
                        view[row + 1 : end] = view[row]
                        if dirty is not None:
                            dirty[row + 1 : end] = dirty[row]
                        break
            finally:
                m.undo()
            start = end
        return self._finish(stage, rows, json_rows, device)

    def _finish(self, stage: _Stage, rows: int, json_rows: list[int], device: torch.device) -> torch.Tensor:
        """The filled masks of ``stage`` on ``device``, JSON rows without control characters."""
        bitmask = stage.host[:rows]
        words = self._words
        if device.type == "cpu":
            if json_rows:  # numpy's AND: torch's would wake its intra-op threads for 1 MB
                view, plain_row = bitmask.numpy(), self._plain.numpy()
                if len(json_rows) == rows:
                    np.bitwise_and(view[:, :words], plain_row, out=view[:, :words])
                else:
                    view[json_rows, :words] &= plain_row
            return bitmask
        # A pageable source would make the copy wait, with the host, for the forward pass
        # queued before it: the masks are filled while that pass runs, into pinned memory.
        on_device = bitmask.to(device, non_blocking=True)
        assert stage.copied is not None
        stage.copied.record()
        if json_rows:  # xgrammar's JSON strings admit raw control characters; strict parsers do not
            plain = self._plain_on.get(device)
            if plain is None:
                plain = self._plain_on[device] = self._plain.to(device)
            if len(json_rows) == rows:
                on_device[:, :words] &= plain  # on the device: no CPU threads woken for it
            else:
                for row in json_rows:  # views: no index list to copy over, no host wait
                    on_device[row, :words] &= plain
        return on_device

    def _fill(
        self,
        matchers: Sequence[Matcher | None],
        stage: _Stage,
        rows: int,
        advance: Sequence[tuple[int, int] | None] | None,
    ) -> list[int]:
        """Advance each row's matcher and write its mask row, the rows dealt out over the
        pool's threads; returns the JSON rows. xgrammar writes the words of the tokenizer's
        ids (``stage.row_views``); a constrained row refuses the padding ids after them; a
        row without a live matcher allows everything. No torch CPU operation on the whole
        tensor: it would wake torch's intra-op threads, which then spin on the cores the
        grammar threads want."""
        view = stage.host[:rows].numpy()
        live = [row for row, m in enumerate(matchers) if m is not None]
        idle = [row for row, m in enumerate(matchers) if m is None]
        view[idle] = -1
        dirty = stage.tail_dirty  # rows whose padding words are not all zero
        if dirty is not None:
            clean = [row for row in live if dirty[row]]
            view[clean, self._words :] = 0
            dirty[clean] = False
            dirty[idle] = True

        def work(part: Sequence[int]) -> None:
            for row in part:
                m = matchers[row]
                assert m is not None
                if advance is not None and (step := advance[row]) is not None:
                    m.accept_at(*step)
                self._fill_row(m, stage, view, row)

        parts = min(self.threads, len(live) // ROWS_PER_THREAD)
        if self._pool is None or parts < 2:
            work(live)
        else:
            list(self._pool.map(work, [live[i::parts] for i in range(parts)]))
        return [row for row in live if matchers[row].json]  # type: ignore[union-attr]

    def _fill_row(self, m: Matcher, stage: _Stage, view: np.ndarray, row: int) -> None:
        """Write ``m``'s next-token mask into ``row`` (its padding words already zero)."""
        if m.is_terminated:  # a finished row's token is discarded
            view[row] = -1
            if stage.tail_dirty is not None:
                stage.tail_dirty[row] = True
        else:
            m.fill(stage.row_views[row])
            if m.after_ed:
                view[row, : self._words] &= self._not_after_ed

    def _stage(self, rows: int, pinned: bool, ring: int = 0) -> _Stage:
        """The next host buffer of at least ``rows`` rows (two in turn per ``ring``: 0 for
        :meth:`masks`, 1 for :meth:`draft_masks`; pinned: its last copy to the device waited
        for)."""
        staged = self._staged[ring]
        if not staged or staged[0].host.shape[0] < rows or (staged[0].copied is not None) != pinned:
            staged[:] = [_Stage(max(rows, 64), self._words, -(-self.vocab_size // 32), pinned) for _ in range(2)]
        stage = staged[self._next_stage[ring]]
        self._next_stage[ring] ^= 1
        if stage.copied is not None:
            stage.copied.synchronize()  # its last copy has left
        return stage


class _Stage:
    """A host buffer of masks (``capacity`` rows of ``width`` words), the views of its rows'
    first ``words`` words (made once: xgrammar fills a 1-D view from its start and ignores
    the strides of a 2-D one), and, where ``words < width``, which rows' padding words may
    be nonzero."""

    def __init__(self, capacity: int, words: int, width: int, pinned: bool) -> None:
        self.host = torch.zeros((capacity, width), dtype=torch.int32, pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None
        self.row_views = [self.host[r, :words] for r in range(capacity)]
        self.tail_dirty = np.zeros(capacity, dtype=bool) if words < width else None


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of the tokens ``bitmask`` forbids to -inf, in place (float32, contiguous)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask)


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")  # a UTF-16 surrogate as UTF-8 would spell it: not UTF-8


def _words_of(allowed: np.ndarray) -> torch.Tensor:
    words = (allowed.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _printable_mask(decoded_vocab: Sequence[bytes], text_vocab: int) -> torch.Tensor:
    """A bitmask row over the first ``text_vocab`` ids allowing every token whose text holds
    no control character (bytes below 0x20): what JSON allows unescaped, and all that
    compact JSON needs; nor a UTF-16 surrogate inside it (0xED 0xA0-0xBF: not UTF-8)."""
    allowed = np.zeros(-(-text_vocab // 32) * 32, dtype=np.uint64)
    for i, text in enumerate(decoded_vocab[:text_vocab]):
        allowed[i] = _printable(text)
    return _words_of(allowed)


def _printable(text: bytes) -> bool:
    """Whether a JSON row may take a token of ``text``: no control character, no surrogate."""
    return not _SURROGATE.search(text) and not any(b < 0x20 for b in text)


def _first_byte_mask(decoded_vocab: Sequence[bytes], text_vocab: int, refused: range) -> torch.Tensor:
    """A bitmask row over the first ``text_vocab`` ids refusing the tokens whose first byte
    is in ``refused`` (every bit of the padding past them set: AND leaves it as it was)."""
    allowed = np.ones(-(-text_vocab // 32) * 32, dtype=np.uint64)
    for i, text in enumerate(decoded_vocab[:text_vocab]):
        allowed[i] = not (text and text[0] in refused)
    return _words_of(allowed)


def utf8_tail(data: bytes) -> bytes:
    """The trailing bytes of ``data`` that begin a UTF-8 sequence not yet complete (b"" if
    none): a lead byte and the continuation bytes after it, fewer than it announces."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:
            continue  # a continuation byte: the lead is further back
        need = 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
        return data[-back:] if need > back else b""
    return b""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
