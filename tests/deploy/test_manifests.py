"""deploy/kubernetes, offline: the kustomization rendered (by this test from
kustomization.yaml itself; checked against `kubectl kustomize` where kubectl is installed),
every object validated against the Kubernetes schemas (`kubernetes-validate`, strict: an
unknown field is an error) and the ScaledObjects and ServiceMonitors against their CRDs
(checked in under deploy/kubernetes/schemas), and the manifests held to what pdserve
really does: flags it parses, NATS users with the permissions of its wire contract, a
termination grace that covers a worker's drain, the pod IP as the transfer endpoint."""

from __future__ import annotations

import base64
import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve.broker import permissions, subjects
from pdserve.children import RETIRE_KILL_SECONDS
from pdserve.cli import build_parser
from pdserve.configs import broker_config
from pdserve.workers.config import WorkerConfig

KUBE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests are meant for (the `sleep` preStop action is on by
# default from 1.30) and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume"}
CRDS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}
WORKERS = ("prefill", "decode")


# ---- rendering ------------------------------------------------------------------------
def render(root: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize root`` prints, for the features kustomization.yaml uses:
    resources, namespace, images, secretGenerator (without name hashes)."""
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "namespace", "resources", "images", "secretGenerator", "generatorOptions"}
    assert set(kustomization) <= known, f"this renderer does not do {set(kustomization) - known}"
    docs = [d for path in kustomization["resources"] for d in yaml.safe_load_all((root / path).read_text()) if d]
    assert kustomization["generatorOptions"] == {"disableNameSuffixHash": True}
    for generator in kustomization["secretGenerator"]:
        data = {}
        for entry in generator["files"]:
            key, _, path = entry.partition("=")
            data[key] = base64.b64encode((root / path).read_bytes()).decode()
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": generator["name"]},
                "type": "Opaque",
                "data": data,
            }
        )
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization["images"]}
    for doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = kustomization["namespace"]
        for container in containers(doc):
            container["image"] = images.get(container["image"], container["image"])
    return docs


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes with its secrets made as a user makes them."""
    root = tmp_path_factory.mktemp("deploy") / "kubernetes"
    shutil.copytree(KUBE, root, ignore=shutil.ignore_patterns("api-keys", "metrics-key", "nats-*"))
    subprocess.run(["sh", str(root / "secrets" / "generate.sh")], check=True, capture_output=True)
    return root


@pytest.fixture(scope="module")
def rendered(tree: Path) -> list[dict[str, Any]]:
    return render(tree)


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_it_renders_everything_a_deployment_needs(rendered: list[dict[str, Any]]) -> None:
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    for role in ("api", *WORKERS):
        assert ("Deployment", f"pdserve-{role}") in names
    for role in WORKERS:
        assert ("ScaledObject", f"pdserve-{role}") in names
    assert {("ServiceMonitor", "pdserve-api"), ("ServiceMonitor", "pdserve-workers")} <= names
    assert {("Secret", "pdserve-api-keys"), ("Secret", "pdserve-nats-users"), ("ConfigMap", "pdserve-config")} <= names
    assert {("NetworkPolicy", n) for n in ("pdserve-api", "pdserve-nats", "pdserve-workers")} <= names
    assert all(d["metadata"].get("namespace") == "pdserve" for d in rendered if d["kind"] != "Namespace")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the renderer above stands alone")
def test_the_renderer_agrees_with_kubectl_kustomize(tree: Path, rendered: list[dict[str, Any]]) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(tree)], check=True, capture_output=True, text=True).stdout
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    ours = {(d["kind"], d["metadata"]["name"]): d for d in rendered}
    assert ours == theirs


# ---- schemas --------------------------------------------------------------------------
def crd_schema(file: str) -> dict[str, Any]:
    """The served version's openAPIV3Schema of a checked-in CRD, made strict as the API
    server's pruning is: a field the schema does not name is an error here (a typo)."""
    (crd,) = [d for d in yaml.safe_load_all((KUBE / "schemas" / file).read_text()) if d]
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
    return strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            if not schema.get("x-kubernetes-preserve-unknown-fields"):
                schema["additionalProperties"] = False
        for value in schema.values():
            strict(value)
    elif isinstance(schema, list):
        for value in schema:
            strict(value)
    return schema


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_its_schema(rendered: list[dict[str, Any]], version: str) -> None:
    for doc in rendered:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRDS:
            jsonschema.validate(doc, crd_schema(CRDS[key]))
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validators_catch_mistakes(rendered: list[dict[str, Any]]) -> None:
    deployment = copy.deepcopy(find(rendered, "Deployment", "pdserve-prefill"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 90  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
    scaled = copy.deepcopy(find(rendered, "ScaledObject", "pdserve-prefill"))
    scaled["spec"]["minReplicas"] = 1  # KEDA's field is minReplicaCount
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, crd_schema(CRDS[("keda.sh/v1alpha1", "ScaledObject")]))
    monitor = copy.deepcopy(find(rendered, "ServiceMonitor", "pdserve-api"))
    monitor["spec"]["endpoints"][0]["interval"] = 5  # a duration string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, crd_schema(CRDS[("monitoring.coreos.com/v1", "ServiceMonitor")]))


# ---- what pdserve really does -----------------------------------------------------------
def pod(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc["spec"]["template"]["spec"])


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("role", ["api", *WORKERS])
def test_each_deployment_runs_a_command_pdserve_parses(rendered: list[dict[str, Any]], role: str) -> None:
    (container,) = containers(find(rendered, "Deployment", f"pdserve-{role}"))
    args = build_parser().parse_args(container["args"])
    assert args.command == role
    assert broker_config(args).replicas == 3, "streams with three copies on the NATS cluster"
    assert args.nats_user == role
    assert env(container)["PDSERVE_NATS_PASSWORD"] == {"secretKeyRef": {"name": "pdserve-nats-users", "key": role}}
    model = args.served_model_name
    if role != "api":
        keda = find(rendered, "ScaledObject", f"pdserve-{role}")
        assert keda["metadata"]["annotations"]["pdserve/served-model-name"] == model
        lags = [t["metadata"] for t in keda["spec"]["triggers"] if t["type"] == "nats-jetstream"]
        consumers = (
            [subjects.prefill_consumer, subjects.urgent_consumer]
            if role == "prefill"
            else [subjects.decode_consumer, subjects.urgent_decode_consumer]
        )
        assert [lag["consumer"] for lag in lags] == [consumer(model) for consumer in consumers]
        for lag in lags:  # on a cluster KEDA follows the consumer to its leader as <pod>.<this host>
            assert lag["natsServerMonitoringEndpoint"].startswith("nats-headless.pdserve.svc")
    config = find(rendered, "ConfigMap", "pdserve-config")["data"]
    assert config["PDSERVE_NATS_URL"].startswith("nats://nats.pdserve.svc") and config["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert {"configMapRef": {"name": "pdserve-config"}} in container["envFrom"]


@pytest.mark.parametrize("role", WORKERS)
def test_workers_advertise_their_pod_ip_and_drain_before_they_are_killed(
    rendered: list[dict[str, Any]], role: str
) -> None:
    spec = pod(find(rendered, "Deployment", f"pdserve-{role}"))
    (container,) = spec["containers"]
    assert env(container)["PDSERVE_TRANSFER_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    args = build_parser().parse_args(container["args"])
    assert args.host == "0.0.0.0" and args.port == 9100 and args.transfer_host is None  # from the environment
    # The grace covers the drain, a running lease on held KV, and the teardown: the budget
    # `pdserve up` gives a retiring worker. KEDA asks for at least 60.
    grace = spec["terminationGracePeriodSeconds"]
    drain = WorkerConfig.drain_seconds + WorkerConfig.kv_lease_seconds + WorkerConfig.kv_hold_grace_seconds
    assert grace >= RETIRE_KILL_SECONDS >= drain and grace >= 60
    assert "preStop" not in container.get("lifecycle", {}), "a preStop would eat into the drain"
    # Readiness on /health (503 while draining); liveness never on /health, which would kill a draining worker.
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in container["livenessProbe"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["image"].endswith("cuda")


def test_the_api_stops_taking_requests_before_it_stops(rendered: list[dict[str, Any]]) -> None:
    spec = pod(find(rendered, "Deployment", "pdserve-api"))
    (container,) = spec["containers"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 0 < pre_stop < spec["terminationGracePeriodSeconds"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health" and "tcpSocket" in container["livenessProbe"]
    args = build_parser().parse_args(container["args"])
    assert args.api_key_file == Path("/etc/pdserve/api-keys/keys")
    assert env(container)["PDSERVE_API_KEYS"] == {"secretKeyRef": {"name": "pdserve-api-keys", "key": "metrics"}}
    monitor = find(rendered, "ServiceMonitor", "pdserve-api")["spec"]["endpoints"][0]
    assert monitor["authorization"]["credentials"] == {"name": "pdserve-api-keys", "key": "metrics"}


def test_network_policies_let_the_nats_cluster_route_and_keda_read_it(rendered: list[dict[str, Any]]) -> None:
    nats = find(rendered, "NetworkPolicy", "pdserve-nats")["spec"]["ingress"]
    ports = {p["port"] for rule in nats for p in rule["ports"]}
    assert {4222, 6222, 8222} <= ports


# ---- the NATS Helm chart's values -------------------------------------------------------
def values() -> dict[str, Any]:
    return dict(yaml.safe_load((KUBE / "nats" / "values.yaml").read_text()))


def paths(tree: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    if not isinstance(tree, dict):
        return {prefix}
    found = set()
    for key, value in tree.items():
        found |= paths(value, (*prefix, key))
    return found


def test_nats_values_are_a_jetstream_cluster_of_three_on_file_storage() -> None:
    config = values()["config"]
    assert config["cluster"] == {"enabled": True, "replicas": 3}
    jetstream = config["jetstream"]
    assert jetstream["enabled"] and jetstream["fileStore"]["enabled"] and jetstream["fileStore"]["pvc"]["enabled"]
    assert jetstream["memoryStore"]["enabled"], "the worker registry bucket is kept in memory (R3 too)"
    assert config["monitor"]["enabled"] and config["monitor"]["port"] == 8222
    assert values()["service"]["ports"]["monitor"]["enabled"]


def test_nats_values_use_only_keys_the_chart_knows() -> None:
    chart = yaml.safe_load((KUBE / "schemas" / "nats-chart-values.yaml").read_text())
    free = {("config", "merge"), ("container", "env"), ("container", "resources"), ("podTemplate", "merge")}
    free |= {("podTemplate", "topologySpreadConstraints")}
    known = paths(chart)
    for path in paths(values()):
        if any(path[: len(f)] == f for f in free):
            continue
        assert any(k[: len(path)] == path for k in known), f"{'.'.join(path)} is not a value of the NATS chart"


def test_nats_users_have_the_permissions_of_pdserves_wire_contract() -> None:
    users = {u["user"]: u for u in values()["config"]["merge"]["authorization"]["users"]}
    assert set(users) == {"admin", "api", "prefill", "decode"}
    env_names = values()["container"]["env"]
    for name, user in users.items():
        if name != "admin":
            assert user["permissions"] == permissions.for_role(name).conf()["permissions"], name
        variable = user["password"].removeprefix("<< $").removesuffix(" >>")
        assert env_names[variable] == {"valueFrom": {"secretKeyRef": {"name": "pdserve-nats-users", "key": name}}}
    assert users["admin"]["permissions"] == permissions.everything().conf()["permissions"]
    labels = values()["podTemplate"]["merge"]["metadata"]["labels"]
    assert labels["pdserve/role"] == "nats", "the NetworkPolicy selects the NATS pods by this label"
