"""``docs/data/`` holds what the docs cite, nothing else; every cited data file or figure exists.

A path is cited when its string (``docs/data/...`` or ``docs/img/...``) appears in the README,
a page of ``docs/``, or a script under ``bench/``. A cited folder covers the files under it;
``<name>`` or ``{name}`` in a cited path (a script's output pattern) stands for any text.
The bare ``docs/data/`` and ``docs/img/`` cite nothing.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
CITATION = re.compile(r"docs/(?:data|img)/(?:[\w.*/-]|<[^<>\s]*>|\{[^{}\s]*\})+")

# Cited before they exist: each is written by a run still to come, and leaves this list when
# it lands: the first machine with 2 or 4 GPUs lent (bench/gpu.sh two_gpu_pd, two_tp, xpyd).
PENDING = {
    "docs/data/two_gpu_pd.json",
    "docs/img/two_gpu_pd.png",
    "docs/data/tensor_parallel.json",
    "docs/data/xpyd.json",
    "docs/img/xpyd.png",
}


def sources() -> list[Path]:
    bench = ROOT / "bench"
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(bench.rglob("*.py")),
        *sorted(bench.rglob("*.sh")),
    ]


def citations() -> dict[str, list[str]]:
    """Each cited path (a trailing full stop dropped) -> the files citing it."""
    cited: dict[str, list[str]] = {}
    for source in sources():
        for path in CITATION.findall(source.read_text(encoding="utf-8")):
            cited.setdefault(path.rstrip("."), []).append(str(source.relative_to(ROOT)))
    return cited


def as_glob(cited: str) -> str:
    return re.sub(r"<[^<>]*>|\{[^{}]*\}", "*", cited)


def existing(pattern: str) -> list[str]:
    """The files and folders a cited path (or pattern) names."""
    if "*" not in pattern:
        return [pattern] if (ROOT / pattern).exists() else []
    return [str(p.relative_to(ROOT)) for p in ROOT.glob(pattern)]


def covers(pattern: str, file: str) -> bool:
    if pattern.rstrip("/") in ("docs/data", "docs/img"):
        return False
    if fnmatchcase(file, pattern):
        return True
    return any(file.startswith(folder.rstrip("/") + "/") for folder in existing(pattern) if (ROOT / folder).is_dir())


def test_every_cited_data_file_and_figure_exists() -> None:
    missing = [
        f"{path} (cited by {', '.join(sorted(set(by)))})"
        for path, by in sorted(citations().items())
        if path not in PENDING and not existing(as_glob(path))
    ]
    assert not missing, "cited but not there:\n" + "\n".join(missing)


def test_the_pending_list_holds_only_what_is_still_pending() -> None:
    cited = citations()
    landed = sorted(p for p in PENDING if (ROOT / p).exists())
    uncited = sorted(p for p in PENDING if p not in cited)
    assert not landed, f"written since: take them off PENDING: {landed}"
    assert not uncited, f"cited no more: take them off PENDING: {uncited}"


def test_every_data_file_is_cited() -> None:
    patterns = [as_glob(path) for path in citations()]
    files = sorted(str(p.relative_to(ROOT)) for p in DATA.rglob("*") if p.is_file())
    uncited = [f for f in files if not any(covers(pattern, f) for pattern in patterns)]
    assert not uncited, "in docs/data/ but cited by no doc or bench script (git rm it, or cite it):\n" + "\n".join(
        uncited
    )
