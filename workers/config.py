"""Worker configuration: what to serve, where the broker is, how KV moves."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from pathlib import Path

from pdserve.broker.auth import NatsAuth
from pdserve.broker.streams import BrokerConfig
from pdserve.engine.config import EngineConfig

ROLES = ("prefill", "decode", "unified")


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """One worker process. ``kv_hold_seconds`` is how long a prefill worker keeps KV
    that no decode worker has pulled; ``kv_pull_margin`` is how much of that a decode
    worker wants left before it pulls (else it recomputes the prompt itself);
    ``kv_lease_seconds`` is how long a decode worker's read may take: the prefill worker
    keeps the pages at least that long once it grants the lease, and a read that ends
    later is not trusted. ``keepalive_seconds``: a request in hand that sent its client
    nothing for this long gets an ``alive`` chunk (the API's stall timeout must be longer).
    ``transfer_host``: the address peers reach the transfer endpoint at (on Kubernetes the
    pod IP), when not ``host``. ``transport_fallback``: why RDMA was asked for
    (``transport_fallback_device``) and tcp is used instead, with the user's leave
    (``--allow-tcp-fallback``); the worker logs and counts it. ``prefix_placement``: publish
    the prefix cache's changes (``KVEvents``) and take requests placed on this worker's own
    subject (prefill and unified); on by default (``--prefix-aware-placement off`` turns it off)."""

    role: str
    model_path: Path
    model_name: str
    nats_url: str
    nats_auth: NatsAuth = NatsAuth()
    engine: EngineConfig = EngineConfig()
    broker: BrokerConfig = BrokerConfig()
    worker_id: str = ""
    host: str = "127.0.0.1"
    dtype: str = "auto"
    trust_remote_code: bool = False
    load_format: str = "auto"
    transfer_backend: str = "mooncake"
    transfer_protocol: str = "tcp"
    ib_device: str = ""
    transfer_host: str = ""
    transport_fallback: str = ""
    transport_fallback_device: str = ""
    kv_hold_seconds: float = 30.0
    kv_hold_grace_seconds: float = 5.0
    kv_pull_margin: float = 2.0
    kv_lease_seconds: float = 10.0
    heartbeat_seconds: float = 2.0
    keepalive_seconds: float = 1.0
    fetch_timeout: float = 1.0
    drain_seconds: float = 30.0
    prefix_placement: bool = True

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if self.kv_hold_seconds <= self.kv_pull_margin:
            raise ValueError("kv_hold_seconds must exceed kv_pull_margin")
        if self.kv_lease_seconds <= 0:
            raise ValueError("kv_lease_seconds must be positive")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", new_worker_id(self.role))
