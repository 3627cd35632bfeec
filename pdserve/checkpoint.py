"""Where a model's files are: a local Hugging Face directory as given, or a hub id
(``Qwen/Qwen2.5-0.5B-Instruct``) resolved to its snapshot in the Hugging Face cache,
downloaded first when it is missing and the hub is reachable.

Every command resolves ``--model-path`` through :func:`resolve` (in
:func:`pdserve.configs.resolve_model`); ``pdserve up`` and ``pdserve autoscale`` resolve it
once and hand their workers and API processes the local directory, so every process reads
the same commit even if the hub moves meanwhile. Below this floor (the engine, the API)
a model is always a local directory.
The Hugging Face variables apply as ``huggingface_hub`` reads them: ``HF_HOME`` /
``HF_HUB_CACHE`` (where the cache is), ``HF_HUB_OFFLINE`` (never ask the hub),
``HF_TOKEN`` (private and gated models), ``HF_ENDPOINT`` (a mirror).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# What a model needs besides its weights: configs, tokenizer files, chat templates, remote code.
CONFIG_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]
SAFETENSORS_PATTERNS = ["*.safetensors"]
PICKLE_PATTERNS = ["*.bin"]  # only for a repository without safetensors
# Other formats of the same weights that some repositories carry beside the Hugging Face ones.
SKIP_PATTERNS = ["original/*", "consolidated*", "onnx/*", "*.onnx", "*.gguf", "*.msgpack", "*.h5"]


class CheckpointError(Exception):
    """The model cannot be found or fetched; the message is one line saying what to do."""


def resolve(model: str | Path, revision: str | None = None, weights: bool = True) -> Path:
    """The local directory holding ``model``: ``model`` itself when it is a directory, else
    the snapshot of hub id ``model`` at ``revision`` (default branch when ``None``) in the
    Hugging Face cache, fetched if missing (only configs and tokenizer files when not
    ``weights``: the API and ``--load-format dummy`` need no weights). Raises
    :class:`CheckpointError`."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise CheckpointError(f"{model}: no config.json there (a Hugging Face model directory is needed)")
        if revision:
            log.warning("a revision applies to hub ids only; serving the directory as it is", extra={"path": str(path)})
        return path
    repo_id = str(model)
    _check_repo_id(repo_id)
    local = _snapshot(repo_id, revision, SAFETENSORS_PATTERNS if weights else [])
    if weights and not any(local.glob("*.safetensors")):
        local = _snapshot(repo_id, revision, PICKLE_PATTERNS)
    if not (local / "config.json").exists():
        raise CheckpointError(f"{repo_id}: the hub repository has no config.json (not a transformers model)")
    if weights and not any(local.glob("*.safetensors")) and not any(local.glob("*.bin")):
        raise CheckpointError(
            f"{repo_id}: no weights (*.safetensors or pytorch_model*.bin) in its snapshot {local}; fetch them where "
            "the hub is reachable, or serve random ones with --load-format dummy"
        )
    return local


def served_name(path: Path) -> str:
    """The name clients use by default: the hub id for a snapshot in the Hugging Face cache
    (``.../models--Qwen--Qwen2.5-0.5B/snapshots/<commit>`` is ``Qwen/Qwen2.5-0.5B``; hub ids
    never hold ``--``), else the directory's name. Every process derives the same name
    from the same directory."""
    path = Path(path)
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return path.name


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise CheckpointError(
            f"{repo_id}: no such directory, and not a Hugging Face hub id (owner/name) either"
        ) from None


def _snapshot(repo_id: str, revision: str | None, weights: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = constants.is_offline_mode() if hasattr(constants, "is_offline_mode") else constants.HF_HUB_OFFLINE
    cache = constants.HF_HUB_CACHE
    at = f" at revision {revision!r}" if revision else ""
    try:
        local = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=CONFIG_PATTERNS + weights,
            ignore_patterns=SKIP_PATTERNS,
        )
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo_id}: the hub has no revision {revision!r} of it; check --revision") from None
    except GatedRepoError:
        raise CheckpointError(
            f"{repo_id}: a gated model; accept its terms on huggingface.co and set HF_TOKEN to a token that may read it"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo_id}: no such local directory, and no such model on the Hugging Face hub (or a private one: "
            "set HF_TOKEN); "
            "check the id, or pass a local directory"
        ) from None
    except LocalEntryNotFoundError as exc:
        where = f"no such local directory, and not in the Hugging Face cache {cache}{at}"
        if "incomplete" in str(exc):
            where = f"only partly in the Hugging Face cache {cache}{at}"  # a directory would have been used
        if offline:
            raise CheckpointError(
                f"{repo_id}: {where}, and HF_HUB_OFFLINE is set: download it where the hub is reachable "
                f"(`hf download {repo_id}`) into this cache (HF_HOME), or pass a local directory"
            ) from None
        raise CheckpointError(
            f"{repo_id}: {where}, and the hub could not be reached: check the network (or HF_ENDPOINT), "
            f"or download it elsewhere (`hf download {repo_id}`) and set HF_HOME to that cache, or pass a local "
            "directory"
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise CheckpointError(
            f"{repo_id}: the hub answered HTTP {status}; try again, or pass a local directory"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"{repo_id}: cannot write the Hugging Face cache {cache}: {exc}") from None
    log.info("model files ready", extra={"model": repo_id, "path": local})
    return Path(local)
