"""API server configuration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pdserve.api.placement import PlacementConfig
from pdserve.api.reasoning import PARSERS as REASONING_PARSERS
from pdserve.api.tools import PARSERS as TOOL_PARSERS
from pdserve.broker.auth import NatsAuth
from pdserve.broker.streams import BrokerConfig


@dataclasses.dataclass(frozen=True)
class ApiConfig:
    """``default_max_tokens`` applies where a request gives no limit (chat, /generate).
    ``stall_timeout``: a request whose worker says nothing for this long (workers send a
    keep-alive every second) moves to another worker; so does one whose missing chunk does
    not arrive within ``gap_timeout``. A request moves at most ``max_migrations`` times,
    then fails. A request body over ``max_body_bytes`` is refused (413) unread.

    With ``api_keys`` every route but ``/health`` needs ``Authorization: Bearer <key>``.
    Limits refused with 400: prompts over ``max_prompt_tokens`` tokens, more new tokens
    than ``max_output_tokens``, more than ``max_batch_prompts`` prompts in one request
    (``None``: the model's context length). ``max_concurrent_requests`` generation
    requests per key may be in flight (0: no limit); more get 429. ``enable_flush_cache``
    turns on ``/flush_cache`` (benchmarks: every worker forgets its cached prefixes).
    ``generation_config`` ``auto``: the sampling values of the model's
    ``generation_config.json`` are the defaults of a request that does not set them
    (``none``: pdserve's and OpenAI's defaults). ``tool_call_parser``: how tool calls are
    read out of the model's text (``api/tools.py``; ``auto`` from its chat template);
    ``reasoning_parser``: whether thinking goes to ``reasoning_content`` (``api/reasoning.py``).
    ``placement``: which path each request takes (``docs/placement.md``)."""

    nats_url: str
    model_path: Path
    nats_auth: NatsAuth = NatsAuth()
    model_name: str | None = None
    model_aliases: tuple[str, ...] = ()  # other names requests may use (--served-model-alias)
    host: str = "127.0.0.1"
    port: int = 8000
    api_id: str | None = None
    request_timeout: float = 600.0
    stall_timeout: float = 10.0
    gap_timeout: float = 1.0
    max_migrations: int = 3
    max_body_bytes: int = 8 << 20
    default_max_tokens: int = 1024
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_batch_prompts: int = 256
    max_concurrent_requests: int = 0
    enable_flush_cache: bool = False
    trust_remote_code: bool = False
    context_length: int | None = None
    generation_config: str = "auto"
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    broker: BrokerConfig = BrokerConfig()
    placement: PlacementConfig = PlacementConfig()

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        if self.request_timeout <= 0 or self.stall_timeout <= 0 or self.gap_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be at least 0")
        for name in ("max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_batch_prompts < 1 or self.max_concurrent_requests < 0:
            raise ValueError("max_batch_prompts must be at least 1 and max_concurrent_requests at least 0")
        if self.generation_config not in ("auto", "none"):
            raise ValueError("generation_config must be auto or none")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ValueError("an API key must be non-empty and hold no surrounding whitespace")
