"""Scheduler policy driven without a model: a fake engine emulates forward passes.

The fake engine also emulates the KV pool: every slot written records which token
prefix it holds, so a test can check that each scheduled sequence reads exactly its
own tokens' KV (prefix hits, eviction and preemption included).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.page_manager import PageManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import ScheduledBatch, Sequence, Status
from pdserve.schemas import SamplingParams

PS = 4


def _config(**kw: int | bool) -> EngineConfig:
    base: dict[str, int | bool] = {
        "page_size": PS,
        "chunked_prefill_size": 64,
        "max_prefill_seqs": 16,
        "max_num_seqs": 128,
    }
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _sched(num_pages: int, **kw: int | bool) -> Scheduler:
    config = _config(**kw)
    return Scheduler(config, PageManager(num_pages, config.page_size, config.enable_prefix_cache))


def _seq(rid: str, prompt: list[int], arrival: float, max_new: int = 8, priority: int = 0) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_new_tokens=max_new, priority=priority), arrival=arrival)


@dataclass
class FakeEngine:
    """Plays the engine around a scheduler: compute, sample a fake token, finish after N outputs."""

    sched: Scheduler
    outputs: dict[str, int] = field(default_factory=dict)  # rid -> outputs before it finishes
    kv: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict, repr=False)  # (page, slot) -> token prefix
    finished: list[Sequence] = field(default_factory=list, repr=False)
    steps: int = 0
    idle_steps: int = 0

    def add(self, seq: Sequence, num_outputs: int) -> None:
        assert self.sched.fits_ever(seq.num_tokens + num_outputs), "a request the engine would refuse"
        self.outputs[seq.rid] = num_outputs
        self.sched.add(seq)

    def _check_context(self, seq: Sequence, upto: int) -> None:
        """The KV of ``seq.tokens[:upto]`` is in its pages."""
        ps = self.sched.page_size
        tokens = seq.tokens
        for q in range(upto):
            page = seq.page_table[q // ps]
            assert self.kv.get((page, q % ps)) == tuple(tokens[: q + 1]), f"{seq.rid}: wrong KV at position {q}"

    def _write(self, seq: Sequence, start: int, stop: int) -> None:
        ps = self.sched.page_size
        pages = self.sched.pages
        tokens = seq.tokens
        assert len(seq.page_table) >= pages.pages_for(stop), f"{seq.rid}: no page for position {stop - 1}"
        for q in range(start, stop):
            page = seq.page_table[q // ps]
            # never write into a page someone else reads, nor into an indexed (immutable) page
            assert pages.ref_count(page) == 1, f"{seq.rid}: writing into shared page {page}"
            assert page not in pages._hash_of, f"{seq.rid}: writing into cached page {page}"
            self.kv[(page, q % ps)] = tuple(tokens[: q + 1])

    def step(self) -> ScheduledBatch:
        sched = self.sched
        config = sched.config
        batch = sched.schedule()
        self.steps += 1
        self.idle_steps = self.idle_steps + 1 if batch.is_empty else 0
        seqs = batch.decodes + [s for s, _ in batch.prefills]
        assert len({id(s) for s in seqs}) == len(seqs), "a sequence is scheduled twice"
        assert len(batch.prefills) <= config.max_prefill_seqs
        assert sum(n for _, n in batch.prefills) <= max(0, config.chunked_prefill_size - len(batch.decodes))
        assert all(n >= 1 for _, n in batch.prefills)
        assert all(s.status is Status.RUNNING for s in batch.decodes)
        assert all(s.status is Status.WAITING for s, _ in batch.prefills)
        sched.pages.check_invariants()
        # forward pass
        for seq in batch.decodes:
            assert seq.num_computed == seq.num_tokens - 1
            self._check_context(seq, seq.num_computed)
            self._write(seq, seq.num_computed, seq.num_tokens)
        for seq, n in batch.prefills:
            assert seq.num_computed + n <= seq.num_tokens
            self._check_context(seq, seq.num_computed)
            self._write(seq, seq.num_computed, seq.num_computed + n)
        # postprocess, as Engine.postprocess does
        for seq in batch.decodes:
            sched.on_computed(seq, 1)
        for seq, n in batch.prefills:
            sched.on_computed(seq, n)
        for seq in seqs:
            if seq.num_computed != seq.num_tokens:
                continue  # a prefill chunk that is not the last one
            seq.output_ids.append(1000 + zlib.crc32(f"{seq.rid}/{len(seq.output_ids)}".encode()) % 50)
            if len(seq.output_ids) >= self.outputs[seq.rid]:
                sched.remove(seq)
                seq.status = Status.FINISHED
                self.finished.append(seq)
            elif seq.status is Status.WAITING:
                sched.start_running(seq)
        sched.pages.check_invariants()
        assert len(sched.running) <= config.max_num_seqs
        return batch

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_work():
            self.step()
            assert self.idle_steps < 3, (
                f"no progress: {len(self.sched.waiting)} waiting, {len(self.sched.running)} running, "
                f"{self.sched.pages.num_free_pages}/{self.sched.pages.num_pages} pages free, "
                f"waiting holds {[len(s.page_table) for s in self.sched.waiting]} pages"
            )
            assert self.steps < max_steps, "simulation did not finish"


# ---- chunked prefill --------------------------------------------------------------------


def test_chunked_prefill_respects_token_budget() -> None:
    sched = _sched(64, chunked_prefill_size=32)
    a = _seq("a", list(range(50)), 0.0)
    b = _seq("b", list(range(100, 140)), 1.0)
    sched.add(a)
    sched.add(b)
    eng = FakeEngine(sched, {"a": 3, "b": 3})

    batch = eng.step()
    assert batch.decodes == []
    assert [(s.rid, n) for s, n in batch.prefills] == [("a", 32)]
    assert a.num_computed == 32 and len(a.page_table) == 8
    assert b.page_table == [] and b.num_computed == 0

    batch = eng.step()
    assert [(s.rid, n) for s, n in batch.prefills] == [("a", 18), ("b", 14)]
    assert a.status is Status.RUNNING and a.output_ids  # a's prompt is done: first token out

    batch = eng.step()
    assert batch.decodes == [a]
    assert [(s.rid, n) for s, n in batch.prefills] == [("b", 26)]  # 32 minus one decode token
    assert batch.num_tokens == 27
    assert b.status is Status.RUNNING

    batch = eng.step()
    assert batch.decodes == [a, b] and batch.prefills == []
    eng.run()
    assert {s.rid for s in eng.finished} == {"a", "b"}
    assert sched.pages.num_free_pages == sched.pages.num_pages


def test_max_prefill_seqs_caps_prefills_per_step() -> None:
    sched = _sched(64, chunked_prefill_size=64, max_prefill_seqs=2)
    eng = FakeEngine(sched)
    seqs = [_seq(f"s{i}", [i, i + 1, i + 2], float(i)) for i in range(5)]
    for s in seqs:
        eng.add(s, 2)
    batch = eng.step()
    assert [s.rid for s, _ in batch.prefills] == ["s0", "s1"]
    assert all(n == 3 for _, n in batch.prefills)
    assert all(s.page_table == [] for s in seqs[2:])  # not even admitted yet
    batch = eng.step()
    assert [s.rid for s in batch.decodes] == ["s0", "s1"]
    assert [s.rid for s, _ in batch.prefills] == ["s2", "s3"]
    eng.run()
    assert len(eng.finished) == 5


def test_max_num_seqs_caps_the_batch() -> None:
    sched = _sched(64, max_num_seqs=2)
    eng = FakeEngine(sched)
    for i in range(4):
        eng.add(_seq(f"s{i}", [i] * 5, float(i)), 4)
    batch = eng.step()
    assert [s.rid for s, _ in batch.prefills] == ["s0", "s1"]
    batch = eng.step()
    assert len(batch.decodes) == 2 and batch.prefills == []
    eng.run()
    assert len(eng.finished) == 4


def test_oldest_waiting_first() -> None:
    sched = _sched(64, chunked_prefill_size=8)
    eng = FakeEngine(sched)
    for rid, arrival in (("x", 0.0), ("y", 1.0)):
        eng.add(_seq(rid, list(range(20)), arrival), 1)
    assert [s.rid for s, _ in eng.step().prefills] == ["x"]
    assert [s.rid for s, _ in eng.step().prefills] == ["x"]
    assert [(s.rid, n) for s, n in eng.step().prefills] == [("x", 4), ("y", 4)]


def test_waiting_requests_go_by_priority_then_arrival() -> None:
    """Lower values first (vLLM's priority), ties in the order they came."""
    sched = _sched(64, max_num_seqs=1)
    eng = FakeEngine(sched)
    for rid, arrival, priority in (("a", 0.0, 0), ("b", 1.0, 5), ("c", 2.0, 0), ("d", 3.0, -2), ("e", 4.0, 5)):
        eng.add(_seq(rid, [1, 2, 3], arrival, priority=priority), 1)
    assert [s.rid for s in sched.waiting] == ["d", "a", "c", "b", "e"]
    eng.run()
    assert [s.rid for s in eng.finished] == ["d", "a", "c", "b", "e"]
    assert sched.num_priority_preemptions == 0


def test_a_higher_priority_request_takes_the_seat_of_a_lower_one() -> None:
    """A full batch: the newest running request of the lowest priority below the newcomer's
    waits again (ahead of the others of its priority), and comes back after."""
    sched = _sched(64, max_num_seqs=2)
    eng = FakeEngine(sched)
    a, b = _seq("a", [1] * 5, 0.0), _seq("b", [2] * 5, 1.0, priority=3)
    eng.add(a, 6)
    eng.add(b, 6)
    eng.step()
    eng.step()
    assert {s.rid for s in sched.running} == {"a", "b"}
    late = _seq("late", [4] * 5, 2.0, priority=3)  # the same priority as b: waits its turn
    eng.add(late, 3)
    eng.step()
    assert sched.num_priority_preemptions == 0 and late in sched.waiting
    urgent = _seq("urgent", [3] * 5, 3.0, priority=-1)
    eng.add(urgent, 3)
    batch = eng.step()
    assert sched.num_priority_preemptions == 1 and b.status is Status.WAITING and b.num_preemptions == 1
    assert [s.rid for s, _ in batch.prefills] == ["urgent"] and [s.rid for s in batch.decodes] == ["a"]
    assert [s.rid for s in sched.waiting] == ["b", "late"]  # b back ahead of its priority's others
    eng.run()
    order = [s.rid for s in eng.finished]
    assert set(order[:2]) == {"a", "urgent"} and order[2:] == ["b", "late"]
    assert all(len(s.output_ids) == eng.outputs[s.rid] for s in eng.finished)
    assert sched.num_priority_preemptions == 1  # a, of the same priority, was never asked to


def test_a_batch_grown_past_its_size_by_a_higher_priority_gives_back_the_lowest() -> None:
    """A decode worker imports an urgent request into a full batch: the next step sends the
    newest of the lowest priority back to wait; a batch of one priority is left as it is."""
    sched = _sched(64, max_num_seqs=2)
    eng = FakeEngine(sched)
    a, b = _seq("a", [1] * 5, 0.0), _seq("b", [2] * 5, 1.0, priority=2)
    eng.add(a, 6)
    eng.add(b, 6)
    eng.step()
    urgent = _seq("urgent", [3] * 5, 2.0, priority=-1)  # imported as Engine.reserve_import and commit_import do
    urgent.output_ids.append(1000)  # its first token, from the prefill worker
    eng.outputs["urgent"] = 3
    assert sched.pages.reserve_prompt(urgent, reserve=len(sched.running))
    eng._write(urgent, 0, urgent.num_tokens - 1)  # the KV pulled in
    urgent.num_computed = 0
    sched.on_computed(urgent, urgent.num_tokens - 1)
    sched.start_running(urgent)
    assert len(sched.running) == 3
    eng.step()
    assert b.status is Status.WAITING and sched.num_priority_preemptions == 1 and len(sched.running) == 2
    eng.run()
    assert {s.rid for s in eng.finished} == {"a", "b", "urgent"}


def test_pages_short_preempt_the_lowest_priority_first() -> None:
    sched = _sched(6)
    eng = FakeEngine(sched)
    a = _seq("a", [1] * 7, 1.0, priority=-1)
    b = _seq("b", [2] * 7, 2.0, priority=4)
    c = _seq("c", [3] * 7, 3.0)
    for s in (a, b, c):
        eng.add(s, 10)
    eng.step()
    eng.step()
    eng.step()  # each needs a third page; the pool is dry: b, the lowest priority, goes (not c, the newest)
    assert sched.num_preemptions == 1 and b.status is Status.WAITING and c.status is Status.RUNNING
    eng.run()
    assert {s.rid for s in eng.finished} == {"a", "b", "c"}


# ---- decode -------------------------------------------------------------------------------


def test_decodes_take_one_token_and_grow_pages_at_boundaries() -> None:
    sched = _sched(16)
    eng = FakeEngine(sched)
    seq = _seq("a", list(range(8)), 0.0)  # exactly two pages
    eng.add(seq, 10)
    batch = eng.step()
    assert [(s.rid, n) for s, n in batch.prefills] == [("a", 8)]
    assert len(seq.page_table) == 2
    assert seq.num_tokens == 9  # prompt + first output token
    table_sizes = []
    for _ in range(8):
        batch = eng.step()
        assert batch.decodes == [seq] and batch.prefills == [] and batch.num_tokens == 1
        # after scheduling, the pages cover every token whose KV this step writes
        table_sizes.append(len(seq.page_table))
    # the token at position 8 opens page 3, position 12 opens page 4
    assert table_sizes == [3, 3, 3, 3, 4, 4, 4, 4]
    assert sched.pages.num_used_pages == 4


def test_running_sequences_decode_in_arrival_order() -> None:
    sched = _sched(32)
    eng = FakeEngine(sched)
    late = _seq("late", [1, 2, 3], 5.0)
    early = _seq("early", [4, 5, 6], 1.0)
    eng.add(late, 5)
    eng.add(early, 5)
    eng.step()
    assert [s.rid for s in eng.step().decodes] == ["early", "late"]


# ---- preemption -------------------------------------------------------------------------


def test_newest_running_sequence_is_preempted() -> None:
    # 6 pages of 4 tokens; three 7-token prompts take 2 pages each
    sched = _sched(6)
    eng = FakeEngine(sched)
    a = _seq("a", [1] * 7, 1.0)
    b = _seq("b", [2] * 7, 2.0)
    c = _seq("c", [3] * 7, 3.0)
    for s in (c, a, b):  # the order of add() does not decide; arrival does
        eng.add(s, 10)  # 17 tokens: each fits the pool alone, not all three at once
    batch = eng.step()
    # one page of headroom per running sequence (the watermark) is kept; here it is all prefills
    assert {s.rid for s, _ in batch.prefills} == {"a", "b", "c"}
    assert sched.pages.num_free_pages == 0
    assert all(s.status is Status.RUNNING for s in (a, b, c))
    c_pages = list(c.page_table)
    # every sequence now has 8 tokens: the next decode writes position 7 (still page 2) ...
    batch = eng.step()
    assert batch.decodes == [a, b, c]
    # ... but the next needs a third page each, and the pool is dry: c (newest) goes
    batch = eng.step()
    assert sched.num_preemptions == 1
    assert c.status is Status.WAITING and c.num_preemptions == 1
    assert sched.waiting[0] is c
    assert c.page_table == [] and c.num_computed == 0
    assert c not in sched.running and c not in batch.decodes
    assert a in batch.decodes
    # c's pages went back to the pool (one was handed to an older sequence)
    assert any(p in a.page_table + b.page_table for p in c_pages)
    assert len(c.output_ids) == 2  # its output is kept and recomputed later
    eng.run()
    assert {s.rid for s in eng.finished} == {"a", "b", "c"}
    assert all(len(s.output_ids) == 10 for s in (a, b, c))
    assert sched.pages.num_free_pages == sched.pages.num_pages


def test_preempt_directly() -> None:
    sched = _sched(8)
    eng = FakeEngine(sched)
    a = _seq("a", [1] * 6, 1.0)
    b = _seq("b", [2] * 6, 2.0)
    eng.add(a, 5)
    eng.add(b, 5)
    eng.step()
    sched.preempt(a)
    assert sched.num_preemptions == 1 and a.num_preemptions == 1
    assert list(sched.waiting) == [a] and sched.running == [b]
    assert a.page_table == [] and a.status is Status.WAITING
    assert sched.pages.num_used_pages == len(b.page_table)
    eng.run()
    assert len(eng.finished) == 2


def _simulate_tiny_pool(seed: int) -> Scheduler:
    """25 random requests (some sharing a prefix) through a 10-page pool, to completion."""
    rng = random.Random(seed)
    num_pages = 10
    sched = _sched(num_pages, chunked_prefill_size=rng.choice([4, 8, 16]), max_prefill_seqs=rng.choice([1, 3, 16]))
    eng = FakeEngine(sched)
    shared = [rng.randrange(30) for _ in range(12)]
    for i in range(25):
        prompt_len = rng.randrange(1, 22)
        # some prompts share a prefix, so prefix hits and evictions both happen
        prompt = shared[:prompt_len] if rng.random() < 0.4 else [rng.randrange(30) for _ in range(prompt_len)]
        num_outputs = rng.randrange(1, 14)
        eng.add(_seq(f"s{i}", prompt, float(i)), num_outputs)
    eng.run()
    assert len(eng.finished) == 25
    assert all(len(s.output_ids) == eng.outputs[s.rid] for s in eng.finished)
    assert sched.pages.num_free_pages == sched.pages.num_pages
    assert sched.pages.num_used_pages == 0
    sched.pages.check_invariants()
    return sched


@pytest.mark.parametrize("seed", range(8))
def test_tiny_pool_many_sequences_all_finish(seed: int) -> None:
    _simulate_tiny_pool(seed)


def test_tiny_pool_simulation_preempts() -> None:
    """The random simulations really run out of pages (they are not trivially easy)."""
    assert _simulate_tiny_pool(1).num_preemptions > 0


def test_partial_prefill_holding_pages_does_not_deadlock() -> None:
    """A (older) decodes until the pool is dry while B's half-done prefill holds pages.

    8 pages of 4 tokens, 8-token prefill budget. A: 12-token prompt, B: 20-token prompt.
    When A is preempted it is the only running sequence; it must not wait forever for
    pages that B's unfinished prefill holds (B never runs, so it is never preempted).
    """
    sched = _sched(8, chunked_prefill_size=8)
    eng = FakeEngine(sched)
    eng.add(_seq("a", list(range(12)), 0.0), 15)
    eng.add(_seq("b", list(range(100, 120)), 1.0), 2)
    eng.run(max_steps=500)
    assert {s.rid for s in eng.finished} == {"a", "b"}
    assert sched.pages.num_free_pages == sched.pages.num_pages


# ---- prefix reuse -----------------------------------------------------------------------


def test_prefix_reuse_after_first_sequence_finished() -> None:
    sched = _sched(32)
    eng = FakeEngine(sched)
    prompt = list(range(1, 15))  # 3 full pages + 2 tokens
    first = _seq("first", prompt, 0.0)
    eng.add(first, 3)
    eng.run()
    assert sched.pages.num_free_pages == 32
    assert sched.pages.num_cached_pages >= 3

    second = _seq("second", [*prompt[:13], 99], 1.0)  # shares 3 full pages
    eng.add(second, 3)
    batch = eng.step()
    assert second.num_cached == 12
    assert [(s.rid, n) for s, n in batch.prefills] == [("second", 2)]
    eng.run()
    assert sched.pages.num_free_pages == 32


@pytest.mark.parametrize("length", [4, 8, 12, 13])
def test_fully_cached_prompt_still_computes_a_token(length: int) -> None:
    sched = _sched(32)
    eng = FakeEngine(sched)
    prompt = list(range(50, 50 + length))
    eng.add(_seq("first", prompt, 0.0), 1)
    eng.run()
    again = _seq("again", list(prompt), 1.0)
    eng.add(again, 2)
    batch = eng.step()
    # every full page is cached, but the last token is always computed (to sample from)
    expected_cached = ((length - 1) // PS) * PS
    assert again.num_cached == expected_cached
    assert [(s.rid, n) for s, n in batch.prefills] == [("again", length - expected_cached)]
    assert length - expected_cached >= 1
    eng.run()
    assert sched.pages.num_free_pages == 32


def test_prefix_shared_between_concurrent_sequences() -> None:
    sched = _sched(32)
    eng = FakeEngine(sched)
    system = list(range(200, 216))  # 4 full pages
    a = _seq("a", [*system, 1, 2], 0.0)
    eng.add(a, 10)
    eng.step()  # a's prompt computed and indexed
    b = _seq("b", [*system, 3, 4, 5], 1.0)
    eng.add(b, 10)
    eng.step()
    assert b.num_cached == 16
    assert b.page_table[:4] == a.page_table[:4]
    assert all(sched.pages.ref_count(p) == 2 for p in a.page_table[:4])
    eng.run()
    assert sched.pages.num_free_pages == 32


def test_no_prefix_reuse_when_cache_disabled() -> None:
    sched = _sched(32, enable_prefix_cache=False)
    eng = FakeEngine(sched)
    prompt = list(range(16))
    eng.add(_seq("first", prompt, 0.0), 1)
    eng.run()
    again = _seq("again", prompt, 1.0)
    eng.add(again, 1)
    batch = eng.step()
    assert again.num_cached == 0
    assert [(s.rid, n) for s, n in batch.prefills] == [("again", 16)]


def test_remove_waiting_and_keep_pages() -> None:
    sched = _sched(16)
    eng = FakeEngine(sched)
    a = _seq("a", list(range(10)), 0.0)
    b = _seq("b", list(range(10)), 1.0)
    eng.add(a, 5)
    eng.add(b, 5)
    sched.remove(b)  # never scheduled
    assert list(sched.waiting) == [a]
    eng.step()
    pages = list(a.page_table)
    sched.remove(a, keep_pages=True)  # held for a transfer
    assert not sched.has_work()
    assert a.page_table == pages
    assert all(sched.pages.ref_count(p) == 1 for p in pages)
    sched.pages.free(a.page_table)
    assert sched.pages.num_free_pages == 16


def test_fits_ever() -> None:
    sched = _sched(4)
    assert sched.fits_ever(15)  # 15 + 1 tokens = 4 pages
    assert not sched.fits_ever(16)
