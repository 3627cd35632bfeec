"""Environment variables, read in this one place. Every one has a working default."""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "PDSERVE_"


def env(name: str, default: str) -> str:
    return os.environ.get(PREFIX + name, default)


def default_data_dir() -> Path:
    return Path(env("DATA_DIR", ".pdserve"))


def default_nats_url() -> str:
    return env("NATS_URL", "nats://127.0.0.1:4222")


def default_log_level() -> str:
    return env("LOG_LEVEL", "INFO")
