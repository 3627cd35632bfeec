"""Speculative decoding with n-gram (prompt lookup) drafts: draft, decide, verify.

**Drafts.** Each sequence keeps an :class:`NgramIndex` of its own tokens (prompt and output),
extended as tokens arrive (never rescanned): for every n in ``[ngram_min, ngram_max]`` the
last position each n-gram was seen at. A draft is what followed the latest earlier occurrence
of the longest suffix of the sequence that occurred before, up to K tokens; when that
continuation runs into the suffix itself the text is periodic and the draft repeats it.

**Verify.** A drafted sequence is computed in one forward pass as a chunk of K+1 tokens (its
last token and the draft) over its own KV, with logits at every position (the model runner
packs it like a prefill chunk). :func:`verify` keeps the longest prefix of the draft the
target accepts and one more token: greedy rows accept a draft token equal to the argmax
(so greedy output is the same as without speculation); sampled rows take the standard rule
for a point-mass draft: accept draft token ``d`` with probability ``p(d)``, else draw from
``p`` with ``d`` removed (renormalised), which leaves every emitted token distributed as
``p``. When the whole draft is accepted, the last row gives a bonus token drawn from ``p``.
The engine rolls the sequence's computed length back to the accepted tokens and gives back
the pages past them (the KV written at rejected positions is never read: the next step
overwrites those slots).

**Backoff.** A draft token costs the step its marginal time (``b`` below) whether accepted
or not, and a verify row its own (``c``: its chunk's attention and bookkeeping); an
accepted token saves the sequence a step, worth the plain step's time per sequence.
:class:`StepCost` fits ``seconds = a + b * tokens + c * verifies`` to the steps the engine
measures (decodes and verifies only, decayed), so at ``N`` sequences a step's time per
sequence is ``(a + b N) / N``. A request with measured per-token acceptance ``alpha``
drafts the length ``k`` that gains most, ``sum(alpha ** i - b') - c'`` over ``i <= k`` with
``b'``, ``c'`` the costs over that time per sequence (``speculative_cost_ratio`` fixes ``b'``
and drops ``c'``); one that gains at no length stops drafting and probes again after a
cooldown that doubles (up to :data:`MAX_COOLDOWN` steps) while probes keep failing. At
high load ``a`` is shared by many sequences, the time per sequence nears ``b``, and drafts stop.
Probes are paid for out of one budget per engine: every step adds :data:`PROBE_SHARE` of its
sequences' steps to it, a probe takes its price (``k`` tokens and a row, in those units), and a
request due to probe waits while the budget is short. So at any load the probes cost at most
about that share of the time (at 32 in flight, 168 unbudgeted probes cost a fifth of it).

Rows with a grammar (structured output) draft too: a draft is cut before the first token
the grammar would not take (its matcher walks the draft on trial and rolls back,
``Matcher.draft_prefix``; counted in ``SpecStats.grammar_cut``), and each verify row is
judged under the grammar's mask after the draft tokens before it (``Grammars.draft_masks``),
so the accepted tokens and the corrected or bonus one all keep to it; the matcher then takes
the tokens appended, as after any step.

On a GPU, steps overlap (the next one scheduled while the last one's tokens are on the
device) except before a step in which a sequence is due to draft (:meth:`Speculator.due`): a
draft needs the sequence's last token on the host. So where speculation has backed off (chat,
high load) the overlap stays; where it drafts, the steps around its verifies are not overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.engine.grammar import apply_masks

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.sampler import Sampler, SampleRequest
    from pdserve.engine.sequence import Sequence

ALGORITHMS = ("ngram",)
PRIOR_TRIALS = 2.0  # a new request's acceptance starts at PRIOR_ACCEPTED / PRIOR_TRIALS
PRIOR_ACCEPTED = 1.0
DECAY = 0.9  # weight of a request's older verifies against its newest
MAX_COOLDOWN = 64  # steps a backed-off request waits, at most, before it probes again
PROBE_SHARE = 0.02  # of the sequences' steps, what probes may cost (the budget's income)
PROBE_BUDGET_PROBES = 2.0  # the budget holds at most this many probes' price (and starts full)


class NgramIndex:
    """The positions of a sequence's n-grams, ``ngram_min <= n <= ngram_max``, kept as the
    sequence grows: ``tables[n][gram]`` is the index of the token that followed ``gram``'s
    latest occurrence."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.tokens: list[int] = []
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}

    def extend(self, prompt: list[int], output: list[int]) -> None:
        """Take in the tokens of ``prompt + output`` not seen yet (they only grow)."""
        start = len(self.tokens)
        if start < len(prompt):
            self.tokens += prompt[start:]
        self.tokens += output[len(self.tokens) - len(prompt) :]
        self._index(start)

    def _index(self, start: int) -> None:
        tokens = self.tokens
        # an n-gram ending before position e is indexed once token e (what follows it) is known
        for e in range(max(start, 1), len(tokens)):
            for n, table in self.tables.items():
                if e >= n:
                    table[tuple(tokens[e - n : e])] = e

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the current
        suffix, and that suffix's length (0: no match, no draft)."""
        tokens = self.tokens
        end = len(tokens)
        for n in range(min(self.ngram_max, end), self.ngram_min - 1, -1):
            e = self.tables[n].get(tuple(tokens[end - n :]))
            if e is None:
                continue
            if e + k <= end:
                return tokens[e : e + k], n
            period = end - e  # the occurrence's continuation reaches the suffix: periodic text
            return [tokens[e + i % period] for i in range(k)], n
        return [], 0


@dataclass
class SpecState:
    """One sequence's drafts and their record."""

    index: NgramIndex
    trials: float = PRIOR_TRIALS  # decayed draft tokens judged (accepted, plus the rejected one)
    accepted: float = PRIOR_ACCEPTED
    cooldown: int = 0  # steps left before it may draft again
    backoff: int = 1  # the next cooldown's length
    price: tuple[float, float] = (0.0, 0.0)  # the costs its last draft was weighed at

    @property
    def alpha(self) -> float:
        """Estimated chance that a draft token is accepted given the ones before it were."""
        return self.accepted / self.trials

    def record(self, drafted: int, accepted: int) -> None:
        self.trials = self.trials * DECAY + accepted + (1 if accepted < drafted else 0)
        self.accepted = self.accepted * DECAY + accepted


class StepCost:
    """``seconds = a + b * tokens + c * verifies`` fitted to measured steps (decodes and
    verifies only) by least squares with exponential forgetting, from a prior worth a few
    steps: ``a`` the step's fixed cost (weights read), ``b`` a token's, ``c`` a verify row's
    own (its chunk's attention and bookkeeping)."""

    def __init__(
        self,
        decay: float = 0.98,
        prior: tuple[float, float, float] = (0.03, 0.0015, 0.001),
        weight: float = 3.0,
    ) -> None:
        self.decay = decay
        self.xx = [[0.0] * 3 for _ in range(3)]
        self.xy = [0.0] * 3
        a, b, c = prior
        for tokens, verifies in ((1, 0), (9, 0), (5, 1)):  # pseudo-steps that pin the prior
            self._add((1.0, float(tokens), float(verifies)), a + b * tokens + c * verifies, weight / 3)

    def _add(self, x: tuple[float, float, float], y: float, w: float) -> None:
        for i in range(3):
            self.xy[i] += w * x[i] * y
            for j in range(3):
                self.xx[i][j] += w * x[i] * x[j]

    def observe(self, tokens: int, verifies: int, seconds: float) -> None:
        self.xx = [[v * self.decay for v in row] for row in self.xx]
        self.xy = [v * self.decay for v in self.xy]
        self._add((1.0, float(tokens), float(verifies)), seconds, 1.0)

    @property
    def params(self) -> tuple[float, float, float]:
        """``(a, b, c)``, none below zero (``a`` above it)."""
        m = [row[:] + [y] for row, y in zip(self.xx, self.xy, strict=True)]
        for col in range(3):  # Gauss-Jordan with partial pivoting on the 3x3 normal equations
            pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
            if abs(m[pivot][col]) < 1e-12:
                return self.xy[0] / self.xx[0][0], 0.0, 0.0
            m[col], m[pivot] = m[pivot], m[col]
            for r in range(3):
                if r != col:
                    f = m[r][col] / m[col][col]
                    m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
        a, b, c = (m[i][3] / m[i][i] for i in range(3))
        return max(a, 1e-6), max(b, 0.0), max(c, 0.0)

    def price(self, rows: int) -> tuple[float, float]:
        """At ``rows`` sequences a step: a draft token's cost and a verify row's own, each over
        the step's time per sequence (what one saved step is worth)."""
        a, b, c = self.params
        rows = max(rows, 1)
        per_row = (a + b * rows) / rows
        return b / per_row, c / per_row


@dataclass
class SpecStats:
    """Totals over the engine's life: ``verifies`` rows verified, ``drafted`` draft tokens,
    ``accepted`` of them (each saves its sequence one step), ``lengths[i]``: verifies that
    accepted ``i``; ``backoffs``: times a request stopped drafting; ``probes``: drafts made
    after a cooldown; ``grammar_cut``: draft tokens dropped because a structured-output
    request's grammar would refuse them (the first such token and those after it)."""

    verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens the verifies appended (accepted, corrected and bonus)
    backoffs: int = 0
    probes: int = 0
    probes_deferred: int = 0  # steps a request due to probe waited for the probe budget
    unoverlapped_steps: int = 0  # steps not left queued on the device: a request was due to draft after them
    grammar_cut: int = 0  # draft tokens cut off before verifying: their grammar would refuse them (or one before)
    lengths: list[int] = field(default_factory=list)

    @property
    def steps_saved(self) -> int:
        return self.accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Speculator:
    """Drafts for the scheduler, decides who drafts, and keeps the record."""

    def __init__(self, config: EngineConfig) -> None:
        self.k = config.speculative_num_draft_tokens
        self.ngram_min = config.speculative_ngram_min
        self.ngram_max = config.speculative_ngram_max
        self.fixed_ratio = config.speculative_cost_ratio
        self.cost = StepCost()
        self.stats = SpecStats(lengths=[0] * (self.k + 1))
        self.probe_budget: float | None = None  # in sequence-steps; None: full (a fresh engine)

    def state(self, seq: Sequence) -> SpecState:
        state = seq.spec
        if state is None:
            state = seq.spec = SpecState(NgramIndex(self.ngram_min, self.ngram_max))
        return state

    def price(self, rows: int) -> tuple[float, float]:
        """A draft token's and a verify row's cost over a step's time per sequence at ``rows``
        sequences (``StepCost.price``; ``speculative_cost_ratio``: that token cost, no row cost)."""
        return (self.fixed_ratio, 0.0) if self.fixed_ratio is not None else self.cost.price(rows)

    def begin_step(self, rows: int) -> tuple[float, float]:
        """A step of ``rows`` decoding sequences is being scheduled: the probe budget gets its
        income (:data:`PROBE_SHARE` of them); returns :meth:`price` at ``rows``."""
        price = self.price(rows)
        cap = PROBE_BUDGET_PROBES * (self.k * price[0] + price[1])
        budget = cap if self.probe_budget is None else self.probe_budget + PROBE_SHARE * rows
        self.probe_budget = min(budget, cap)
        return price

    def draft(self, seq: Sequence, limit: int, price: tuple[float, float]) -> list[int]:
        """``seq``'s draft this step (empty: a plain decode): at most ``limit`` tokens, as many
        as its acceptance pays for at ``price`` (see :meth:`price`)."""
        state = self.state(seq)
        if limit <= 0:
            return []
        state.price = price
        k = best_length(state.alpha, price, min(self.k, limit))
        probe = False
        if k == 0:
            if best_length(1.0, price, min(self.k, limit)) == 0:
                return []  # even drafts always accepted would not pay at this load: no probe
            if state.cooldown > 0:
                state.cooldown -= 1  # (a step of it overlapped counts too)
                return []
            if seq.num_pending:
                return []
            k = min(self.k, limit)  # a probe: does it pay again?
            if self.probe_budget is not None and self.probe_budget < k * price[0] + price[1]:
                self.stats.probes_deferred += 1
                return []  # due, but the probes' budget is short: another step
            probe = True
        if seq.num_pending:
            return []  # its last token is still on the device (an overlapped step's)
        state.index.extend(seq.prompt_ids, seq.output_ids)
        tokens, _ = state.index.propose(k)
        if tokens and seq.matcher is not None:
            tokens = self.cut(seq, tokens)
        if tokens and probe:
            self.stats.probes += 1
            if self.probe_budget is not None:
                self.probe_budget -= len(tokens) * price[0] + price[1]
            state.cooldown = state.backoff
            state.backoff = min(state.backoff * 2, MAX_COOLDOWN)
        return tokens

    def cut(self, seq: Sequence, draft: list[int]) -> list[int]:
        """``draft`` up to the first token ``seq``'s grammar would not take after the ones
        before it (its mask would refuse it), the rest counted in ``grammar_cut``. The matcher
        must stand at the sequence's last known token (no token pending): otherwise no draft."""
        matcher = seq.matcher
        if matcher.seen != len(seq.output_ids):
            return []
        n = matcher.draft_prefix(draft)
        self.stats.grammar_cut += len(draft) - n
        return draft[:n]

    def due(self, seq: Sequence, rows: int) -> bool:
        """Whether ``seq`` would draft in a step of ``rows`` decoding sequences, as far as the
        tokens the host knows tell (its acceptance pays, or a probe is due and budgeted, and its
        n-gram index proposes something): the engine then does not leave the step before it
        queued on the device (overlap), so that the draft has the sequence's last token. No
        side effects beyond bringing its index up to date."""
        state = self.state(seq)
        if seq.num_outputs >= seq.sampling.max_new_tokens - 1:
            return False
        price = self.price(rows)
        if best_length(state.alpha, price, self.k) == 0:
            if best_length(1.0, price, self.k) == 0 or state.cooldown > 0:
                return False
            if self.probe_budget is not None and self.probe_budget < self.k * price[0] + price[1]:
                return False
        state.index.extend(seq.prompt_ids, seq.output_ids)
        return bool(state.index.propose(1)[0])

    def record(self, seq: Sequence, drafted: int, accepted: int, emitted: int) -> None:
        state = self.state(seq)
        before = state.cooldown == 0 and best_length(state.alpha, state.price, self.k) > 0
        state.record(drafted, accepted)
        if best_length(state.alpha, state.price, self.k) > 0:
            state.cooldown, state.backoff = 0, 1
        elif before:
            self.stats.backoffs += 1
            state.cooldown = state.backoff
            state.backoff = min(state.backoff * 2, MAX_COOLDOWN)
        s = self.stats
        s.verifies += 1
        s.drafted += drafted
        s.accepted += accepted
        s.emitted += emitted
        s.lengths[min(accepted, len(s.lengths) - 1)] += 1

    def observe_step(self, tokens: int, verifies: int, seconds: float) -> None:
        self.cost.observe(tokens, verifies, seconds)


def best_length(alpha: float, price: tuple[float, float], most: int) -> int:
    """The draft length that gains most: the i-th draft token saves a step with chance
    ``alpha ** i`` and costs ``price[0]``, the verify row ``price[1]`` (in steps per sequence);
    0 when no length gains."""
    token, row = price
    k = 0
    gain = 0.0
    p = alpha
    while k < most and p >= token:
        k += 1
        gain += p - token
        p *= alpha
    return k if gain > row else 0


# ---- verification ------------------------------------------------------------------
@dataclass
class Verified:
    """What one verify row group yields: the tokens to append (accepted drafts, then the
    corrected or bonus token) and how many drafts were accepted."""

    tokens: list[int]
    accepted: int


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    drafts: list[list[int]],
    rows: list[list[SampleRequest]],
    masks: torch.Tensor | None = None,
) -> list[Verified]:
    """Accept or reject each sequence's draft from its ``len(draft) + 1`` logits rows
    (stacked in order in ``logits``); ``rows[i][t]`` describes row ``t`` of sequence ``i``
    (its output so far plus ``draft[:t]``, its output index). ``masks``: the rows'
    structured-output bitmasks (``Grammars.draft_masks``), applied after penalties and bias
    as the sampler applies a step's: a draft token its row's mask refuses is rejected, and
    the corrected or bonus token is one the mask allows; ``logits`` is not written."""
    flat = [r for group in rows for r in group]
    assert logits.shape[0] == len(flat)
    processed = sampler.processed(logits, flat, copy=masks is not None)
    if masks is not None:
        apply_masks(processed, masks)
    greedy = [r.params.is_greedy for r in flat]
    targets = processed.argmax(dim=-1).tolist() if any(greedy) else []
    probs = sampler.probs(processed, flat) if not all(greedy) else None
    out: list[Verified] = []
    start = 0
    for draft, group in zip(drafts, rows, strict=True):
        k = len(draft)
        if group[0].params.is_greedy:
            j = 0
            while j < k and targets[start + j] == draft[j]:
                j += 1
            out.append(Verified(draft[:j] + [targets[start + j]], j))
        else:
            assert probs is not None
            out.append(_rejection(sampler, probs[start : start + k + 1], draft, group))
        start += k + 1
    return out


def _rejection(sampler: Sampler, probs: torch.Tensor, draft: list[int], group: list[SampleRequest]) -> Verified:
    """The rule for a point-mass draft on one sequence's rows ``probs [k + 1, V]``."""
    k = len(draft)
    params = group[0].params
    device = probs.device
    if params.seed is None:
        uniforms = torch.rand(k, generator=sampler.generator, device=device).tolist()
    else:  # each draft token's test from its own output index's stream, as a seeded draw is
        uniforms = [
            torch.rand(1, generator=sampler.seeded(params.seed, group[t].position), device=device).item()
            for t in range(k)
        ]
    if k:
        chosen = probs[torch.arange(k, device=device), torch.tensor(draft, device=device)].tolist()
    else:
        chosen = []
    j = 0
    while j < k and uniforms[j] < chosen[j]:
        j += 1
    row = probs[j]
    if j < k:  # rejected: the residual max(p - q, 0) of a point mass q at draft[j] is p without it
        row = row.clone()
        row[draft[j]] = 0.0
        if float(row.sum()) <= 0.0:
            return Verified(draft[: j + 1], j)  # p was all on the draft token (rounding): it stands
    gen = sampler.generator if params.seed is None else sampler.seeded(params.seed, group[j].position, salt=1)
    noise = torch.empty_like(row).exponential_(generator=gen)
    token = int((row / noise).argmax().item())
    return Verified(draft[:j] + [token], j)
