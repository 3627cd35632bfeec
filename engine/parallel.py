"""Tensor parallelism inside one worker: ``N`` processes (ranks), one device each, one
model sharded across them, one page pool sharded by KV heads.

Rank 0 is the worker the rest of the system sees: it speaks to NATS, schedules, samples.
Before each forward pass it broadcasts the step (what each row computes and where its KV
lives) over a gloo group; ranks 1.. receive it and run the same forward pass on their
shard, and the partial sums meet in one all-reduce after the attention's output
projection and one after the MLP's down projection (gloo on the CPU, NCCL on GPUs).
Followers never sample: rank 0's logits are the step's.

The weights are split by ``transformers``' own tensor-parallel plan for the architecture
(``config.base_model_tp_plan``: q/k/v and gate/up ``colwise``, o and down ``rowwise``),
applied as plain tensor slices rather than DTensors, so both the stock forward pass (a
forward hook all-reduces each row-parallel output) and pdserve's fast path (which
all-reduces itself, inside its CUDA graphs) run on ordinary tensors.

Every rank's pool has the same pages; rank ``r`` holds KV heads
``[r * h, (r + 1) * h)`` with ``h = num_kv_heads / N``. Page ids, the prefix cache and the
scheduler live on rank 0 only: a follower writes exactly the pages rank 0's step names.
"""

from __future__ import annotations

import datetime
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from pdserve.engine.sequence import ScheduledBatch, Sequence

log = logging.getLogger(__name__)

# A follower waits this long for rank 0's next command (an idle worker sends none): rank 0's
# death is seen at once as a closed connection, not as this timeout.
IDLE_TIMEOUT = datetime.timedelta(days=365)
SETUP_TIMEOUT = datetime.timedelta(seconds=300)
SUPPORTED_STYLES = ("colwise", "rowwise")


class TPError(RuntimeError):
    """Tensor parallelism cannot be set up as asked (a model that does not split evenly)."""


@dataclass
class TPGroup:
    """This process's place in its worker's tensor-parallel group.

    ``store`` is the group's TCP store (rank 0 hosts it): endpoints and pull results
    travel there. ``control`` carries rank 0's commands (gloo, host memory); ``compute`` the
    forward pass's all-reduces (NCCL on GPUs, gloo on the CPU)."""

    rank: int
    size: int
    store: Any
    control: Any = None
    compute: Any = None
    _send_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.compute)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` into every rank's (on the compute group: device to device)."""
        import torch.distributed as dist

        dist.broadcast(tensor, src=0, group=self.compute)

    def send(self, command: tuple[Any, ...]) -> None:
        """Rank 0: broadcast ``command`` to every follower (in the order sends are made)."""
        import torch.distributed as dist

        assert self.is_leader
        box: list[Any] = [command]
        with self._send_lock:
            dist.broadcast_object_list(box, src=0, group=self.control)

    def receive(self) -> tuple[Any, ...]:
        """A follower: rank 0's next command (blocks; raises if rank 0 is gone)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return cast(tuple[Any, ...], box[0])

    def close(self) -> None:
        """Leave the groups (every rank, at its end): a process that exits with them alive
        may abort in their threads' destructors (seen: SIGABRT after a clean stop)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def start_store(host: str) -> tuple[Any, str]:
    """Rank 0, before it starts the followers: the group's TCP store on a free port, and
    its ``host:port`` for the followers' command lines."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=SETUP_TIMEOUT)
    return store, f"{host}:{store.port}"


def connect_store(address: str) -> Any:
    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=SETUP_TIMEOUT)


def join_group(rank: int, size: int, store: Any, device: torch.device, backend: str | None = None) -> TPGroup:
    """Every rank at start, together: the default process group over ``store`` (``backend``:
    by default NCCL on a GPU, gloo on the CPU; gloo on GPUs only for a check with every rank
    on one device, which NCCL refuses) and the gloo group of rank 0's commands."""
    import torch.distributed as dist

    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("tp", store),
        rank=rank,
        world_size=size,
        timeout=SETUP_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    group = TPGroup(rank, size, store, control=control, compute=None)
    log.info("tensor-parallel group joined", extra={"rank": rank, "size": size, "backend": backend})
    return group


# ---- sharding ---------------------------------------------------------------------------
def check_divisible(config: Any, size: int) -> None:
    """Raise :class:`TPError` unless heads, KV heads and the MLP split evenly over ``size``."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    parts = {
        "attention heads": heads,
        "KV heads": kv_heads,
        "intermediate size": getattr(config, "intermediate_size", size),
    }
    uneven = [f"{name} {n}" for name, n in parts.items() if n % size]
    if uneven:
        raise TPError(
            f"--tensor-parallel-size {size} does not divide the model's {', '.join(uneven)}: "
            "pdserve splits each evenly over the ranks (KV heads are not replicated)"
        )


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """``transformers``' tensor-parallel plan of the model's decoder (module pattern ->
    style), or a :class:`TPError` if it has none pdserve can apply."""
    config = model.config.get_text_config()  # type: ignore[union-attr,operator]
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise TPError(f"{type(model).__name__} has no tensor-parallel plan in transformers")
    unknown = sorted({style for style in plan.values() if style not in SUPPORTED_STYLES})
    if unknown:
        raise TPError(f"{type(model).__name__}'s tensor-parallel plan uses {', '.join(unknown)}: not supported")
    return plan


def shard_model(model: torch.nn.Module, rank: int, size: int, reduce: Callable[[torch.Tensor], None]) -> int:
    """Split ``model``'s weights in place by its plan: ``colwise`` keeps this rank's rows
    (and bias), ``rowwise`` this rank's columns (the bias on rank 0 only) and all-reduces the
    module's output through ``reduce``. Returns the number of modules split."""
    config = model.config.get_text_config()  # type: ignore[union-attr,operator]
    check_divisible(config, size)
    plan = tp_plan(model)
    base = getattr(model, "base_model", model)
    patterns = [(re.compile(p.replace(".", r"\.").replace("*", r"\d+")), style) for p, style in plan.items()]
    count = 0
    for name, module in base.named_modules():
        style = next((s for p, s in patterns if p.fullmatch(name)), None)
        if style is None:
            continue
        assert isinstance(module, torch.nn.Linear), f"{name} is not a linear layer"
        _split(module, style, rank, size)
        if style == "rowwise":
            module.register_forward_hook(_all_reduce_hook(reduce))
            module.pd_tp_reduce = True  # type: ignore[assignment]
        count += 1
    if not count:
        raise TPError(f"{type(model).__name__}: its tensor-parallel plan names no module of the loaded model")
    return count


def _split(module: torch.nn.Linear, style: str, rank: int, size: int) -> None:
    weight = module.weight.data
    with torch.no_grad():
        if style == "colwise":
            module.weight.data = weight.chunk(size, dim=0)[rank].clone()
            if module.bias is not None:
                module.bias.data = module.bias.data.chunk(size)[rank].clone()
            module.out_features //= size
        else:
            module.weight.data = weight.chunk(size, dim=1)[rank].clone()
            if module.bias is not None and rank != 0:
                module.bias = None  # type: ignore[assignment]
            module.in_features //= size


def _all_reduce_hook(reduce: Callable[[torch.Tensor], None]) -> Callable[..., torch.Tensor]:
    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        reduce(output)
        return output

    return hook


# ---- the step as followers see it ----------------------------------------------------------
@dataclass
class MirrorSeq:
    """What a follower needs of a sequence to run rank 0's step: its token ids up to the
    end of the step's chunk (only that chunk is sent; the rest are zeros, never read), its
    length, how much is computed, its pages."""

    rid: str
    tokens: list[int]
    num_tokens: int
    num_computed: int
    page_table: list[int]

    @property
    def last_token(self) -> int:
        return self.tokens[-1]


def step_command(batch: ScheduledBatch, feed_rows: list[int] | None) -> tuple[Any, ...]:
    """Rank 0's step as a plain, picklable command. ``feed_rows``: per decode, its row in
    the tokens last shared (``"tokens"``) that is its input, or -1 (see ``Engine._feed``).
    A decode whose input is fed has a placeholder ``last_token``; the row gives the truth.
    Speculative verifies go as a decode's fields and the draft: the followers compute the same
    rows; accepting, and giving back the pages of rejected tokens, are rank 0's (a follower
    holds no pages of its own: each step names them)."""
    decodes = [(s.last_token, s.num_tokens, list(s.page_table)) for s in batch.decodes]
    prefills = [
        (s.tokens[s.num_computed : s.num_computed + n], s.num_computed, s.num_tokens, list(s.page_table))
        for s, n in batch.prefills
    ]
    verifies = [(s.last_token, s.num_tokens, list(s.page_table), list(draft)) for s, draft in batch.verifies]
    index = {id(s): i for i, (s, _) in enumerate(batch.prefills)}
    scored = [(index[id(s)], p, n) for s, p, n in batch.scored]
    return ("step", decodes, prefills, feed_rows, verifies, scored)


def mirror_batch(
    decodes: list[Any], prefills: list[Any], verifies: list[Any], scored: list[Any] | None = None
) -> ScheduledBatch:
    """A follower's copy of rank 0's step (see :func:`step_command`): the same rows, the
    prompt rows rank 0 scores included (past the last layer every rank computes the rows kept)."""
    rows = [MirrorSeq(f"d{i}", [t], n, n - 1, table) for i, (t, n, table) in enumerate(decodes)]
    chunks = [
        (MirrorSeq(f"p{i}", [0] * done + chunk, total, done, table), len(chunk))
        for i, (chunk, done, total, table) in enumerate(prefills)
    ]
    drafted = [
        (MirrorSeq(f"v{i}", [t], n, n - 1, table), list(draft)) for i, (t, n, table, draft) in enumerate(verifies)
    ]
    return ScheduledBatch(
        cast(list[Sequence], rows),
        cast(list[tuple[Sequence, int]], chunks),
        verifies=cast(list[tuple[Sequence, list[int]]], drafted),
        scored=[(cast(Sequence, chunks[i][0]), p, n) for i, p, n in scored or ()],
    )
