"""Batched token selection: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Greedy rows take the argmax of the (penalised) logits. Sampled rows draw with the
exponential race (argmax of p / E, E ~ Exp(1)), which equals a multinomial draw. A row
with a ``seed`` draws its noise from a generator seeded by (seed, output index), so its
tokens depend only on the seed and the logits: the same in PD and unified mode, after
preemption, and whatever else shares the batch. Log-probabilities are those of the
model's raw distribution (before penalties, bias, constraints and temperature).

Before the choice, in this order: repetition/frequency/presence penalties, ``logit_bias``,
``allowed_token_ids``, ``bad_words`` and a structured-output constraint's token mask
(``masks``, filled by the engine from each row's grammar).
"""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.grammar import apply_masks
from pdserve.schemas import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from pdserve.engine.sequence import PromptScores

_MASK = float("-inf")
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for impossible tokens


@dataclass
class SampleRequest:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    prompt_ids: Seq[int]
    output_ids: Seq[int]
    index: int = -1  # output position of the token to draw (default: len(output_ids))

    @property
    def position(self) -> int:
        return self.index if self.index >= 0 else len(self.output_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def seed_for(seed: int, index: int) -> int:
    """Per-output-token seed: reproducible, independent of batch composition."""
    return (seed * 6364136223846793005 + index * 1442695040888963407 + 1) % (2**63)


class Sampler:
    def __init__(self, device: torch.device, end_ids: frozenset[int] = frozenset()) -> None:
        """``end_ids``: the model's end-of-sequence tokens (masked below a row's ``min_new_tokens``)."""
        self.device = device
        self.end_ids = end_ids
        self._generator = torch.Generator(device=device)  # unseeded rows
        self._generator.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self._seeded = torch.Generator(device=device)  # re-seeded per seeded row and token

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRequest], masks: torch.Tensor | None = None
    ) -> SamplerOutput:
        """``masks``: the rows' structured-output bitmasks (see :mod:`.grammar`), or ``None``."""
        assert logits.shape[0] == len(rows)
        if masks is None and all(_plain(r) and not r.params.logprobs for r in rows):
            return SamplerOutput(_argmax(logits).tolist(), [None] * len(rows))  # the common fast path
        tokens, raw_logprobs = self._tokens(logits, rows, masks)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(raw_logprobs, rows, token_list))

    def sample_on_device(
        self, logits: torch.Tensor, rows: list[SampleRequest], masks: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The tokens as a device tensor, with no host synchronisation; ``None`` when a row
        wants log-probabilities (those are read on the host with the tokens)."""
        if any(r.params.logprobs for r in rows):
            return None
        if masks is None and all(_plain(r) for r in rows):
            return _argmax(logits)
        return self._tokens(logits, rows, masks)[0]

    def _tokens(
        self, logits: torch.Tensor, rows: list[SampleRequest], masks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.processed(logits, rows, copy=masks is not None)
        if masks is not None:
            apply_masks(logits, masks)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not sampled:
            return logits.argmax(dim=-1), raw_logprobs
        if not greedy:
            return self._sample(logits, rows), raw_logprobs
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        index = _tensor(greedy, torch.long, logits.device)
        tokens[index] = logits[index].argmax(dim=-1)
        index = _tensor(sampled, torch.long, logits.device)
        tokens[index] = self._sample(logits[index], [rows[i] for i in sampled])
        return tokens, raw_logprobs

    def processed(self, logits: torch.Tensor, rows: list[SampleRequest], copy: bool = False) -> torch.Tensor:
        """The rows' logits in float32 after penalties, ``logit_bias`` and, below a row's
        ``min_new_tokens``, its end tokens masked (what greedy rows take the argmax of;
        speculative verification's rows, whose histories differ per row); a copy when any
        applies or ``copy`` (the caller writes into it), else ``logits`` as float32."""
        logits = logits.float()
        if copy or any(_processes(r) for r in rows):
            logits = logits.clone().contiguous()
            for i, r in enumerate(rows):
                if r.params.has_penalties:
                    _apply_penalties(logits[i], r)
                if r.params.has_bias:
                    _apply_bias(logits[i], r.params)
                if _below_floor(r):
                    self._mask_ends(logits[i], r.params)
                if r.params.allowed_token_ids:
                    _keep_only(logits[i], r.params.allowed_token_ids)
                if r.params.bad_words:
                    _bar_bad_words(logits[i], r)
        return logits

    def _mask_ends(self, row: torch.Tensor, p: SamplingParams) -> None:
        """In place: the tokens that would end the output (its stop tokens, and the model's end
        of sequence unless ``ignore_eos``) made impossible."""
        ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.end_ids))
        ids = [t for t in ends if t < row.shape[0]]
        if ids:
            row[_tensor(ids, torch.long, row.device)] = _MASK

    def probs(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """The distribution a sampled row draws from: temperature, top-k/top-p/min-p, softmax
        (greedy rows' temperature taken as 1; they do not draw)."""
        temps = _tensor([r.params.temperature or 1.0 for r in rows], logits.dtype, logits.device)
        logits = logits / temps[:, None]
        if any(_filters(r.params) for r in rows):
            logits = _filter(logits, rows)
        return torch.softmax(logits, dim=-1)

    @property
    def generator(self) -> torch.Generator:
        """The generator of unseeded rows."""
        return self._generator

    def seeded(self, seed: int, index: int, salt: int = 0) -> torch.Generator:
        """The generator of a seeded row's output ``index``, re-seeded (``salt``: another stream)."""
        self._seeded.manual_seed((seed_for(seed, index) + salt * 0x9E3779B97F4A7C15) % (2**63))
        return self._seeded

    def _sample(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        probs = self.probs(logits, rows)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self._generator)
        elif unseeded:
            noise[_tensor(unseeded, torch.long, probs.device)] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device
            ).exponential_(generator=self._generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                self._seeded.manual_seed(seed_for(r.params.seed, r.position))
                noise[i].exponential_(generator=self._seeded)
        return (probs / noise).argmax(dim=-1)

    def reseed(self, seed: int) -> None:
        self._generator.manual_seed(seed)


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without waiting for it: a small host list copied from
    pageable memory (``torch.tensor(values, device=...)``) makes the host wait until the
    device has run everything queued before the copy, the forward pass included, which
    undoes the overlap of the next step's scheduling with this one."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """The rows' argmax; on a GPU by a kernel that reads each row with many programs."""
    if logits.is_cuda and logits.stride(-1) == 1:
        from pdserve.engine.kernels import elementwise  # Triton comes with torch's CUDA builds

        return elementwise.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _below_floor(r: SampleRequest) -> bool:
    """The row draws a token its request's ``min_new_tokens`` forbids to be an end."""
    return r.position < r.params.min_new_tokens


def _processes(r: SampleRequest) -> bool:
    """The row's logits change before it draws (:meth:`Sampler.processed`)."""
    p = r.params
    return p.has_penalties or p.has_bias or bool(p.allowed_token_ids) or bool(p.bad_words) or _below_floor(r)


def _plain(r: SampleRequest) -> bool:
    """A row whose token is the raw logits' argmax."""
    return r.params.is_greedy and not _processes(r)


def _bar_bad_words(row: torch.Tensor, r: SampleRequest) -> None:
    """In place: the last token of each bad word whose other tokens end the output made
    impossible (a one-token word's always; ids past the vocabulary ignored)."""
    out = r.output_ids
    barred = {
        w[-1]
        for w in r.params.bad_words
        if w[-1] < row.shape[0] and len(w) - 1 <= len(out) and tuple(out[len(out) - len(w) + 1 :]) == w[:-1]
    }
    if barred:
        row[_tensor(sorted(barred), torch.long, row.device)] = _MASK


def _keep_only(row: torch.Tensor, allowed: tuple[int, ...]) -> None:
    """In place: every token but ``allowed`` made impossible (ids past the vocabulary ignored)."""
    ids = _tensor([t for t in allowed if t < row.shape[0]], torch.long, row.device)
    kept = row[ids].clone()
    row.fill_(_MASK)
    row[ids] = kept


def _apply_bias(row: torch.Tensor, p: SamplingParams) -> None:
    """In place: OpenAI's ``logit_bias``, added to the logits (ids past the vocabulary ignored)."""
    items = [(t, b) for t, b in p.bias_items() if t < row.shape[0]]
    if items:
        ids = _tensor([t for t, _ in items], torch.long, row.device)
        row.index_add_(0, ids, _tensor([b for _, b in items], row.dtype, row.device))


def _filters(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _filter(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    """Mask tokens outside each row's top-k / top-p / min-p set (at least one survives)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    device = logits.device
    rank = torch.arange(vocab, device=device)[None, :]
    top_k = _tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], torch.long, device)
    remove = rank >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(remove, _MASK), dim=-1)
    top_p = _tensor([r.params.top_p for r in rows], torch.float32, device)
    before = probs.cumsum(dim=-1) - probs
    remove |= (before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # top_p == 1: no cut, whatever the rounding
    min_p = _tensor([r.params.min_p for r in rows], torch.float32, device)
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, _MASK)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _apply_penalties(row: torch.Tensor, r: SampleRequest) -> None:
    """In place on one row. Repetition: prompt and output (HF); frequency/presence: output (OpenAI)."""
    p = r.params
    device = row.device
    if p.repetition_penalty != 1.0:
        seen = _tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), torch.long, device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
        out = _tensor(list(r.output_ids), torch.long, device)
        counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _logprobs(raw: torch.Tensor | None, rows: list[SampleRequest], tokens: list[int]) -> list[TokenLogprob | None]:
    if raw is None:
        return [None] * len(rows)
    out: list[TokenLogprob | None] = []
    max_top = max(r.params.top_logprobs for r in rows)
    top_vals, top_ids = raw.topk(max_top, dim=-1) if max_top > 0 else (None, None)
    raw = raw.clamp(min=LOGPROB_FLOOR)  # -inf does not survive JSON
    if top_vals is not None:
        top_vals = top_vals.clamp(min=LOGPROB_FLOOR)
    chosen = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(1).tolist()
    for i, r in enumerate(rows):
        if not r.params.logprobs:
            out.append(None)
            continue
        n = r.params.top_logprobs
        ids = tuple(top_ids[i, :n].tolist()) if top_ids is not None and n else ()
        vals = tuple(top_vals[i, :n].tolist()) if top_vals is not None and n else ()
        out.append(TokenLogprob(chosen[i], ids, vals))
    return out


def token_logprobs(logits: torch.Tensor, rows: list[SampleRequest], tokens: list[int]) -> list[TokenLogprob | None]:
    """What the sampler reports for ``tokens`` chosen from ``logits`` (the raw distribution's
    log-probabilities; ``None`` for rows that ask none)."""
    if not any(r.params.logprobs for r in rows):
        return [None] * len(rows)
    return _logprobs(torch.log_softmax(logits.float(), dim=-1), rows, tokens)


SCORE_BLOCK = 256  # prompt rows scored at a time: a block's float32 log-probabilities stay small


def score_prompt(logits: torch.Tensor, targets: list[int], scores: PromptScores) -> None:
    """Append to ``scores`` each row's log-probability of its target token (the prompt's next
    one), its rank (1: the most likely; ties count for it) and the ``scores.k`` most likely
    tokens, from the raw distribution as :func:`token_logprobs` reports it."""
    target = torch.tensor(targets, dtype=torch.long, device=logits.device)
    for start in range(0, len(targets), SCORE_BLOCK):
        raw = torch.log_softmax(logits[start : start + SCORE_BLOCK].float(), dim=-1)
        t = target[start : start + SCORE_BLOCK, None]
        chosen = raw.gather(1, t)
        ranks = (raw > chosen).sum(dim=1) + 1
        scores.logprobs += chosen.squeeze(1).clamp(min=LOGPROB_FLOOR).tolist()
        scores.ranks += ranks.tolist()
        if scores.k:
            vals, ids = raw.topk(scores.k, dim=-1)
            scores.top_ids += ids.flatten().tolist()
            scores.top_logprobs += vals.clamp(min=LOGPROB_FLOOR).flatten().tolist()
