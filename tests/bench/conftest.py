"""The benchmark scripts under ``bench/`` importable by name (they import each other that
way too), and the ones the tests here exercise as fixtures."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    return importlib.import_module("serving_sweep")


@pytest.fixture(scope="module")
def xpyd() -> ModuleType:
    return importlib.import_module("xpyd")
