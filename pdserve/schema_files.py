"""``pdserve schemas export``: the JSON Schema files of every wire message.

The files live in ``schemas/json/`` (installed as ``pdserve/schemas/json``); they are made
from the dataclasses by :mod:`pdserve.schemas.json_schema` and checked in, so publishers in
other languages can read them without pdserve.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.schemas import json_schema

SCHEMA_DIR = Path(json_schema.__file__).parent / "json"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    schemas = sub.add_parser("schemas", help="the wire messages' JSON Schema")
    actions = schemas.add_subparsers(dest="schemas_command", required=True)
    export = actions.add_parser("export", help="write one JSON Schema file per message")
    export.add_argument("--out", type=Path, default=SCHEMA_DIR, help="directory to write (default: %(default)s)")
    export.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the files in --out differ from the code"
    )


def stale(directory: Path) -> list[str]:
    """Files in ``directory`` that differ from the code, are missing, or are left over."""
    wanted = json_schema.export()
    present = {p.name for p in directory.glob("*.json")} if directory.is_dir() else set()
    differ = [
        name
        for name, data in wanted.items()
        if not (directory / name).is_file() or (directory / name).read_bytes() != data
    ]
    return sorted(differ + sorted(present - set(wanted)))


def write(directory: Path) -> list[Path]:
    """Write every schema to ``directory`` and remove files of messages that are gone."""
    directory.mkdir(parents=True, exist_ok=True)
    wanted = json_schema.export()
    for old in directory.glob("*.json"):
        if old.name not in wanted:
            old.unlink()
    paths = []
    for name, data in wanted.items():
        path = directory / name
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
        paths.append(path)
    return paths


def run(args: argparse.Namespace) -> int:
    if args.check:
        differ = stale(args.out)
        for name in differ:
            print(f"out of date: {args.out / name}")
        if differ:
            print("run `pdserve schemas export` and commit the result")
        return 1 if differ else 0
    for path in write(args.out):
        print(path)
    return 0
