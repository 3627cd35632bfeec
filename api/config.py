"""API server configuration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pdserve.broker.streams import BrokerConfig


@dataclasses.dataclass(frozen=True)
class ApiConfig:
    """``default_max_tokens`` applies where a request gives no limit (chat, /generate).
    ``stall_timeout``: a request whose worker says nothing for this long (workers send a
    keep-alive every second) moves to another worker; so does one whose missing chunk does
    not arrive within ``gap_timeout``. A request moves at most ``max_migrations`` times,
    then fails. A request body over ``max_body_bytes`` is refused (413) unread."""

    nats_url: str
    model_path: Path
    model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    api_id: str | None = None
    request_timeout: float = 600.0
    stall_timeout: float = 10.0
    gap_timeout: float = 1.0
    max_migrations: int = 3
    max_body_bytes: int = 8 << 20
    default_max_tokens: int = 1024
    trust_remote_code: bool = False
    context_length: int | None = None
    broker: BrokerConfig = BrokerConfig()

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        if self.request_timeout <= 0 or self.stall_timeout <= 0 or self.gap_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be at least 0")
