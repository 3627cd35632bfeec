"""What the API knows about the served model: name, tokenizer, context, chat template, and
the sampling defaults its ``generation_config.json`` recommends."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.api.reasoning import ReasoningFormat, resolve_reasoning
from pdserve.api.tools import ToolFormat, resolve_format

log = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    name: str
    path: Path
    tokenizer: Any
    context_length: int
    eos_token_ids: frozenset[int]
    created: int
    aliases: tuple[str, ...] = ()  # other names requests may use for it (answers name it ``name``)
    max_token_chars: int = 0  # the longest token's text; 0: unknown
    # What a request that does not set them samples with (``generation_config.json``'s).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # How tools are shown to the model and its calls read (``--tool-call-parser``).
    tool_format: ToolFormat = field(default_factory=lambda: ToolFormat(None, False, "not resolved"))
    # Whether chat replies are split into thinking and answer (``--reasoning-parser``).
    reasoning: ReasoningFormat = field(default_factory=lambda: ReasoningFormat(False, "not resolved"))

    @property
    def max_prompt_chars(self) -> int:
        """Text longer than this cannot fit the context whatever it tokenizes to (each token
        covers at most ``max_token_chars`` characters; doubled for normalizers); 0: no bound."""
        return 2 * self.max_token_chars * self.context_length

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request may use: the served one first, then its aliases."""
        return (self.name, *self.aliases)

    def not_found(self, model: str) -> str:
        """What a request naming ``model``, not one of :attr:`names`, is told."""
        served = " or ".join(f"'{n}'" for n in self.names)
        return f"the model '{model}' does not exist; this server serves {served}"

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


# The generation-config keys a request inherits when it does not set them (what vLLM's
# ``--generation-config auto`` takes), with the range each must lie in.
SAMPLING_KEYS: dict[str, tuple[type, float, float]] = {
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 1e-9, 1.0),
    "top_k": (int, -1, 2**31 - 1),
    "min_p": (float, 0.0, 1.0),
    "repetition_penalty": (float, 1e-9, 10.0),
}
GENERATION_CONFIG_MODES = ("auto", "none")


def sampling_defaults(path: Path, mode: str = "auto") -> dict[str, float | int]:
    """With ``mode`` ``auto``: the sampling keys (:data:`SAMPLING_KEYS`) that the model's
    ``generation_config.json`` sets, as request defaults; ``none``: no defaults (pdserve's
    and OpenAI's apply). Raises ``ValueError`` naming a value out of range."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation config {mode!r}: use one of {', '.join(GENERATION_CONFIG_MODES)}")
    file = Path(path) / "generation_config.json"
    if mode == "none" or not file.exists():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: cannot read it ({exc}); --generation-config none ignores it") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object; --generation-config none ignores it")
    defaults: dict[str, float | int] = {}
    for key, (kind, low, high) in SAMPLING_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not low <= value <= high or (kind is int and value != int(value)):
            raise ValueError(
                f"{file}: {key} {value!r} is not a {kind.__name__} in [{low:g}, {high:g}]; "
                "--generation-config none ignores the file"
            )
        defaults[key] = kind(value)
    return defaults


def load_model_info(
    path: Path,
    name: str | None = None,
    trust_remote_code: bool = False,
    context_length: int | None = None,
    generation_config: str = "auto",
    tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
    aliases: tuple[str, ...] = (),
) -> ModelInfo:
    """Tokenizer, limits and sampling defaults of the model in the local directory ``path``
    (no weights are loaded); ``name`` is the served name (default: the directory's)."""
    import transformers
    from transformers import AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    context = context_length or text.get("max_position_embeddings") or getattr(tokenizer, "model_max_length", 4096)
    eos: set[int] = set()
    gen_path = path / "generation_config.json"
    if gen_path.exists():
        value = json.loads(gen_path.read_text()).get("eos_token_id")
        eos.update(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    served = name or path.name
    return ModelInfo(
        name=served,
        aliases=tuple(dict.fromkeys(a for a in aliases if a and a != served)),
        path=path.resolve(),
        tokenizer=tokenizer,
        context_length=int(context),
        eos_token_ids=frozenset(eos),
        created=int(path.stat().st_mtime),
        max_token_chars=max((len(t) for t in tokenizer.get_vocab()), default=0),
        sampling_defaults=sampling_defaults(path, generation_config),
        tool_format=resolve_format(tokenizer, tool_call_parser),
        reasoning=resolve_reasoning(tokenizer, reasoning_parser),
    )
