"""The engine's requests: checks, admission (``n`` samples as forks), imports of pulled KV,
aborts and releases, the prefix cache's flush. A part of :class:`~pdserve.engine.engine.Engine`."""

from __future__ import annotations

import logging

from pdserve.engine.config import EngineConfig
from pdserve.engine.grammar import GrammarError, Grammars
from pdserve.engine.kv_tiers import KVTiers
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestError
from pdserve.engine.page_manager import OutOfPages, PageManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import PromptScores, Sequence, Status
from pdserve.schemas import PromptLogprobs, SamplingParams
from pdserve.schemas.sampling import sample_rid

log = logging.getLogger("pdserve.engine.engine")


class Admission:
    """Requests in and out of the engine; the engine provides its state (see the annotations)."""

    runner: ModelRunner
    config: EngineConfig
    grammars: Grammars | None
    pages: PageManager
    tiers: KVTiers | None
    scheduler: Scheduler
    max_model_len: int
    seqs: dict[str, Sequence]
    held: dict[str, Sequence]
    _aborted: set[str]

    def is_in_flight(self, rid: str) -> bool:
        raise NotImplementedError

    def check_request(self, num_prompt: int, sampling: SamplingParams, num_output: int = 0) -> None:
        """Raise :class:`RequestError` if a request of this shape can never be served."""
        total = num_prompt + num_output
        if num_prompt < 1:
            raise RequestError("the prompt is empty")
        if total >= self.max_model_len:
            raise RequestError(f"the prompt has {total} tokens; the model's context is {self.max_model_len} tokens")
        pool = self.pages.num_pages * self.config.page_size
        if not self.scheduler.fits_ever(total):
            raise RequestError(f"the prompt has {total} tokens; the KV pool holds {pool}")
        longest = num_prompt + sampling.max_new_tokens
        if not self.scheduler.fits_ever(longest):
            raise RequestError(f"the request may need {longest} tokens of KV; the KV pool holds {pool}")
        if sampling.n > self.config.max_num_seqs:
            raise RequestError(f"n is {sampling.n}; this worker runs at most {self.config.max_num_seqs} sequences")
        if sampling.n > 1 and num_output:
            raise RequestError("a request of n > 1 cannot be resumed: resume each sample alone (rid#i, n=1)")
        if sampling.constraint is not None and self.grammars is None:
            raise RequestError("structured output is not available on this worker")

    def compile_constraint(self, sampling: SamplingParams) -> None:
        """Compile ``sampling``'s constraint (cached), raising :class:`RequestError` if it does
        not compile; workers call it in a thread before :meth:`add_request`."""
        if sampling.constraint is not None and self.grammars is not None:
            try:
                self.grammars.compile(sampling)
            except GrammarError as exc:
                raise RequestError(str(exc)) from None

    def _with_matcher(self, seq: Sequence) -> Sequence:
        if seq.sampling.constraint is not None:
            assert self.grammars is not None
            try:
                seq.matcher = self.grammars.matcher(seq.sampling, seq.output_ids)
            except GrammarError as exc:
                raise RequestError(str(exc)) from None
        return seq

    def _samples(
        self, rid: str, prompt_ids: list[int], sampling: SamplingParams, firsts: list[tuple[int, int]] | None = None
    ) -> Sequence:
        """The sequence of an ``n > 1`` request: sample ``firsts[0]`` (default 0) keyed by
        ``rid``, the others as its forks. ``firsts``: (sample index, first token) of the
        samples an import continues; ``None``: all ``n``, none drawn yet."""
        picks = firsts if firsts is not None else [(i, -1) for i in range(sampling.n)]

        def sample(index: int, first: int, key: str) -> Sequence:
            outputs = [first] if first >= 0 else []
            seq = Sequence(
                key, list(prompt_ids), sampling.for_sample(index), output_ids=outputs, num_resumed=len(outputs)
            )
            seq.group, seq.reply_rid = rid, sample_rid(rid, index)
            return self._with_matcher(seq)

        head = sample(*picks[0], rid)
        head.forks = [sample(i, t, sample_rid(rid, i)) for i, t in picks[1:]]
        for fork in head.forks:
            fork.forked = True
        if sampling.prompt_logprobs is not None and firsts is None:  # (an import's client has them)
            head.prompt_scores = PromptScores(sampling.prompt_logprobs)
            cell: list[PromptLogprobs | None] = [None]
            for seq in (head, *head.forks):
                seq.shared_scores = cell
        return head

    def check_token_ids(self, *ids: list[int]) -> None:
        """Raise :class:`RequestError` for a token id outside the model's vocabulary: the HTTP
        API checks its input, but a direct NATS publisher's ids reach the engine as sent, and
        one such id would fail the whole batch's forward pass."""
        vocab = self.runner.vocab_size
        for part in ids:
            if part and not 0 <= min(part) <= max(part) < vocab:
                bad = next(t for t in part if not 0 <= t < vocab)
                raise RequestError(f"token id {bad} is outside the model's vocabulary of {vocab}")

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        output_ids: list[int] | None = None,
        prefill_only: bool = False,
        samples: list[tuple[int, int]] | None = None,
    ) -> Sequence:
        """Queue a request. ``samples``: an ``n > 1`` request whose samples already have their
        first tokens, (index, token) each (a hand-off that is computed here after all): each
        sample computes prompt and first token itself."""
        if rid in self.seqs or rid in self.held:
            raise RequestError(f"request {rid!r} is already in the engine")
        outputs = list(output_ids or [])
        self.check_request(len(prompt_ids), sampling, len(outputs))
        self.check_token_ids(prompt_ids, outputs, [t for _, t in samples or []])
        if samples:
            seq = self._samples(rid, prompt_ids, sampling, samples)
            self.seqs[rid] = seq
            self.fail_import(seq)
            return seq
        if sampling.n > 1:
            seq = self._samples(rid, prompt_ids, sampling)
            for s in (seq, *seq.forks):
                s.prefill_only = prefill_only
        else:
            seq = Sequence(
                rid, list(prompt_ids), sampling, output_ids=outputs, num_resumed=len(outputs), prefill_only=prefill_only
            )
            if sampling.prompt_logprobs is not None and not outputs:  # a resumed request's client has them
                seq.prompt_scores = PromptScores(sampling.prompt_logprobs)
            self._with_matcher(seq)
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return seq

    def reserve_import(
        self,
        rid: str,
        prompt_ids: list[int],
        output_ids: list[int],
        sampling: SamplingParams,
        samples: list[tuple[int, int]] | None = None,
    ) -> Sequence | None:
        """Pages for a request whose KV arrives by transfer, or ``None`` if the pool is short.

        The KV to arrive is that of every known token but the last: the prompt, and for a
        resumed request the output already streamed (``output_ids[:-1]``). The prefix
        already in this pool is reused: ``seq.num_cached`` tokens need no transfer. Follow
        with :meth:`commit_import` or :meth:`fail_import`. ``samples``: for an ``n > 1``
        request, (index, first token) of each sample that goes on; they share the KV.
        """
        firsts = [t for _, t in samples or []]
        self.check_request(len(prompt_ids), sampling, len(output_ids))
        self.check_token_ids(prompt_ids, output_ids, firsts)
        if samples:
            seq = self._samples(rid, prompt_ids, sampling, samples)
        else:
            seq = Sequence(rid, list(prompt_ids), sampling, output_ids=list(output_ids), num_resumed=len(output_ids))
            self._with_matcher(seq)
        # The prompt's pages plus room to decode a page, and a watermark for the running batch.
        if not self.pages.reserve_prompt(seq, reserve=len(self.scheduler.running)):
            return None
        seq.status = Status.HELD
        self.seqs[rid] = seq
        return seq

    def commit_import(self, seq: Sequence) -> None:
        """The KV is in place: decode from the last known token on."""
        seq.num_computed = 0
        self.scheduler.on_computed(seq, seq.num_tokens - 1)
        forks, seq.forks = seq.forks, []
        if seq.output_ids:
            self.scheduler.start_running(seq)
        else:
            seq.status = Status.WAITING
            self.scheduler.add(seq)
        for fork in forks:  # the other samples: the prompt's KV shared, each with its own first token
            self.seqs[fork.rid] = fork
            if self._fork(seq, fork):
                self.scheduler.start_running(fork)
            else:
                self.scheduler.add(fork)

    def _fork(self, parent: Sequence, child: Sequence) -> bool:
        """``child`` takes ``parent``'s computed KV (see ``PageManager.fork``); False (``child``
        gets nothing and computes its prompt itself) when no page is free."""
        try:
            fresh = self.pages.fork(parent, child)
        except OutOfPages:
            return False
        if fresh is not None:
            self.runner.copy_page(parent.page_table[len(child.page_table) - 1], fresh)
        return True

    def fail_import(self, seq: Sequence) -> None:
        """Transfer failed: free the pages and compute the prompt here instead."""
        self.pages.release(seq)
        seq.status = Status.WAITING
        self.scheduler.add(seq)
        for fork in seq.forks:  # each sample computes prompt and first token itself
            self.seqs[fork.rid] = fork
            self.scheduler.add(fork)
        seq.forks = []

    def abort(self, rid: str) -> bool:
        """Drop a request wherever it is; its pages are freed (after the steps in flight).
        ``rid`` of an ``n > 1`` request drops every sample; ``rid#i`` only that one."""
        seqs = [s for s in (*self.seqs.values(), *self.held.values()) if rid in (s.rid, s.group, s.out_rid)]
        for seq in seqs:
            if self.is_in_flight(seq.rid):
                self._aborted.add(seq.rid)
                self.scheduler.remove(seq, keep_pages=True)  # scheduled no more; pages go when its steps end
            else:
                self._drop(seq, "abort")
        return bool(seqs)

    def flush_cache(self) -> int:
        """Forget every cached prefix (see ``PageManager.reset_prefix_cache``) and the host
        tier's pages (the disk and store tiers are shared and persist); returns the cached
        device pages freed."""
        if self.tiers is not None:
            self.tiers.flush()
        return self.pages.reset_prefix_cache(in_use=True)

    def close(self) -> None:
        """Finish the KV tiers' queued writes and close them; remove a shared pool's file."""
        if self.tiers is not None:
            self.tiers.close()
        self.runner.pool.close()

    def release(self, rid: str) -> bool:
        """Free a held prefill's pages (decode has pulled them, or they expired)."""
        seq = self.held.pop(rid, None)
        if seq is None:
            return False
        self.pages.release(seq)
        return True

    def _drop(self, seq: Sequence, reason: str) -> None:
        self.held.pop(seq.rid, None)
        self.seqs.pop(seq.rid, None)
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or reason
