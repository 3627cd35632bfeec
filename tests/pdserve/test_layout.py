"""The package's shape, read from the source with ``ast``: no import cycle between pdserve
modules (an import inside a function counts too), and each floor imports only the
floors below it: schemas → broker and engine → api and workers → pdserve."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What each subpackage may import besides itself; the pdserve package's own modules may import anything.
FLOORS = {
    "schemas": set(),
    "broker": {"schemas"},
    "engine": {"schemas"},
    "api": {"schemas", "broker"},
    "workers": {"schemas", "broker", "engine"},
}


def _source_files() -> dict[str, Path]:
    """Module name → file, following the package-dir map in pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = config["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    for package, folder in folders.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            modules.setdefault(name, path)  # "pdserve" maps its own folder; subpackages map theirs
    return modules


def _imported(tree: ast.Module, name: str, is_package: bool) -> Iterator[str]:
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Module → the pdserve modules it imports (a name imported from a package counts as
    that package, unless the name is itself a module)."""
    files = _source_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = set()
        for imported in _imported(tree, name, path.name == "__init__.py"):
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else "pdserve"


def test_the_graph_sees_every_package() -> None:
    graph = import_graph()
    assert {"pdserve.cli", "pdserve.api.app", "pdserve.broker.contract", "pdserve.schemas"} <= set(graph)
    assert "pdserve.broker.subjects" in graph["pdserve.broker.contract"]


def test_no_import_cycle() -> None:
    cycles = _cycles(import_graph())
    assert cycles == [], "import cycles:\n" + "\n".join(" → ".join(c) for c in cycles)


def test_each_floor_imports_only_the_floors_below() -> None:
    wrong = []
    for module, targets in sorted(import_graph().items()):
        floor = _floor(module)
        if floor == "pdserve":
            continue
        for target in sorted(targets):
            if _floor(target) not in FLOORS[floor] | {floor}:
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_uses_asyncio_wait_for() -> None:
    """Python 3.11's ``asyncio.wait_for`` returns the result, and drops the cancel, when a
    cancel lands as the awaited thing completes: a worker loop polling with it could outlive
    the worker's stop. ``asyncio.timeout`` keeps the cancel; the packages use only that."""
    found = []
    for name, path in _source_files().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "wait_for"
                and getattr(node.value, "id", "") == "asyncio"
            ):
                found.append(f"{name}:{node.lineno}")
    assert found == []
