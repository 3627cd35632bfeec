"""deploy/kubernetes/keda: the ScaledObjects' shape (offline, no cluster), and that they
name what pdserve really has: its streams and consumers, the metrics its API exports, the
thresholds `pdserve autoscale` uses by default."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.api.metrics import GATEWAY_TOTALS, ApiMetrics
from pdserve.broker import subjects
from pdserve.broker.metrics import worker_families
from pdserve.engine.config import EngineConfig
from pdserve.scaling import RolePolicy
from pdserve.schemas import WorkerInfo

KEDA = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "keda"
STREAMS = {"prefill": subjects.REQUEST_STREAM, "decode": subjects.KV_STREAM}
CONSUMERS = {"prefill": subjects.prefill_consumer, "decode": subjects.decode_consumer}
LAG = {"prefill": RolePolicy.lag_per_replica, "decode": EngineConfig.max_num_seqs * 3 // 4}


def load(role: str) -> dict[str, Any]:
    (doc,) = list(yaml.safe_load_all((KEDA / f"{role}.yaml").read_text()))
    return doc


def exported_metric_names() -> set[str]:
    """Every sample name the API's /metrics serves, a worker's families included."""
    registry = CollectorRegistry()
    api = ApiMetrics(lambda: dict.fromkeys(GATEWAY_TOTALS, 0), lambda: (0, 0))
    worker = WorkerInfo("w", "prefill", "m", "h", 1, 1, 1, 0, 16, 0)

    class Workers:
        def collect(self) -> Any:
            return worker_families([worker])

    registry.register(Workers())  # type: ignore[arg-type]
    text = (api.exposition() + generate_latest(registry)).decode()
    return set(re.findall(r"^(pdserve_\w+?)(?:\{| )", text, re.M))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_scaled_object_per_pool_with_the_fields_keda_requires(role: str) -> None:
    doc = load(role)
    assert (doc["apiVersion"], doc["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert doc["metadata"]["name"] == doc["spec"]["scaleTargetRef"]["name"] == f"pdserve-{role}"
    spec = doc["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert isinstance(spec["pollingInterval"], int) and isinstance(spec["cooldownPeriod"], int)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] < behavior["scaleDown"]["stabilizationWindowSeconds"]
    for direction in ("scaleUp", "scaleDown"):
        for policy in behavior[direction]["policies"]:
            assert policy["type"] in ("Pods", "Percent") and policy["value"] > 0 and policy["periodSeconds"] > 0
    for trigger in spec["triggers"]:
        assert trigger["type"] in ("nats-jetstream", "prometheus")
        # KEDA reads trigger metadata as a map of strings: a bare number is refused.
        assert all(isinstance(v, str) for v in trigger["metadata"].values()), trigger


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_jetstream_trigger_reads_the_pools_consumer(role: str) -> None:
    doc = load(role)
    triggers = [t["metadata"] for t in doc["spec"]["triggers"] if t["type"] == "nats-jetstream"]
    model = doc["metadata"]["annotations"]["pdserve/served-model-name"]
    # each pool: its shared queue and the urgent lane (priority below 0) it also takes from
    lanes = [CONSUMERS[role], subjects.urgent_consumer if role == "prefill" else subjects.urgent_decode_consumer]
    assert [nats["consumer"] for nats in triggers] == [lane(model) for lane in lanes]
    for nats in triggers:
        assert nats["stream"] == STREAMS[role]
        assert int(nats["lagThreshold"]) == LAG[role], "the same lag per replica as `pdserve autoscale`"
        assert nats["natsServerMonitoringEndpoint"].endswith(":8222")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_prometheus_triggers_query_metrics_pdserve_exports(role: str) -> None:
    names = exported_metric_names()
    queries = [t["metadata"] for t in load(role)["spec"]["triggers"] if t["type"] == "prometheus"]
    assert queries
    for q in queries:
        assert q["serverAddress"].startswith("http")
        assert float(q["threshold"]) > 0
        used = set(re.findall(r"pdserve_\w+", q["query"]))
        assert used and used <= names, used - names
    if role == "prefill":  # the token-weighted signal
        assert any("pdserve_prefill_tokens_waiting" in q["query"] for q in queries)
