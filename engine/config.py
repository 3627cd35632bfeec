"""Engine configuration: one frozen dataclass with defaults that work on one CPU."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KVTierConfig:
    """The KV cache tiers below the device pool (all off by default; see ``engine/kv_tiers.py``).

    ``host_bytes``: host memory for pages evicted from the device (pinned on a GPU).
    ``disk_dir``: a directory (local or a shared mount) of page-group files, kept within
    ``disk_bytes``. ``store_master``: the ``host:port`` of a Mooncake Store master (with its
    HTTP metadata server at ``store_metadata``); this worker lends the store ``store_bytes``
    of its memory (0: none, objects live in a store server's) and reaches it from ``store_host``. ``group_pages``: pages per
    file or store object. ``max_pending_writes``: page groups queued for the writer
    thread; more are dropped (counted), never waited for. ``load``: ``cost`` loads a found
    prefix only as far as loading measures faster than computing it (``engine/kv_cost.py``),
    ``always`` loads all of it (saves compute whatever it costs in time). ``prefetch_bytes``:
    host memory for page groups of the disk and store tiers read ahead when their request
    arrives (0: no prefetch; loads then read the tier on the step's path). ``overlap``: a
    prefix's part in a disk or store slower than computing may load while the part before it
    is computed (``kv_cost.overlap_split``); off by default: on an H200 it helped a restarted
    worker's 8,192-token prompt (0.89x cold) but slowed chat turns (1.08x at 8,192, 1.8x at 2,048).
    ``cut_runs``: the ``cost`` rule may load a tier's leading groups of a prefix and compute the
    rest, where that saves more than loading all it holds; off by default (a run is loaded whole
    or not at all: cut near a step's floor, three groups of a disk cost an H100 1.09x computing
    them, 2026-12-06).
    """

    host_bytes: int = 0
    disk_dir: str = ""
    disk_bytes: int = 4 << 30
    store_master: str = ""
    store_metadata: str = ""
    store_host: str = "127.0.0.1"
    store_bytes: int = 0
    group_pages: int = 8
    max_pending_writes: int = 256
    load: str = "cost"
    prefetch_bytes: int = 512 << 20
    overlap: bool = False
    cut_runs: bool = False

    def __post_init__(self) -> None:
        if self.load not in ("cost", "always"):
            raise ValueError(f"load is 'cost' or 'always', not {self.load!r}")
        if self.host_bytes < 0 or self.disk_bytes < 1 or self.store_bytes < 0 or self.prefetch_bytes < 0:
            raise ValueError("kv tier sizes must be positive (host_bytes 0: no host tier; store_bytes 0: lend none)")
        if self.group_pages < 1 or self.max_pending_writes < 1:
            raise ValueError("group_pages and max_pending_writes must be at least 1")
        if self.store_master and not self.store_metadata:
            raise ValueError("a Mooncake Store master needs its metadata server's URL")

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_dir or self.store_master)


QUANTIZATIONS = (None, "fp8")  # EngineConfig.quantization's values
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")  # EngineConfig.kv_cache_dtype's values


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Knobs of the serving engine.

    ``max_total_tokens`` sizes the KV page pool (tokens across all requests); when
    ``None`` it is ``kv_memory_fraction`` of free device memory (GPU) or
    ``cpu_kv_bytes`` of host memory (CPU). ``chunked_prefill_size`` is the token budget of one forward
    pass; ``max_num_seqs`` caps the running batch. ``model_impl``: ``auto`` runs pdserve's
    own forward pass where the architecture has one (on a GPU or a CPU), else the stock
    ``transformers`` code; ``pdserve`` insists on the former, ``transformers`` on the
    latter. ``cuda_graph_max_batch``: decode steps of up to this many sequences replay a
    captured CUDA graph (0: never). ``overlap_schedule``: on a GPU with the fast path,
    schedule and launch the next decode step while the current one runs. ``kv_tiers``:
    host memory, disk and Mooncake Store below the device's prefix cache.
    ``grammar_threads``: threads that advance constrained rows' grammars and fill their
    masks each step (xgrammar works without the GIL; ``None``: ``grammar.DEFAULT_GRAMMAR_THREADS``).
    ``speculative_algorithm``: ``ngram`` drafts up to ``speculative_num_draft_tokens`` tokens a
    step from each request's own prompt and output (a suffix of ``speculative_ngram_min`` to
    ``speculative_ngram_max`` tokens looked up), verified in one forward pass; ``""``: off.
    ``speculative_cost_ratio``: the cost of one draft token over a step's time per sequence, fixed
    (``None``: measured from the steps); a request drafts only while its acceptance pays for it
    (``engine/speculative.py``).
    ``quantization``: ``"fp8"`` quantizes the decoder layers' linear weights (qkv, o, gate_up,
    down; not the embeddings or the LM head) to float8_e4m3 with a scale per output channel
    at load, before the KV pool is sized, on pdserve's Triton pass (a GPU of compute
    capability 8.9 or above); anywhere else it is refused (``None``: the checkpoint's dtype).
    ``kv_cache_dtype``: the page pool's dtype: ``auto`` the model's, ``bf16`` (a bfloat16 model's),
    ``fp8_e4m3`` float8_e4m3fn with a power-of-two float32 scale per (page, layer, K|V, head) block
    inside each page (``engine/kv_pool.py``): 1.996x the tokens per byte at head_dim 128.
    """

    page_size: int = 16
    max_total_tokens: int | None = None
    kv_memory_fraction: float = 0.85
    max_num_seqs: int = 128
    chunked_prefill_size: int = 2048
    max_prefill_seqs: int = 16
    enable_prefix_cache: bool = True
    device: str = "cpu"
    dtype: str = "auto"
    num_threads: int | None = None
    max_model_len: int | None = None
    cpu_kv_bytes: int = 512 << 20
    model_impl: str = "auto"
    cpu_attention: str = "auto"  # decode attention on pdserve's CPU pass: auto, native (the C kernel) or torch
    cuda_graph_max_batch: int = 128
    overlap_schedule: bool = True
    kv_tiers: KVTierConfig = KVTierConfig()
    grammar_threads: int | None = None  # structured output's host threads; None: 1
    kv_shared_dir: str = ""  # a CPU pool in a file there (e.g. /dev/shm) that peers of this host map
    speculative_algorithm: str = ""  # "ngram", or "" (off)
    speculative_num_draft_tokens: int = 4
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 4
    speculative_cost_ratio: float | None = None
    quantization: str | None = None  # "fp8": the decoder layers' linear weights in FP8 (see above)
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "bf16" or "fp8_e4m3" (see above)

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError("page_size must be a power of two")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("max_total_tokens must hold at least one page")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError("kv_memory_fraction must be in (0, 1]")
        if self.max_num_seqs < 1 or self.max_prefill_seqs < 1:
            raise ValueError("max_num_seqs and max_prefill_seqs must be at least 1")
        if self.model_impl not in ("auto", "pdserve", "transformers"):
            raise ValueError("model_impl must be auto, pdserve or transformers")
        if self.cpu_attention not in ("auto", "native", "torch"):
            raise ValueError("cpu_attention must be auto, native or torch")
        if self.cuda_graph_max_batch < 0:
            raise ValueError("cuda_graph_max_batch must be at least 0")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization is fp8 or None, not {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype is one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must be at least one page")
        if self.speculative_algorithm not in ("", "ngram"):
            raise ValueError(f"speculative_algorithm must be ngram or empty, not {self.speculative_algorithm!r}")
        if self.speculative_num_draft_tokens < 1:
            raise ValueError("speculative_num_draft_tokens must be at least 1")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError("speculative n-gram sizes must satisfy 1 <= min <= max")
        if self.speculative_cost_ratio is not None and self.speculative_cost_ratio < 0:
            raise ValueError("speculative_cost_ratio must be at least 0")
