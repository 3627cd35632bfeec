"""A GGUF file served as a Hugging Face directory.

``--model-path FILE.gguf`` (or a folder with ``--gguf-file NAME``) is read by
``transformers``' GGUF support, which dequantizes every tensor; :func:`ensure_converted`
writes the result once as a plain model directory (safetensors weights, config, tokenizer
with the file's chat template, generation config) under the data directory, and every
process then loads that directory like any other. Nothing stays quantized: memory and
speed are those of the dtype served. Architectures and quantization types that
``transformers`` and ``gguf`` cannot convert are refused up front with one line
(:class:`GGUFError`), before the long part starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]

# Change this whenever what :func:`convert` writes changes; older directories are rebuilt.
RECIPE_VERSION = 1
MARKER_NAME = ".pdserve-complete.json"
# Types that hold plain floats rather than quantized blocks (gguf's dequantize reads them as is).
PLAIN_TYPES = ("F32", "F16")
# Keys of transformers' GGUF mapping that are not architectures.
NOT_ARCHITECTURES = ("general", "tokenizer")
# What the weights are stored as, by --dtype: dequantized values are float32, so auto keeps them exact.
STORAGE_DTYPES = {"auto": "float32", "float32": "float32", "float16": "float16", "half": "float16"}


class GGUFError(Exception):
    """The GGUF file cannot be served; the message is one line saying why."""


@dataclass(frozen=True)
class GGUFInfo:
    """What the file's header says: its architecture and the tensor types it holds."""

    architecture: str
    tensor_types: tuple[str, ...]
    num_tensors: int


def gguf_path(model_path: str | Path, gguf_file: str | None) -> Path | None:
    """The GGUF file ``--model-path`` (and ``--gguf-file``) name, or ``None`` when they name
    no GGUF (a model directory or a hub id). Raises :class:`GGUFError` for a ``--gguf-file``
    that is not there."""
    path = Path(model_path).expanduser()
    if gguf_file is not None:
        if not path.is_dir():
            raise GGUFError(f"--gguf-file {gguf_file} needs --model-path to be a local folder; {model_path} is not one")
        file = path / gguf_file
        if not file.is_file():
            found = sorted(p.name for p in path.glob("*.gguf"))
            raise GGUFError(f"no file {gguf_file} in {path} (GGUF files there: {', '.join(found) or 'none'})")
        return file
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise GGUFError(f"{model_path}: no such GGUF file")
        return path
    return None


def inspect(path: Path) -> GGUFInfo:
    """Read ``path``'s header and refuse (:class:`GGUFError`) what cannot be converted: an
    architecture ``transformers`` has no GGUF mapping for, a quantization type ``gguf``
    cannot dequantize, or a file that is not GGUF at all."""
    from gguf import GGUFReader
    from gguf.quants import _type_traits
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise GGUFError(f"{path}: not a GGUF file transformers can read ({exc})") from None
    types = {tensor.tensor_type for tensor in reader.tensors}
    supported = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in NOT_ARCHITECTURES]
    if architecture not in supported:
        raise GGUFError(
            f"{path.name}: architecture {architecture!r} is not one transformers can convert from GGUF "
            f"(it can: {', '.join(sorted(supported))}); use a Hugging Face model directory instead"
        )
    unknown = sorted(t.name for t in types if t.name not in PLAIN_TYPES and t not in _type_traits)
    if unknown:
        raise GGUFError(
            f"{path.name}: quantization type {', '.join(unknown)} cannot be dequantized by the gguf package "
            "(supported: F32, F16, BF16, Q4_0 ... Q8_0, the K-quants Q2_K ... Q6_K, the IQ types, TQ1_0/TQ2_0, MXFP4)"
        )
    return GGUFInfo(architecture, tuple(sorted(t.name for t in types)), len(reader.tensors))


def ensure_converted(
    gguf: Path, data_dir: Path, dtype: str = "auto", progress: ProgressFn | None = None, name: str | None = None
) -> Path:
    """The model directory of ``gguf`` dequantized, under ``data_dir/models/gguf/``: made on
    the first call (a minute for a small model), reused after, rebuilt when the file
    changes. The directory is named ``name`` (default: the file's stem), which is the
    served name. ``dtype`` is ``--dtype``: ``auto`` stores float32 (the values exactly as
    dequantized), a half type stores that half type. Raises :class:`GGUFError`."""
    gguf = gguf.resolve()
    inspect(gguf)  # refuse what cannot be converted before making anything
    stat = gguf.stat()
    storage = STORAGE_DTYPES.get(dtype, dtype)
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|{storage}".encode()).hexdigest()[:16]
    target = Path(data_dir) / "models" / "gguf" / key / (name or gguf.stem)
    return build_once(target, lambda out: convert(gguf, out, storage, progress or _ignore), progress)


def convert(gguf: Path, out_dir: Path, storage_dtype: str = "float32", progress: ProgressFn | None = None) -> None:
    """Write ``gguf`` as a model directory into ``out_dir``: its config (with no
    quantization left in it, and ``storage_dtype`` recorded where the file is float32),
    its weights dequantized by ``transformers`` (stored as ``storage_dtype``), its
    tokenizer and chat template, its generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = progress or _ignore
    info = inspect(gguf)
    report(
        f"converting {gguf.name} ({info.architecture}, {info.num_tensors} tensors of "
        f"{', '.join(info.tensor_types)}) to {storage_dtype} safetensors in {out_dir.parent}"
    )
    folder, name = str(gguf.parent), gguf.name
    with _progress_bars(sys.stderr.isatty()):
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except (ValueError, NotImplementedError, KeyError) as exc:
            raise GGUFError(f"{name}: transformers could not convert it: {_one_line(exc)}") from None
    report("saving the dequantized weights")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # save_pretrained refuses a GGUF-loaded model: the same weights in a model built from the config.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, storage_dtype))
    state = {k: v.to(getattr(torch, storage_dtype)) for k, v in loaded.state_dict().items()}
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    with _progress_bars(False):
        model.save_pretrained(out_dir, safe_serialization=True)
        loaded.generation_config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    # The dtype a GPU serves under --dtype auto (save_pretrained wrote the storage dtype):
    # half precision, as the checkpoints GGUF files are made from are.
    config_file = out_dir / "config.json"
    saved = json.loads(config_file.read_text(encoding="utf-8"))
    saved["dtype"] = "bfloat16" if storage_dtype == "float32" else storage_dtype
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out_dir / "README.md").write_text(
        f"# {gguf.stem}\n\n`{gguf.name}` ({info.architecture}; {', '.join(info.tensor_types)}) dequantized by "
        f"transformers' GGUF reader and stored as {storage_dtype} safetensors by pdserve (`pdserve/gguf.py`).\n",
        encoding="utf-8",
    )


# ---- a directory made once ---------------------------------------------------------------
def build_once(target: Path, build: Callable[[Path], None], progress: ProgressFn | None = None) -> Path:
    """``target`` if a complete copy is there; else ``build`` it in a staging directory
    beside it and rename that into place (a concurrent builder's finished copy wins)."""
    if is_complete(target):
        return target
    report = progress or _ignore
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        build(staging)
        _write_marker(staging)
        for path in staging.iterdir():
            path.chmod(0o644)
        staging.chmod(0o755)
        if target.exists() and not is_complete(target):
            _discard(target)
        try:
            os.rename(staging, target)
        except OSError:
            if not is_complete(target):
                raise
            report(f"another process made {target} first; using it")
            return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report(f"model ready at {target}")
    return target


def is_complete(model_dir: Path) -> bool:
    try:
        marker = json.loads((model_dir / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("recipe_version") == RECIPE_VERSION


def _write_marker(out_dir: Path) -> None:
    files = sorted(p.name for p in out_dir.iterdir() if p.is_file())
    marker: dict[str, Any] = {"recipe_version": RECIPE_VERSION, "files": files}
    (out_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def _discard(path: Path) -> None:
    graveyard = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, graveyard)
    except FileNotFoundError:
        return
    shutil.rmtree(graveyard, ignore_errors=True)


@contextmanager
def _progress_bars(on: bool) -> Iterator[None]:
    """transformers' progress bars (the per-tensor dequantizing bar) on or off for a while."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging

    was, bar = hf_logging.is_progress_bar_enabled(), reader.tqdm
    (hf_logging.enable_progress_bar if on else hf_logging.disable_progress_bar)()
    reader.tqdm = functools.partial(bar, disable=not on)  # its GGUF bar ignores the switch above
    try:
        yield
    finally:
        reader.tqdm = bar
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _ignore(_message: str) -> None:
    return None
