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

    def __init__(self, matcher: Any, json: bool = False) -> None:
        self._matcher = matcher
        self.json = json
        self.seen = 0  # output tokens taken so far
        # A matcher terminates only on accepting a stop token: asked only then (each call
        # into xgrammar costs 1-2 us, and a step asked every row two or three times).
        self._stops = frozenset(matcher.stop_token_ids)
        self._terminated = bool(matcher.is_terminated())

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar refuses it (the mask should prevent that)."""
        self.seen += 1
        if self._terminated:
            return False
        ok = bool(self._matcher.accept_token(token))
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

    @property
    def is_terminated(self) -> bool:
        return self._terminated

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe (a worker compiles
    in a thread at admission, the engine makes matchers on its loop)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = (), threads: int | None = None
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        stop = list(stop_token_ids) or None
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=2)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self._plain = _printable_mask(self._info.decoded_vocab, vocab_size)
        # Pinned host masks for a device, in turn (the one written is never one still on
        # its way over: its copy's event is waited for first).
        self._staged: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._next_stage = 0
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
        m = Matcher(self._xgr.GrammarMatcher(self.compile(sampling)), json=sampling.json_schema is not None)
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
        ``(index, token)`` its matcher takes first (``Matcher.accept_at``), or ``None``."""
        rows = len(matchers)
        if device.type == "cpu":
            bitmask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
            json_rows = self._fill(matchers, bitmask, advance)
            if json_rows:  # numpy's AND: torch's would wake its intra-op threads for 1 MB
                view, plain_row = bitmask.numpy(), self._plain.numpy()
                if len(json_rows) == rows:
                    np.bitwise_and(view, plain_row, out=view)
                else:
                    view[json_rows] &= plain_row
            return bitmask
        # A pageable source would make the copy wait, with the host, for the forward pass
        # queued before it: the masks are filled while that pass runs, into pinned memory.
        host, copied = self._stage(rows)
        bitmask = host[:rows]
        json_rows = self._fill(matchers, bitmask, advance)
        on_device = bitmask.to(device, non_blocking=True)
        copied.record()
        if json_rows:  # xgrammar's JSON strings admit raw control characters; strict parsers do not
            plain = self._plain_on.get(device)
            if plain is None:
                plain = self._plain_on[device] = self._plain.to(device)
            if len(json_rows) == rows:
                on_device &= plain  # on the device: no CPU threads woken for it
            else:
                for row in json_rows:  # views: no index list to copy over, no host wait
                    on_device[row] &= plain
        return on_device

    def _fill(
        self,
        matchers: Sequence[Matcher | None],
        bitmask: torch.Tensor,
        advance: Sequence[tuple[int, int] | None] | None,
    ) -> list[int]:
        """Advance each row's matcher and write its whole mask row (xgrammar writes every
        word of the row; a row without a live matcher allows everything), the rows dealt
        out over the pool's threads; returns the JSON rows. No torch CPU operation on the
        whole tensor: it would wake torch's intra-op threads, which then spin on the cores
        the grammar threads want."""
        view = bitmask.numpy()
        live = [row for row, m in enumerate(matchers) if m is not None]
        view[[row for row, m in enumerate(matchers) if m is None]] = -1

        def work(rows: Sequence[int]) -> None:
            for row in rows:
                m = matchers[row]
                assert m is not None
                if advance is not None and (step := advance[row]) is not None:
                    m.accept_at(*step)
                if m.is_terminated:  # a finished row's token is discarded
                    view[row] = -1
                else:
                    m.fill(bitmask, row)

        parts = min(self.threads, len(live) // ROWS_PER_THREAD)
        if self._pool is None or parts < 2:
            work(live)
        else:
            list(self._pool.map(work, [live[i::parts] for i in range(parts)]))
        return [row for row in live if matchers[row].json]  # type: ignore[union-attr]

    def _stage(self, rows: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        if not self._staged or self._staged[0][0].shape[0] < rows:
            words = -(-self.vocab_size // 32)
            capacity = max(rows, 64)
            self._staged = [
                (torch.empty((capacity, words), dtype=torch.int32, pin_memory=True), torch.cuda.Event())
                for _ in range(2)
            ]
        host, copied = self._staged[self._next_stage]
        self._next_stage ^= 1
        copied.synchronize()  # its last copy has left
        return host, copied


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of the tokens ``bitmask`` forbids to -inf, in place (float32, contiguous)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask)


def _printable_mask(decoded_vocab: Sequence[bytes], vocab_size: int) -> torch.Tensor:
    """A bitmask row allowing every token whose text holds no control character (bytes
    below 0x20): what JSON allows unescaped, and all that compact JSON needs."""
    allowed = np.zeros(-(-vocab_size // 32) * 32, dtype=np.uint64)
    for i, text in enumerate(decoded_vocab[:vocab_size]):
        allowed[i] = not any(b < 0x20 for b in text)
    words = (allowed.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
