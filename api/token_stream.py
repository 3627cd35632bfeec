"""One request's chunks as the API receives them: put back in ``seq`` order, duplicates
dropped, and every reason to move the request to another worker noticed. Plain Python:
the gateway feeds it chunks and the clock, and does what it answers.

The client's tokens are the only truth. A request runs as attempts; chunks of any attempt
but the current one are ignored. Within an attempt, a token at ``seq < next_seq`` must be
the token the client already has: a worker that redoes the request (a redelivery after its
first worker died) may go on only while it reproduces exactly what the client saw, so a
continuation is always conditioned on the client's own tokens and two continuations are
never spliced. A redo that differs, a worker that hands the request back or fails it with
a retryable error, a gap that does not fill within ``gap_timeout``, or a worker that holds
the request and goes silent for ``stall_timeout`` all answer "migrate": the gateway starts
attempt ``n + 1`` from the tokens the client has.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from pdserve.schemas import TokenChunk
from pdserve.schemas.tokens import ALIVE, HANDED_BACK, QUEUED, RETRYABLE


class ChunkQueue(asyncio.Queue[TokenChunk]):
    """An ``asyncio.Queue`` whose next item can be looked at without taking it."""

    def _init(self, maxsize: int) -> None:
        # The subclass hook asyncio's own queues use; ``_queue`` is what qsize() reads.
        self._queue: collections.deque[TokenChunk] = collections.deque()

    def peek(self) -> TokenChunk | None:
        return self._queue[0] if self._queue else None


@dataclass
class TokenStream:
    """Chunks of one request, in ``seq`` order, without duplicates. ``queued``: the request
    waits in a stream for a worker (no chunk is due); else a worker holds it and must be
    heard from at least every ``stall_timeout``."""

    rid: str
    next_seq: int = 0
    attempt: int = 0
    queue: ChunkQueue = field(default_factory=ChunkQueue)
    early: dict[int, TokenChunk] = field(default_factory=dict)
    output_ids: list[int] = field(default_factory=list)
    queued: bool = True
    heard_at: float = 0.0
    gap_since: float | None = None
    live_seq: int = -1  # highest seq a holder said anything at (a later hand-off is news)
    duplicates: int = 0
    stale: int = 0
    migrations: int = 0

    def deliver(self, chunk: TokenChunk, now: float = 0.0) -> str | None:
        """Take one chunk; returns why the request must migrate, or ``None``."""
        if chunk.attempt != self.attempt:
            self.stale += 1
            return None
        self.heard_at = now
        if chunk.error is not None:
            if chunk.error.code == RETRYABLE:
                return f"worker {chunk.worker_id or '?'} failed: {chunk.error.message}"
            self.queue.put_nowait(chunk)
            return None
        if chunk.state == HANDED_BACK:
            return f"worker {chunk.worker_id or '?'} handed the request back"
        if chunk.state == ALIVE:
            self._heard_holder(chunk.seq)
            return None
        if chunk.seq < self.next_seq:
            return self._redo(chunk)
        if chunk.seq > self.next_seq:
            self.early[chunk.seq] = chunk
            if self.gap_since is None:
                self.gap_since = now
            return None
        self._push(chunk)
        while self.next_seq in self.early:
            self._push(self.early.pop(self.next_seq))
        self.gap_since = now if self.early else None
        return None

    def expired(self, now: float, stall_timeout: float, gap_timeout: float) -> str | None:
        """Why the request must migrate as of ``now``, or ``None``."""
        if self.gap_since is not None and now - self.gap_since > gap_timeout:
            return f"chunk {self.next_seq} was lost"
        if not self.queued and now - self.heard_at > stall_timeout:
            return f"no word from its worker for {now - self.heard_at:.1f}s"
        return None

    def restart(self, attempt: int, now: float) -> None:
        """Attempt ``attempt`` starts from the tokens the client has; it waits in the
        request queue first."""
        self.attempt = attempt
        self.migrations += 1
        self.early.clear()
        self.gap_since = None
        self.queued = True
        self.live_seq = -1
        self.heard_at = now

    def _heard_holder(self, seq: int) -> None:
        self.queued = False
        self.live_seq = max(self.live_seq, seq)

    def _redo(self, chunk: TokenChunk) -> str | None:
        """A chunk that starts before ``next_seq``: fine while it repeats the client's tokens."""
        known = self.output_ids[chunk.seq : self.next_seq]
        overlap = min(len(known), len(chunk.token_ids))
        ends_early = chunk.finish_reason is not None and len(chunk.token_ids) < len(known)
        if list(chunk.token_ids[:overlap]) != known[:overlap] or ends_early:
            return f"worker {chunk.worker_id or '?'} redid the request differently at token {chunk.seq}"
        self.duplicates += 1
        rest = chunk.token_ids[overlap:]
        if not rest and chunk.finish_reason is None:
            self._heard_holder(chunk.seq)
            return None
        tail = TokenChunk(
            rid=chunk.rid,
            seq=self.next_seq,
            token_ids=tuple(rest),
            finish_reason=chunk.finish_reason,
            stop_reason=chunk.stop_reason,
            usage=chunk.usage,
            logprobs=chunk.logprobs[overlap:] if chunk.logprobs else None,
            worker_id=chunk.worker_id,
            timings=chunk.timings,
            attempt=chunk.attempt,
        )
        self._push(tail)
        return None

    def take(self, first: TokenChunk | None = None) -> TokenChunk | None:
        """``first`` (or the next queued chunk) merged with every chunk already queued after
        it that continues it: a reader that fell behind catches up in one step instead of
        one per token. ``None`` when nothing is queued."""
        if first is None:
            if self.queue.empty():
                return None
            first = self.queue.get_nowait()
        merged = first
        while (after := self.queue.peek()) is not None and _continues(merged, after):
            merged = _merge(merged, self.queue.get_nowait())
        return merged

    def _push(self, chunk: TokenChunk) -> None:
        self.queue.put_nowait(chunk)
        self.output_ids.extend(chunk.token_ids)
        self.next_seq = chunk.seq + max(len(chunk.token_ids), 1 if chunk.finish_reason else 0)
        if chunk.state == QUEUED and chunk.seq >= self.live_seq:
            self.queued = True  # handed to the KV queue, and no decode worker spoke up yet
        else:
            self._heard_holder(chunk.seq)


def _continues(a: TokenChunk, b: TokenChunk) -> bool:
    """``b`` can be read as part of ``a``: both are tokens of one attempt, back to back."""
    return (
        a.error is None
        and b.error is None
        and a.finish_reason is None
        and a.attempt == b.attempt
        and b.seq == a.seq + len(a.token_ids)
        and (a.logprobs is None) == (b.logprobs is None or not b.token_ids)
    )


def _merge(a: TokenChunk, b: TokenChunk) -> TokenChunk:
    """One chunk with the tokens of ``a`` then ``b``; the end of the request, if it is
    one, is ``b``'s. A queue's ``state`` was read on delivery: the merged chunk has none."""
    logprobs = (a.logprobs or ()) + (b.logprobs or ())
    return TokenChunk(
        rid=a.rid,
        seq=a.seq,
        token_ids=a.token_ids + b.token_ids,
        finish_reason=b.finish_reason,
        stop_reason=b.stop_reason,
        usage=b.usage,
        logprobs=logprobs if a.logprobs is not None else None,
        prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs,
        worker_id=b.worker_id or a.worker_id,
        timings={**(a.timings or {}), **(b.timings or {})} or None,
        attempt=b.attempt,
    )
