"""pdserve: prefill/decode-disaggregated LLM serving over NATS JetStream."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# An installed pdserve holds api/, broker/, engine/, schemas/ and workers/ inside it. In
# a source checkout they are this folder's siblings: let them be found as pdserve.* so
# that the tree runs where nothing can be installed (a GPU machine with no package index).
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "engine" / "engine.py").is_file() and (_checkout / "pyproject.toml").is_file():
    __path__.append(str(_checkout))  # type: ignore[name-defined]
