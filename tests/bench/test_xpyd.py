"""The plain parts of bench/xpyd.py: configuration names, the split the autoscaling rule's
needs ask for, and the conclusion drawn from a run (the run itself needs several GPUs; its
dry run, ``--small --device cpu``, is in the docs)."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any

import pytest


def test_configuration_names(xpyd: ModuleType) -> None:
    assert xpyd.parse_config("1P3D") == (1, 3, 0)
    assert xpyd.parse_config("2p2d") == (2, 2, 0)
    assert xpyd.parse_config("4U") == (0, 0, 4)
    with pytest.raises(argparse.ArgumentTypeError):
        xpyd.parse_config("2P")
    assert xpyd.default_configs(4) == ["1P3D", "2P2D", "3P1D", "4U"]
    assert xpyd.default_configs(2) == ["1P1D", "2U"]


def test_the_rules_split_follows_the_needs_and_keeps_a_worker_of_each_role(xpyd: ModuleType) -> None:
    assert xpyd.split_for({"prefill": 3.0, "decode": 1.0}, 4) == 3
    assert xpyd.split_for({"prefill": 1.0, "decode": 1.0}, 4) == 2
    assert xpyd.split_for({"prefill": 0.2, "decode": 5.0}, 4) == 1
    assert xpyd.split_for({"prefill": 9.0, "decode": 0.0}, 4) == 3  # never all four
    assert xpyd.split_for({"prefill": 0.0, "decode": 0.0}, 4) is None
    assert xpyd.split_for(None, 4) is None


def point(rate: float, goodput: float, rule: int | None = None) -> dict[str, Any]:
    return {"rate": rate, "goodput_rps": goodput, "rule_prefill_gpus": rule}


def test_the_conclusion_names_the_best_split_and_whether_the_rule_chose_it(xpyd: ModuleType) -> None:
    def run(prefill_heavy: list[dict[str, Any]]) -> dict[str, Any]:
        return {"workloads": {"prefill_heavy": {"points": prefill_heavy}}}

    result: dict[str, Any] = {
        "workloads": {"prefill_heavy": {}},
        "systems": {
            "1P3D": run([point(2, 1.9, 2), point(4, 2.5, 3)]),
            "2P2D": run([point(2, 2.0, 3), point(4, 3.1, 3)]),
            "3P1D": run([point(2, 2.0, 3), point(4, 3.6, 3)]),
            "4U": run([point(2, 2.0), point(4, 2.2)]),
        },
    }
    xpyd.conclude(result, 4)
    c = result["conclusion"]["prefill_heavy"]
    assert c["goodput_rps"] == {"1P3D": 2.5, "2P2D": 3.1, "3P1D": 3.6, "4U": 2.2}
    assert c["best"] == "3P1D" and c["best_disaggregated"] == "3P1D"
    assert c["rule_prefill_gpus_at_each_best_point"] == {"1P3D": 3, "2P2D": 3, "3P1D": 3}
    assert c["rule_choice"] == "3P1D" and c["rule_chose_best_disaggregated"] is True
    assert result["systems"]["2P2D"]["goodput_rps"] == {"prefill_heavy": 3.1}
    assert c["goodput_rps_max_itl"] == dict.fromkeys(("1P3D", "2P2D", "3P1D", "4U")) and c["best_max_itl"] is None

    # by each request's longest gap the order can turn: PD's hand-off is a gap its p99 forgives
    for name, strict in (("1P3D", 0.4), ("2P2D", 0.9), ("3P1D", 1.1), ("4U", 2.0)):
        result["systems"][name]["workloads"]["prefill_heavy"]["points"][-1]["goodput_rps_max_itl"] = strict
    xpyd.conclude(result, 4)
    c = result["conclusion"]["prefill_heavy"]
    assert c["best"] == "3P1D" and c["best_max_itl"] == "4U"
    assert c["goodput_rps_max_itl"]["2P2D"] == 0.9

    result["systems"]["3P1D"] = {"error": "RuntimeError: did not start"}  # a failed system is no candidate
    xpyd.conclude(result, 4)
    c = result["conclusion"]["prefill_heavy"]
    assert c["best"] == "2P2D" and c["rule_chose_best_disaggregated"] is False
