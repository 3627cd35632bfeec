"""The device-side layout of one forward pass of a fast model.

Tokens are packed into one row: one token per decoding sequence first, then each
prefill chunk's tokens, then each speculative verify's (its last token and its draft). Every tensor here is on the model's device; building one from
a :class:`~pdserve.engine.sequence.ScheduledBatch` is :func:`build_step`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.sequence import ScheduledBatch, Sequence


@dataclass
class PrefillChunks:
    """The prefill chunks of a step (``S`` of them)."""

    q_starts: torch.Tensor  # [S] int32: first row of each chunk in the packed batch
    q_lens: torch.Tensor  # [S] int32
    ctx_lens: torch.Tensor  # [S] int32: tokens of KV once the chunk is written (prefix + chunk)
    page_tables: torch.Tensor  # [S, W] int32
    max_q_len: int
    spans: list[tuple[int, int]]  # (q_start, q_len) on the host
    is_fresh: bool  # no chunk has a prefix: each attends only to itself
    num_verifies: int = 0  # the last chunks are speculative verifies (each row attends as a decode would)
    # Chunks of at least build_step's ``prefixed_rows`` rows after a prefix, which the model
    # attends with the library's attention over their gathered pages, as (span, q_start,
    # q_len, ctx_len): the others' lengths in ``paged_q_lens`` (0 for these), up to
    # ``paged_max_q_len`` (0: none left for the paged kernel)
    prefixed: list[tuple[int, int, int, int]] = field(default_factory=list)
    paged_q_lens: torch.Tensor | None = None
    paged_max_q_len: int = 0
    # the prefixed chunks' page rows of layer 0 (attention.page_rows), made at their first layer
    prefixed_page_rows: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: page * page_size + offset where each token's K/V goes
    num_decodes: int
    decode_tables: torch.Tensor  # [B, W] int32
    decode_ctx_lens: torch.Tensor  # [B] int32: tokens of KV including the new one
    decode_splits: int
    prefill: PrefillChunks | None
    sample_index: torch.Tensor | None  # rows whose logits are wanted; None: every row
    # Decode rows of one sequence side by side (a speculative verify as rows, see
    # :func:`verify_rows`): each row's K/V is stored before any row attends, since a row
    # reads the tokens of the rows before it (a decode-only step otherwise has its attention
    # kernel rotate and store each row's own token).
    kv_first: bool = False

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without waiting for the device's queue (from pinned memory: a
    copy from pageable memory waits until the work queued before it has run)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _table(rows: list[list[int]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), max(width, 1)), dtype=torch.int32)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return out


def build_step(
    batch: ScheduledBatch, page_size: int, device: torch.device, splits_for: int, prefixed_rows: int = 0
) -> tuple[StepBatch, list[Sequence]]:
    """Pack ``batch`` for a fast model; returns it and the sequences that get a token.

    ``splits_for`` is the decode-attention split count to use for this step. Verifies are
    packed as prefill chunks after the prompts' (over their own KV); their rows come after the
    sampled rows, every row of each, and are not in the returned sequences; the prompt rows to
    score (``batch.scored``) come last. ``prefixed_rows`` (0: none): prompt chunks of at least
    this many rows after a prefix are listed in the chunks' ``prefixed``.
    """
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    decode_rows: list[list[int]] = []
    ctx: list[int] = []
    for seq in batch.decodes:
        p = seq.num_tokens - 1
        ids.append(seq.last_token)
        pos.append(p)
        slots.append(seq.page_table[p // page_size] * page_size + p % page_size)
        decode_rows.append(seq.page_table[: p // page_size + 1])
        ctx.append(p + 1)
        sample_rows.append(len(ids) - 1)
        sample_seqs.append(seq)
    spans: list[tuple[int, int]] = []
    chunk_ctx: list[int] = []
    chunk_rows: list[list[int]] = []
    chunk_pos: list[torch.Tensor] = []
    chunk_pages: list[torch.Tensor] = []
    fresh = True
    first_row: dict[int, int] = {}  # a prefill's sequence (id) -> the row of its position 0
    for seq, n in batch.prefills:
        start = seq.num_computed
        q_start = len(ids) + sum(q for _, q in spans)
        first_row[id(seq)] = q_start - start
        spans.append((q_start, n))
        end = start + n
        fresh = fresh and start == 0
        table = seq.page_table[: -(-end // page_size)]
        chunk_rows.append(table)
        chunk_ctx.append(end)
        chunk_pos.append(torch.arange(start, end))
        chunk_pages.append(torch.tensor(table, dtype=torch.long))
        if end == seq.num_tokens:
            sample_rows.append(q_start + n - 1)
            sample_seqs.append(seq)
    for seq, n in batch.prefills:
        ids += seq.tokens[seq.num_computed : seq.num_computed + n]
    for seq, draft in batch.verifies:  # a chunk of the last token and the draft, every row sampled
        start = seq.num_tokens - 1
        n = len(draft) + 1
        q_start = len(ids)
        spans.append((q_start, n))
        end = start + n
        fresh = False
        table = seq.page_table[: -(-end // page_size)]
        chunk_rows.append(table)
        chunk_ctx.append(end)
        chunk_pos.append(torch.arange(start, end))
        chunk_pages.append(torch.tensor(table, dtype=torch.long))
        sample_rows.extend(range(q_start, q_start + n))
        ids += [seq.last_token, *draft]
    for seq, p, n in batch.scored:  # prompt rows to score come last
        sample_rows.extend(range(first_row[id(seq)] + p, first_row[id(seq)] + p + n))
    ids_t = torch.tensor(ids, dtype=torch.long)
    pos_t = torch.tensor(pos, dtype=torch.long)
    slots_t = torch.tensor(slots, dtype=torch.long)
    if spans:
        chunk_p = torch.cat(chunk_pos)
        pages = torch.cat([pg[ps // page_size] for pg, ps in zip(chunk_pages, chunk_pos, strict=True)])
        pos_t = torch.cat((pos_t, chunk_p))
        slots_t = torch.cat((slots_t, pages * page_size + chunk_p % page_size))
    num_tokens = ids_t.shape[0]
    prefill = None
    if spans:
        q_lens = [n for _, n in spans]
        prefixed = [
            (i, q_start, n, chunk_ctx[i])
            for i, (q_start, n) in enumerate(spans[: len(batch.prefills)])
            if 0 < prefixed_rows <= n < chunk_ctx[i]
        ]
        paged = list(q_lens)
        for i, *_ in prefixed:
            paged[i] = 0
        prefill = PrefillChunks(
            q_starts=to_device(torch.tensor([s for s, _ in spans], dtype=torch.int32), device),
            q_lens=to_device(torch.tensor(q_lens, dtype=torch.int32), device),
            ctx_lens=to_device(torch.tensor(chunk_ctx, dtype=torch.int32), device),
            page_tables=to_device(_table(chunk_rows, max(len(r) for r in chunk_rows)), device),
            max_q_len=max(q_lens),
            spans=spans,
            is_fresh=fresh,
            num_verifies=len(batch.verifies),
            prefixed=prefixed,
            paged_q_lens=to_device(torch.tensor(paged, dtype=torch.int32), device) if prefixed else None,
            paged_max_q_len=max(paged),
        )
    width = max((len(r) for r in decode_rows), default=1)
    step = StepBatch(
        input_ids=to_device(ids_t, device),
        positions=to_device(pos_t, device),
        slots=to_device(slots_t, device),
        num_decodes=len(batch.decodes),
        decode_tables=to_device(_table(decode_rows, width), device),
        decode_ctx_lens=to_device(torch.tensor(ctx, dtype=torch.int32), device),
        decode_splits=splits_for,
        prefill=prefill,
        sample_index=None
        if len(sample_rows) == num_tokens and not batch.scored
        else to_device(torch.tensor(sample_rows, dtype=torch.long), device),
    )
    return step, sample_seqs


def verify_rows(batch: ScheduledBatch) -> tuple[list[int], list[int], list[list[int]], list[Sequence]]:
    """A step of decodes and speculative verifies (no prefill) as decode rows: one per decode,
    then one per token of each verify (its last token, then its draft), each row attending to
    its own prefix through its sequence's page table, as a decode of that position would.
    Returns the rows' input ids, positions and page tables, and the decoding sequences (their
    rows come first; every verify row follows, in order, as :meth:`ModelRunner.execute` says).
    The rows run as a decode step with ``kv_first`` (a CUDA graph per row count)."""
    assert not batch.prefills
    ids: list[int] = []
    positions: list[int] = []
    tables: list[list[int]] = []
    for seq in batch.decodes:
        ids.append(seq.last_token)
        positions.append(seq.num_tokens - 1)
        tables.append(seq.page_table)
    for seq, draft in batch.verifies:
        start = seq.num_tokens - 1
        for j, token in enumerate([seq.last_token, *draft]):
            ids.append(token)
            positions.append(start + j)
            tables.append(seq.page_table)
    return ids, positions, tables, list(batch.decodes)


def rows_step(
    ids: list[int], positions: list[int], tables: list[list[int]], page_size: int, device: torch.device, splits: int
) -> StepBatch:
    """Decode rows (:func:`verify_rows`) as a step run eagerly: what the verify graphs replay."""
    width = max(p // page_size + 1 for p in positions)
    slots = [t[p // page_size] * page_size + p % page_size for p, t in zip(positions, tables, strict=True)]
    return StepBatch(
        input_ids=to_device(torch.tensor(ids, dtype=torch.long), device),
        positions=to_device(torch.tensor(positions, dtype=torch.long), device),
        slots=to_device(torch.tensor(slots, dtype=torch.long), device),
        num_decodes=len(ids),
        decode_tables=to_device(_table([t[:width] for t in tables], width), device),
        decode_ctx_lens=to_device(torch.tensor([p + 1 for p in positions], dtype=torch.int32), device),
        decode_splits=splits,
        prefill=None,
        sample_index=None,
        kv_first=True,
    )
