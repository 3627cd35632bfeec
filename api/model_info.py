"""What the API knows about the served model: name, tokenizer, context, chat template."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    name: str
    path: Path
    tokenizer: Any
    context_length: int
    eos_token_ids: frozenset[int]
    created: int
    max_token_chars: int = 0  # the longest token's text; 0: unknown

    @property
    def max_prompt_chars(self) -> int:
        """Text longer than this cannot fit the context whatever it tokenizes to (each token
        covers at most ``max_token_chars`` characters; doubled for normalizers); 0: no bound."""
        return 2 * self.max_token_chars * self.context_length

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def load_model_info(
    path: Path, name: str | None = None, trust_remote_code: bool = False, context_length: int | None = None
) -> ModelInfo:
    """Tokenizer and limits of the model at ``path`` (no weights are loaded)."""
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
    return ModelInfo(
        name=name or path.name,
        path=path.resolve(),
        tokenizer=tokenizer,
        context_length=int(context),
        eos_token_ids=frozenset(eos),
        created=int(path.stat().st_mtime),
        max_token_chars=max((len(t) for t in tokenizer.get_vocab()), default=0),
    )
