"""deploy/docker and deploy/compose.yaml, offline: no Docker daemon is needed (none runs on
the development machines), so the Dockerfiles are read as Docker reads them and held to
what the images must be: multi-stage, bases pinned to a release, a non-root user, the
`pdserve` entry point, every package of pyproject.toml copied in (and not excluded by
.dockerignore), the torch of the Makefile, the extras pyproject.toml defines; and the
compose file's pdserve commands are ones pdserve parses."""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cpu": ROOT / "deploy" / "docker" / "Dockerfile", "cuda": ROOT / "deploy" / "docker" / "Dockerfile.cuda"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        current += " " + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    out = []
    for line in lines:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages(path: Path) -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """The global ARG defaults and each stage's instructions (``FROM`` first)."""
    args: dict[str, str] = {}
    found: list[list[tuple[str, str]]] = []
    for word, rest in instructions(path):
        if word == "FROM":
            found.append([])
        if not found and word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
            continue
        found[-1].append((word, rest))
    return args, found


def base_image(rest: str, args: dict[str, str]) -> str:
    image = rest.split()[0]
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` (relative to the repository) out of the context."""
    ignored = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.removeprefix("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path.split("/")[0], pattern):
            ignored = not negate
    return ignored


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_two_stages_on_pinned_bases(kind: str) -> None:
    args, found = stages(DOCKERFILES[kind])
    assert len(found) == 2, "a build stage and a runtime stage"
    for stage in found:
        image = base_image(stage[0][1], args)
        tag = image.partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"{image}: pin a release"
    build, runtime = found
    assert build[0][1].endswith(" AS build")
    assert ("COPY", "--from=build /opt/pdserve /opt/pdserve") in runtime
    assert not any(word == "COPY" and not rest.startswith("--from") for word, rest in runtime), "no sources at run time"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_runtime_runs_pdserve_as_a_user_that_is_not_root(kind: str) -> None:
    _, (_, runtime) = stages(DOCKERFILES[kind])
    users = [rest for word, rest in runtime if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert users[-1] == "10001:10001", "the uid the Kubernetes manifests run as (runAsUser 10001)"
    entry = [rest for word, rest in runtime if word == "ENTRYPOINT"]
    assert entry == ['["pdserve"]'], "exec form: signals reach pdserve, which drains on SIGTERM"
    run = " ".join(rest for word, rest in runtime if word == "RUN")
    assert "libibverbs1" in run, "Mooncake's wheel links libibverbs even for tcp"
    assert "useradd" in run and "--uid 10001" in run


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_build_installs_every_package_with_the_makefiles_torch(kind: str) -> None:
    _, (build, _) = stages(DOCKERFILES[kind])
    copied = [source for word, rest in build if word == "COPY" for source in shlex.split(rest)[:-1]]
    package_dirs = set(pyproject()["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs | {"pyproject.toml", "README.md"} <= set(copied)
    for path in copied:
        assert (ROOT / path).exists(), path
        assert not dockerignored(path), f"{path} is excluded by .dockerignore"
    stage_args = {rest.partition("=")[0]: rest.partition("=")[2] for word, rest in build if word == "ARG"}
    makefile = re.search(r"^TORCH_SPEC \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert makefile and stage_args["TORCH_SPEC"] == makefile.group(1)
    extras = pyproject()["project"]["optional-dependencies"]
    assert stage_args["PDSERVE_EXTRAS"] in extras
    assert ("cpu" if kind == "cpu" else "gpu") == stage_args["PDSERVE_EXTRAS"]
    assert stage_args["TORCH_INDEX_URL"].endswith("/cpu" if kind == "cpu" else "/cu128")


def test_the_context_leaves_out_what_the_image_does_not_need() -> None:
    for path in (".venv", ".git", "tests", "docs", "bench", "build", ".pdserve", "deploy"):
        assert dockerignored(path), path
    assert not dockerignored("pdserve") and not dockerignored("pyproject.toml")


# ---- compose ----------------------------------------------------------------------------
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text()))


def test_compose_runs_nats_the_api_and_both_workers_from_the_cpu_image() -> None:
    services = compose()["services"]
    for name in ("nats", "api", "prefill", "decode"):
        service = services[name]
        assert service["image"] == "pdserve:cpu" and service["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert service["profiles"] == ["pdserve"], "without the profile: the observability stack only"
        assert service["environment"]["PDSERVE_NATS_URL"] == "nats://nats:4222"
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    for name in ("api", "prefill", "decode"):
        args = build_parser().parse_args(services[name]["command"])
        assert args.command == name and args.host == "0.0.0.0"
        assert services[name]["depends_on"]["nats"] == {"condition": "service_healthy"}
    assert services["api"]["ports"] == ["127.0.0.1:8000:8000"], "published on the host's loopback only"
    assert services["nats"]["entrypoint"] == ["nats-server"]
    conf = compose()["configs"]["nats-conf"]["content"]
    assert "jetstream" in conf and "/var/lib/pdserve" in conf and "http_port: 8222" in conf
    for name in ("jaeger", "prometheus", "grafana"):
        assert "profiles" not in services[name]


def test_prometheus_scrapes_the_compose_api_and_workers_once_each() -> None:
    jobs = {
        j["job_name"]: j for j in yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"]
    }
    assert jobs["pdserve-api"]["static_configs"][0]["targets"] == ["api:8000"]
    assert jobs["pdserve-api"]["metric_relabel_configs"] == [
        {"source_labels": ["worker"], "regex": ".+", "action": "drop"}
    ]
    assert jobs["pdserve-workers"]["static_configs"][0]["targets"] == ["prefill:9100", "decode:9100"]
    assert jobs["pdserve-host"]["static_configs"][0]["targets"] == ["host.docker.internal:8000"]
