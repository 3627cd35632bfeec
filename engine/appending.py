"""The engine's outputs: a step's token appended to its sequence (first token, hand-off
hold, stop checks) and a verify's tokens appended up to the first that stops. A part of
:class:`~pdserve.engine.engine.Engine`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.engine.outputs import EngineStats, RequestOutput, VerifyResult
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, Status
from pdserve.engine.speculative import Speculator
from pdserve.schemas import TokenLogprob
from pdserve.schemas.sampling import stop_match, stop_pattern

log = logging.getLogger(__name__)

# A worker looks for a stop_regex match in the text of the output's last this many tokens
STOP_REGEX_TOKENS = 64


class Appending:
    """Appending tokens to sequences; the engine's state it reads is declared here."""

    stats: EngineStats
    scheduler: Scheduler
    speculator: Speculator | None
    seqs: dict[str, Sequence]
    held: dict[str, Sequence]
    eos_token_ids: frozenset[int]
    detokenize: Callable[[list[int]], str] | None
    max_model_len: int

    if TYPE_CHECKING:

        def _drop(self, seq: Sequence, reason: str) -> None: ...  # Admission's

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None, was_decode: bool) -> RequestOutput:
        first = not was_decode and seq.status is Status.WAITING
        scores = None
        if first and seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
            if not seq.forked:  # the samples of one request share its prompt
                self.stats.prompt_tokens += len(seq.prompt_ids)
                self.stats.cached_tokens += seq.num_cached
            if seq.prompt_scores is not None:  # sent once; a recompute after preemption may use the cache
                assert seq.prompt_scores.num == len(seq.prompt_ids) - 1, "prompt scored in part"
                scores, seq.prompt_scores = seq.prompt_scores.wire(), None
                if seq.shared_scores is not None:  # an n > 1 request's head: its samples' too
                    seq.shared_scores[0] = scores
            elif seq.shared_scores is not None:  # a sample: its head came first (the step's order)
                scores = seq.shared_scores[0]
                assert scores is not None, "a sample's first token before its head's"
            seq.shared_scores = None
        seq.output_ids.append(token)
        self.stats.generated_tokens += 1
        if seq.matcher is not None:
            self._to_grammar(seq, token)
        reason, stop = self._check_stop(seq, token)
        out = RequestOutput(
            rid=seq.out_rid,
            index=len(seq.output_ids) - 1,
            token_ids=[token],
            logprobs=[logprob] if logprob is not None else None,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            cached_tokens=seq.num_cached,
            group=seq.group,
            prompt_logprobs=scores,
        )
        if first and seq.prefill_only and seq.forked:  # a sample's first token, for the hand-off
            out.finish_reason, out.stop_reason = reason, stop
            out.held = reason is None
            seq.status = Status.FINISHED
        elif first and seq.prefill_only and seq.group:
            # The KV stays held for the other samples even if this one ends here.
            out.finish_reason, out.stop_reason = reason, stop
            out.held = True
            self.scheduler.remove(seq, keep_pages=True)
            self.seqs.pop(seq.rid, None)
            seq.status = Status.HELD
            self.held[seq.rid] = seq
        elif reason is not None:
            out.finish_reason, out.stop_reason = reason, stop
            seq.finish_reason, seq.stop_reason = reason, stop
            self._drop(seq, reason)
        elif first and seq.prefill_only:
            self.scheduler.remove(seq, keep_pages=True)
            self.seqs.pop(seq.rid, None)
            seq.status = Status.HELD
            self.held[seq.rid] = seq
            out.held = True
        elif first:
            self.scheduler.start_running(seq)
        return out

    def _to_grammar(self, seq: Sequence, token: int) -> None:
        """``seq``'s matcher takes its newest output token ``token`` (unless it has already)."""
        seq.matcher.accept_at(len(seq.output_ids) - 1, token)
        if seq.matcher.refused:  # its mask should have made that impossible: loud, counted
            index, refused = seq.matcher.refused.pop()
            self.stats.grammar_refusals += 1
            log.error(
                "a sampled token broke its sequence's grammar",
                extra={"rid": seq.out_rid, "index": index, "token": refused, "tail": seq.output_ids[-8:]},
            )

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str | None, str | int | None]:
        p = seq.sampling
        if token in p.stop_token_ids:
            return "stop", token
        if token in self.eos_token_ids and not p.ignore_eos:
            return "stop", None
        if seq.matcher is not None and seq.matcher.is_terminated:
            return "stop", None  # the grammar is complete and took its end
        if p.stop and self.detokenize is not None and len(seq.output_ids) > p.min_new_tokens:
            # the text after the first min_new_tokens tokens, as the API matches it
            longest = max(len(s.encode()) for s in p.stop)
            tail = self.detokenize(seq.output_ids[max(len(seq.output_ids) - longest - 2, p.min_new_tokens) :])
            for s in p.stop:
                if s in tail:
                    return "stop", s
        if p.stop_regex and self.detokenize is not None and len(seq.output_ids) > p.min_new_tokens:
            # the text of the last STOP_REGEX_TOKENS tokens after the first min_new_tokens (a
            # longer match is the API's to find: it then ends the request)
            tail = self.detokenize(seq.output_ids[max(len(seq.output_ids) - STOP_REGEX_TOKENS, p.min_new_tokens) :])
            for pattern in p.stop_regex:
                compiled = stop_pattern(pattern)
                if compiled is None or pattern in seq.stop_regex_off:
                    continue
                try:
                    if stop_match(compiled, tail) is not None:
                        return "stop", pattern
                except TimeoutError:  # given up for this request: loud, counted
                    seq.stop_regex_off.add(pattern)
                    self.stats.stop_regex_timeouts += 1
                    log.warning("a stop_regex took too long: not searched again", extra={"rid": seq.out_rid})
        if len(seq.output_ids) >= p.max_new_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _append_verified(self, v: VerifyResult) -> RequestOutput:
        """A verify's tokens appended one by one up to the first that stops the request (its
        grammar, if any, taking each); the KV of the sequence's last token and the accepted
        draft tokens kept, the pages past it given back."""
        seq = v.seq
        assert self.speculator is not None
        self.speculator.record(seq, v.drafted, v.accepted, len(v.tokens))
        kept: list[int] = []
        reason: str | None = None
        stop: str | int | None = None
        for token in v.tokens:
            seq.output_ids.append(token)
            kept.append(token)
            if seq.matcher is not None:  # each token its row's mask allowed: the grammar takes them in turn
                self._to_grammar(seq, token)
            reason, stop = self._check_stop(seq, token)
            if reason is not None:
                break
        self.stats.generated_tokens += len(kept)
        # the KV written: the last token and the draft; kept: the last token and each kept
        # token but the newest (which has none yet); a stop on a draft token keeps that much
        self.scheduler.on_verified(seq, len(kept))
        out = RequestOutput(
            rid=seq.out_rid,
            index=len(seq.output_ids) - len(kept),
            token_ids=kept,
            logprobs=v.logprobs[: len(kept)] if v.logprobs else None,  # type: ignore[arg-type]
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            cached_tokens=seq.num_cached,
            group=seq.group,
        )
        if reason is not None:
            out.finish_reason, out.stop_reason = reason, stop
            seq.finish_reason, seq.stop_reason = reason, stop
            self._drop(seq, reason)
        return out
