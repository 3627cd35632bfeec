"""Issue 8's chaos cases, small, against one real `pdserve up` (2 prefill + 2 decode
workers, its own nats-server, Mooncake over tcp). bench/chaos.py runs them at full size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.bench import chaos_cases as cases
from pdserve.bench.chaos import ChaosSystem

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ChaosSystem]:
    running = ChaosSystem(tmp_path_factory.mktemp("chaos"), tiny_model_dir).start()
    yield running
    running.stop()


@pytest.fixture
def ready(system: ChaosSystem) -> ChaosSystem:
    system.wait_ready()  # workers killed by an earlier case are back
    return system


def check(result: cases.CaseResult, system: ChaosSystem) -> None:
    assert result.passed, f"{result.case}: {result.figure}\n{system.log()[-3000:]}"


async def test_kill_9_of_a_decode_worker_loses_no_stream(ready: ChaosSystem) -> None:
    check(await cases.decode_kill(ready, n=16, max_new=160, min_held=4), ready)


async def test_kill_9_of_a_prefill_worker_loses_no_request(ready: ChaosSystem) -> None:
    check(await cases.prefill_kill(ready, n=8, prompt_len=1200), ready)


async def test_sigterm_of_workers_hands_back_with_the_tokens_so_far(ready: ChaosSystem) -> None:
    check(await cases.drain(ready, n=8, max_new=128), ready)


async def test_kill_9_and_restart_of_the_broker_loses_no_accepted_request(ready: ChaosSystem) -> None:
    check(await cases.broker_restart(ready, n=8, max_new=128), ready)


async def test_client_disconnects_give_pages_back_at_once(ready: ChaosSystem) -> None:
    check(await cases.disconnects(ready, n=10), ready)


async def test_failed_pulls_and_expired_handles_end_in_seconds(ready: ChaosSystem) -> None:
    check(await cases.transfer_faults(ready, n=10), ready)


async def test_redelivery_and_duplicate_publish_neither_repeat_nor_splice(ready: ChaosSystem) -> None:
    check(await cases.redelivery(ready, n=8, max_new=48), ready)


async def test_many_concurrent_streams_all_complete(ready: ChaosSystem) -> None:
    check(await cases.many_streams(ready, n=200), ready)


async def test_a_huge_body_is_refused_at_once_while_streams_run(ready: ChaosSystem) -> None:
    # The ITL comparison needs quiet cores (bench/chaos.py); here: 413s at once, streams whole.
    check(await cases.huge_body(ready, streams=4, max_new=100, rounds=1, check_itl=False), ready)
