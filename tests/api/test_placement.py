"""The placement rule (plain Python): which path a request takes under which load."""

from __future__ import annotations

import pytest

from pdserve.api.placement import DISAGGREGATED, LOCAL, DecodeRoom, Load, PlacementConfig, choose
from pdserve.schemas import WorkerInfo, WorkerStats

ON = PlacementConfig(conditional_disagg=True, local_prefill_max_tokens=128, local_prefill_max_tokens_busy=512)
ROOMY = DecodeRoom(pages_free=900, pages_total=1000, page_size=16)
IDLE = Load(prefill_workers=1, decode=(ROOMY,), known=True)


def test_off_every_request_is_disaggregated() -> None:
    assert choose(10, 0, IDLE, PlacementConfig()).path == DISAGGREGATED


def test_a_short_prompt_is_prefilled_on_a_decode_worker_a_long_one_is_not() -> None:
    assert choose(128, 0, IDLE, ON).path == LOCAL
    assert choose(129, 0, IDLE, ON).path == DISAGGREGATED


def test_what_is_cached_does_not_count() -> None:
    assert choose(1000, 900, IDLE, ON).path == LOCAL
    assert choose(1000, 800, IDLE, ON).path == DISAGGREGATED


def test_a_backed_up_prefill_pool_raises_the_limit() -> None:
    queued = Load(prefill_workers=2, prefill_queued=2, decode=(ROOMY,), known=True)
    assert choose(400, 0, queued, ON) == choose(512, 0, queued, ON)
    assert choose(400, 0, queued, ON).path == LOCAL
    assert choose(513, 0, queued, ON).path == DISAGGREGATED
    tokens = Load(prefill_workers=2, prefill_tokens_waiting=2 * ON.busy_prefill_tokens, decode=(ROOMY,), known=True)
    assert choose(400, 0, tokens, ON).path == LOCAL
    one_waits = Load(prefill_workers=2, prefill_queued=1, decode=(ROOMY,), known=True)
    assert choose(400, 0, one_waits, ON).path == DISAGGREGATED


def test_no_room_on_the_decode_side_keeps_the_disaggregated_path() -> None:
    full = DecodeRoom(pages_free=104, pages_total=1000, page_size=16)
    assert choose(64, 0, Load(prefill_workers=1, decode=(full,), known=True), ON).reason == "decode pages short"
    assert choose(64, 0, Load(prefill_workers=1, decode=(full, ROOMY), known=True), ON).path == LOCAL
    waiting = Load(prefill_workers=1, decode=(ROOMY, ROOMY), local_waiting=2 * ON.local_max_waiting, known=True)
    assert choose(64, 0, waiting, ON).reason == "local queue full"


def test_no_decode_worker_or_no_reading_yet_is_disaggregated_no_prefill_worker_is_local() -> None:
    assert choose(10, 0, Load(), ON).path == DISAGGREGATED
    assert choose(10, 0, Load(prefill_workers=1, known=True), ON).path == DISAGGREGATED
    assert choose(4000, 0, Load(decode=(ROOMY,), known=True), ON) == choose(1, 0, Load(decode=(ROOMY,), known=True), ON)
    assert choose(4000, 0, Load(decode=(ROOMY,), known=True), ON).path == LOCAL


def test_the_load_is_read_from_the_registry_entries_of_the_model() -> None:
    def worker(role: str, model: str = "m", used: int = 10, waiting: int = 0) -> WorkerInfo:
        stats = WorkerStats(prefill_tokens_waiting=waiting)
        return WorkerInfo(f"{role}-{model}-{used}", role, model, "h", 1, 8, 100, used, 16, 0, stats=stats)

    entries = [worker("prefill", waiting=300), worker("prefill", waiting=200), worker("decode", used=40)]
    entries += [worker("decode", model="other"), worker("unified")]
    load = Load.read(entries, "m", prefill_queued=3, local_waiting=1)
    assert load == Load(2, 500, 3, (DecodeRoom(60, 100, 16),), 1, known=True)


def test_the_config_refuses_limits_that_make_no_sense() -> None:
    with pytest.raises(ValueError):
        PlacementConfig(local_prefill_max_tokens=256, local_prefill_max_tokens_busy=128)
    with pytest.raises(ValueError):
        PlacementConfig(decode_reserve=1.0)
    with pytest.raises(ValueError):
        PlacementConfig(local_max_waiting=0)
