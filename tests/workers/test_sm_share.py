"""Co-located prefill's SM share (``--prefill-sms auto``): the rule, and the stream moves it
makes, in plain Python (the green contexts themselves need a GPU: bench/one_gpu_pd.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli import build_parser
from pdserve.engine.outputs import ExecResult, Launched
from pdserve.engine.sequence import ScheduledBatch
from pdserve.workers.sm_share import PrefillShare, ShareRule, levels_for, parse_prefill_sms


def test_levels_are_even_shares_below_the_whole_gpu() -> None:
    assert levels_for(132) == (44, 66, 100)
    assert levels_for(16) == (6, 8, 12)
    assert levels_for(3) == (2,)  # what is left of a tiny GPU: one level
    assert all(0 < n < 132 and n % 2 == 0 for n in levels_for(132, (0.01, 0.5, 0.999)))


def test_parse_prefill_sms() -> None:
    assert parse_prefill_sms("auto") == "auto"
    assert parse_prefill_sms("66") == 66 and parse_prefill_sms("0") == 0 and parse_prefill_sms("-1") == -1
    for bad in ("half", "-2", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_prefill_sms(bad)
    args = build_parser().parse_args(["colocated"])
    assert args.prefill_sms == "auto" and args.prefill_wait_target == 2.0


def test_nothing_decoding_takes_the_largest_level() -> None:
    rule = ShareRule((44, 66, 100))
    assert rule.choose(decoding=0, waiting_tokens=0) == 100
    assert rule.choose(decoding=0, waiting_tokens=10**6) == 100


def test_unmeasured_rule_takes_the_middle_level() -> None:
    assert ShareRule((44, 66, 100)).choose(decoding=8, waiting_tokens=2048) == 66


def test_fewest_sms_that_drain_the_queue_within_the_target() -> None:
    rule = ShareRule((44, 66, 100), target=0.5)
    rule.observe(66, 2048, 0.1)  # 20,480 tokens/s at 66; scaled: 13,653 at 44, 31,030 at 100
    assert rule.rate(44) == pytest.approx(20480 * 44 / 66)
    assert rule.choose(decoding=16, waiting_tokens=0) == 44
    assert rule.choose(decoding=16, waiting_tokens=6000) == 44  # 0.44 s at 44
    assert rule.choose(decoding=16, waiting_tokens=8000) == 66  # 0.59 s at 44, 0.39 s at 66
    assert rule.choose(decoding=16, waiting_tokens=14000) == 100
    assert rule.choose(decoding=16, waiting_tokens=10**6) == 100  # more than any can: the most
    rule.observe(44, 2048, 0.1)  # 44 measured as fast as 66: then 44 clears 8,000 in time
    assert rule.choose(decoding=16, waiting_tokens=8000) == 44


def test_rates_are_a_running_average_and_ignore_empty_steps() -> None:
    rule = ShareRule((44, 66))
    rule.observe(66, 1000, 0.1)
    rule.observe(66, 2000, 0.1)
    assert rule.rates[66] == pytest.approx(0.7 * 10000 + 0.3 * 20000)
    rule.observe(66, 0, 0.1)
    rule.observe(44, 100, 0.0)
    assert rule.rates == {66: pytest.approx(13000)}


def test_rule_refuses_bad_settings() -> None:
    for levels in ((), (66, 44), (44, 44)):
        with pytest.raises(ValueError, match="levels"):
            ShareRule(levels)
    with pytest.raises(ValueError, match="target"):
        ShareRule((44,), target=0)


@dataclass
class FakeStream:
    name: int
    waited: list[Any] = field(default_factory=list)

    def wait_stream(self, other: Any) -> None:
        self.waited.append(other)


@dataclass
class FakeEngine:
    num_running: int = 0
    num_prefill_tokens_waiting: int = 0


def test_share_moves_prefill_between_streams_in_order_and_learns_rates() -> None:
    streams = {sms: FakeStream(sms) for sms in (44, 66, 100)}
    first = FakeStream(0)
    current: list[Any] = [first]
    counted: list[int] = []
    decode, prefill = FakeEngine(), FakeEngine()
    share = PrefillShare(
        ShareRule((44, 66, 100)),
        streams,
        decode,  # type: ignore[arg-type]
        count=counted.append,
        current_stream=lambda: current[-1],
        set_stream=current.append,
    )
    share.prefill = prefill  # type: ignore[assignment]

    def step(prefill_tokens: int, gpu: float, period: float | None = None) -> None:
        batch = ScheduledBatch([], [(object(), prefill_tokens)])  # type: ignore[list-item]
        share.before_launch(batch)
        launched = Launched(batch, [], 0.0)
        share.after_launch(launched)
        share.after_collect(launched, ExecResult([], [], [], 1.0, gpu, period))

    step(2048, 0.05)  # nothing decoding: the largest level, after what was queued before
    assert current[-1] is streams[100] and streams[100].waited == [first]
    assert share.rule.rates == {100: pytest.approx(2048 / 0.05)}
    decode.num_running, prefill.num_prefill_tokens_waiting = 16, 2048
    step(2048, 0.2, period=0.1)  # queued behind the step before: the period is its own time
    assert current[-1] is streams[44] and streams[44].waited == [streams[100]]
    assert share.rule.rates[44] == pytest.approx(2048 / 0.1)
    step(2048, 0.1)  # the same level: no move
    assert len(current) == 3 and streams[44].waited == [streams[100]]
    assert counted == [100, 44, 44] and share.steps == {44: 2, 66: 0, 100: 1}
    assert share.current == 44 and not share._launched_at


def test_engine_tells_its_observer_of_every_step_and_runs_the_same() -> None:
    import torch

    from pdserve.bench import shapes
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.model_runner import ModelRunner, ModelSpec
    from tests.engine.reference import run

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []
            self.launched: list[Launched] = []

        def before_launch(self, batch: ScheduledBatch) -> None:
            self.calls.append(("before", batch.num_tokens))

        def after_launch(self, launched: Launched) -> None:
            self.calls.append(("after", launched.batch.num_tokens))
            self.launched.append(launched)

        def after_collect(self, launched: Launched, result: ExecResult) -> None:
            assert launched is self.launched.pop(0) and result.seconds > 0
            self.calls.append(("collected", launched.batch.num_tokens))

    model = shapes.small_model("qwen2", torch.device("cpu"))
    config = EngineConfig(device="cpu", max_total_tokens=256)
    prompts = [[5, 9, 11, 200, 7], [3, 4]]
    plain = run(Engine(ModelRunner(ModelSpec(Path("m")), config, model=model), config), prompts, 4)
    engine = Engine(ModelRunner(ModelSpec(Path("m")), config, model=model), config)
    recorder = Recorder()
    engine.observer = recorder
    assert run(engine, prompts, 4) == plain
    assert recorder.calls[:3] == [("before", 7), ("after", 7), ("collected", 7)]
    assert [c for c, _ in recorder.calls] == ["before", "after", "collected"] * engine.stats.steps
    assert not recorder.launched
