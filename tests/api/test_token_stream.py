"""api.token_stream: order, duplicates, and every reason to migrate, on plain chunks."""

from __future__ import annotations

from pdserve.api.token_stream import TokenStream
from pdserve.schemas import ErrorInfo, TokenChunk, TokenLogprob, Usage
from pdserve.schemas.tokens import ALIVE, HANDED_BACK, QUEUED, RETRYABLE


def chunk(seq: int, *tokens: int, attempt: int = 0, worker: str = "w", **kw: object) -> TokenChunk:
    return TokenChunk(rid="r", seq=seq, token_ids=tokens, attempt=attempt, worker_id=worker, **kw)  # type: ignore[arg-type]


def drained(stream: TokenStream) -> list[int]:
    out = []
    while not stream.queue.empty():
        out.extend(stream.queue.get_nowait().token_ids)
    return out


def test_chunks_come_out_in_order_without_duplicates() -> None:
    s = TokenStream("r")
    for c in (chunk(0, 10), chunk(2, 12), chunk(1, 11), chunk(1, 11), chunk(3, 13)):
        assert s.deliver(c) is None
    assert drained(s) == [10, 11, 12, 13] and s.output_ids == [10, 11, 12, 13]
    assert s.duplicates == 1 and s.next_seq == 4


def test_a_redo_that_repeats_the_clients_tokens_goes_on() -> None:
    s = TokenStream("r")
    for c in (chunk(0, 10), chunk(1, 11), chunk(2, 12)):
        s.deliver(c)
    # Another worker redoes the attempt (a redelivery) and reproduces what the client has.
    assert s.deliver(chunk(1, 11, worker="b")) is None
    assert s.deliver(chunk(2, 12, 13, worker="b")) is None  # straddles next_seq: the new part is taken
    assert drained(s) == [10, 11, 12, 13]


def test_a_redo_that_differs_is_never_spliced_in() -> None:
    s = TokenStream("r")
    for c in (chunk(0, 10), chunk(1, 11), chunk(2, 12)):
        s.deliver(c)
    reason = s.deliver(chunk(1, 99, worker="b"))
    assert reason is not None and "differently" in reason
    assert drained(s) == [10, 11, 12]  # nothing of b's reached the client


def test_only_the_current_attempt_counts() -> None:
    s = TokenStream("r")
    s.deliver(chunk(0, 10))
    s.restart(1, now=5.0)
    assert s.deliver(chunk(1, 77, attempt=0)) is None and s.stale == 1
    assert s.deliver(chunk(1, 11, attempt=1)) is None
    assert drained(s) == [10, 11]


def test_a_gap_that_does_not_fill_means_a_lost_chunk() -> None:
    s = TokenStream("r")
    s.deliver(chunk(0, 10), now=0.0)
    s.deliver(chunk(2, 12), now=0.1)
    assert s.expired(now=0.8, stall_timeout=10.0, gap_timeout=1.0) is None
    assert "chunk 1 was lost" in (s.expired(now=1.2, stall_timeout=10.0, gap_timeout=1.0) or "")
    s.deliver(chunk(1, 11), now=1.0)
    assert s.expired(now=1.2, stall_timeout=10.0, gap_timeout=1.0) is None


def test_silence_counts_only_while_a_worker_holds_the_request() -> None:
    s = TokenStream("r")
    assert s.expired(now=100.0, stall_timeout=3.0, gap_timeout=1.0) is None  # waits in the request queue
    s.deliver(chunk(0, state=ALIVE), now=1.0)  # a prefill worker took it
    assert s.expired(now=3.5, stall_timeout=3.0, gap_timeout=1.0) is None
    assert "no word" in (s.expired(now=4.5, stall_timeout=3.0, gap_timeout=1.0) or "")
    s.deliver(TokenChunk(rid="r", seq=0, token_ids=(10,), state=QUEUED), now=4.0)  # handed to the KV queue
    assert s.expired(now=60.0, stall_timeout=3.0, gap_timeout=1.0) is None
    s.deliver(chunk(1, state=ALIVE), now=61.0)  # a decode worker took it
    assert s.expired(now=65.0, stall_timeout=3.0, gap_timeout=1.0) is not None


def test_a_late_hand_off_chunk_does_not_hide_the_decode_worker() -> None:
    s = TokenStream("r")
    s.deliver(chunk(1, state=ALIVE, worker="decode"), now=1.0)  # overtook the prefill's chunk
    s.deliver(TokenChunk(rid="r", seq=0, token_ids=(10,), state=QUEUED), now=1.1)
    assert not s.queued


def test_hand_back_and_retryable_errors_migrate_other_errors_end() -> None:
    s = TokenStream("r")
    assert "handed the request back" in (s.deliver(chunk(3, state=HANDED_BACK)) or "")
    failed = s.deliver(chunk(0, finish_reason="error", error=ErrorInfo("engine step failed", code=RETRYABLE)))
    assert failed is not None and "engine step failed" in failed
    assert s.queue.empty()
    assert s.deliver(chunk(0, finish_reason="error", error=ErrorInfo("too long", "invalid_request_error"))) is None
    assert s.queue.get_nowait().error is not None


def test_a_reader_behind_takes_everything_queued_as_one_chunk() -> None:
    s = TokenStream("r")
    usage = Usage(3, 4)
    for c in (
        chunk(0, 10, timings={"queue": 0.1}),
        chunk(1, 11, 12),
        chunk(3, 13, finish_reason="length", usage=usage),
    ):
        s.deliver(c)
    merged = s.take()
    assert merged is not None and merged.seq == 0 and merged.token_ids == (10, 11, 12, 13)
    assert merged.finish_reason == "length" and merged.usage == usage and merged.timings == {"queue": 0.1}
    assert s.take() is None and s.queue.empty()


def test_taking_stops_at_an_error_and_keeps_logprobs_in_step() -> None:
    s = TokenStream("r")
    lp = TokenLogprob(-0.5)
    s.deliver(chunk(0, 10, logprobs=(lp,)))
    s.deliver(chunk(1, 11, logprobs=(lp,)))
    s.deliver(TokenChunk(rid="r", seq=2, finish_reason="error", error=ErrorInfo("boom")))
    first = s.take()
    assert first is not None and first.token_ids == (10, 11) and first.logprobs == (lp, lp)
    second = s.take()
    assert second is not None and second.error is not None and second.token_ids == ()
    assert s.take() is None


def test_a_chunk_taken_while_waiting_is_merged_with_what_came_after_it() -> None:
    s = TokenStream("r")
    s.deliver(chunk(0, 10, state=QUEUED))  # a prefill worker's hand-off
    s.deliver(chunk(1, 11))
    waited = s.queue.get_nowait()  # what a reader blocked on the queue receives
    merged = s.take(waited)
    assert merged is not None and merged.token_ids == (10, 11) and merged.state == ""
