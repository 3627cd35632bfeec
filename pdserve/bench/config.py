"""The benchmark's configuration (kept free of heavy imports: the CLI parser reads its
defaults)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.bench.metrics import SLO, SLO_ITL_METRICS

BACKENDS = ("openai", "openai-chat", "generate")
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions", "generate": "/generate"}
DATASETS = ("random", "sharegpt", "prefix-chat")


@dataclass
class BenchConfig:
    """Everything one benchmark needs; the CLI's defaults are these."""

    base_url: str = "http://127.0.0.1:8000"
    backend: str = "openai"
    endpoint: str | None = None
    model: str | None = None
    api_key: str | None = None
    tokenizer: str | None = None
    request_timeout: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    # load
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 0
    seed: int | None = None  # None: a fresh seed per run (recorded), so a rerun meets a cold prefix cache
    # workload
    dataset: str = "random"
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    short_fraction: float = 0.0
    short_len: int = 96
    prompt_format: str = "auto"
    dataset_path: str | None = None
    sharegpt_output_len: int | None = None
    num_groups: int = 4
    prefix_len: int = 1024
    num_turns: int = 4
    turn_len: int = 64
    ignore_eos: bool = True
    temperature: float = 0.0
    # SLOs
    slo_ttft: float | None = None
    slo_itl: float | None = None
    slo_itl_metric: str = "tpot"
    # sweep
    sweep: list[float] | None = None
    sweep_concurrency: list[int] | None = None
    sweep_pause: float = 0.0
    # output
    save_requests: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path")
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be at least 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.prompt_format not in ("auto", "ids", "text"):
            raise ValueError("--prompt-format must be auto, ids or text")
        if self.prompt_format == "ids" and not self.tokenizer:
            raise ValueError("--prompt-format ids needs --tokenizer")
        if self.prompt_format == "ids" and self.backend == "openai-chat":
            raise ValueError("openai-chat sends messages; token-id prompts are not possible")
        if self.slo_itl_metric not in SLO_ITL_METRICS:
            raise ValueError("--slo-itl-metric must be one of " + ", ".join(SLO_ITL_METRICS))
        self.base_url = self.base_url.rstrip("/")

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft, self.slo_itl, self.slo_itl_metric)

    @property
    def url(self) -> str:
        return self.base_url + (self.endpoint or ENDPOINTS[self.backend])

    def prompt_form(self) -> str:
        if self.backend == "openai-chat":
            return "chat"
        if self.prompt_format == "auto":
            return "ids" if self.tokenizer else "text"
        return self.prompt_format

    def to_json(self) -> dict[str, Any]:
        def plain(v: Any) -> Any:
            if isinstance(v, float) and math.isinf(v):
                return "inf"
            if isinstance(v, list):
                return [plain(x) for x in v]
            return v

        out = {k: plain(v) for k, v in asdict(self).items()}
        out.pop("api_key", None)
        return out
