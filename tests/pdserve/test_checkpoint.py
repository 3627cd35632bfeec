"""Checkpoints as users name them: a local directory, or a hub id found in a Hugging Face
cache laid out as ``huggingface_hub`` writes it (no network: ``HF_HUB_OFFLINE``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.checkpoint import CheckpointError, resolve, served_name

FAKE_ID = "pdserve-test/tiny-qwen2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hf_cache(
    home: Path,
    model_dir: Path,
    repo_id: str = FAKE_ID,
    commit: str = COMMIT,
    ref: str = "main",
    edit: dict[str, dict[str, object]] | None = None,
) -> Path:
    """``model_dir``'s files as the snapshot ``commit`` of ``repo_id`` in the Hugging Face
    cache under ``home`` (``HF_HOME``): content-addressed blobs, ``refs/<ref>``, and the
    snapshot's links to the blobs. ``edit`` merges keys into JSON files on the way.
    Returns the snapshot directory."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():
        if file.name.startswith("."):
            continue
        data = file.read_bytes()
        if edit and file.name in edit:
            data = json.dumps({**json.loads(data), **edit[file.name]}, indent=2).encode()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny model under :data:`FAKE_ID` in a fresh cache, this process offline."""
    from huggingface_hub import constants

    snapshot = hf_cache(tmp_path / "hf", tiny_model_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(offline_cache: Path) -> None:
    assert resolve(FAKE_ID) == offline_cache
    assert resolve(FAKE_ID, revision=COMMIT) == offline_cache
    assert resolve(FAKE_ID, weights=False) == offline_cache
    assert served_name(offline_cache) == FAKE_ID


def test_a_snapshot_without_weights_serves_the_api_but_no_worker(
    offline_cache: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    configs_only = tmp_path / "configs-only"
    shutil.copytree(tiny_model_dir, configs_only, ignore=shutil.ignore_patterns("*.safetensors"))
    snapshot = hf_cache(offline_cache.parents[3], configs_only, repo_id="pdserve-test/no-weights")
    assert resolve("pdserve-test/no-weights", weights=False) == snapshot
    with pytest.raises(CheckpointError, match=r"no weights .* in its snapshot .*--load-format dummy"):
        resolve("pdserve-test/no-weights")


def test_a_local_directory_is_used_as_is(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert resolve(tiny_model_dir) == tiny_model_dir
    assert resolve(str(tiny_model_dir), revision="ignored") == tiny_model_dir
    assert served_name(tiny_model_dir) == tiny_model_dir.name
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        resolve(tmp_path)


@pytest.mark.parametrize(
    ("model", "revision", "message"),
    [
        (
            "nobody/no-such-model",
            None,
            "nobody/no-such-model: no such local directory, and not in the Hugging Face cache .*HF_HUB_OFFLINE is set",
        ),
        (FAKE_ID, "v9", "at revision 'v9'.*HF_HUB_OFFLINE is set"),
        ("./no/such/dir/here", None, "no such directory, and not a Hugging Face hub id"),
    ],
)
def test_what_cannot_be_found_offline_is_a_one_line_error(
    offline_cache: Path, model: str, revision: str | None, message: str
) -> None:
    with pytest.raises(CheckpointError, match=message) as caught:
        resolve(model, revision)
    assert "\n" not in str(caught.value)


def test_the_command_names_the_id_and_exits_2_without_a_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pdserve", "prefill", "--model-path", "nobody/no-such-model"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and "Traceback" not in run.stderr
    assert lines[0].startswith(
        "pdserve prefill: error: --model-path nobody/no-such-model: no such local directory, and not in the "
        "Hugging Face cache"
    )
    assert "HF_HUB_OFFLINE" in lines[0] and "hf download nobody/no-such-model" in lines[0]
