"""The ``ipc`` backend: KV between GPU worker processes of one host through CUDA IPC.

Each worker exports its CUDA page pool once, at start, with torch's own machinery
(``UntypedStorage._share_cuda_``, as ``torch.multiprocessing`` does for a tensor it sends):
the caching allocator's ``cudaIpcMemHandle`` of the block holding the pool, the pool's offset
in that block, torch's ref-counter file, plus the pool's address, size and KV layout. That
export, base64 in the endpoint (``ipc:<host>:<worker id>:<export>``), travels in the registry
and in every KV handle. A decode worker maps a prefill worker's pool once
(``UntypedStorage._new_shared_cuda`` on its own device: the same GPU, or a peer GPU of the
host reached over NVLink), keeps the mapping until that worker leaves the registry
(:meth:`IpcTransfer.retain`), and copies the planned runs device to device on a stream of its
own: one ``cudaMemcpyAsync`` per run (:func:`~.base.copy_runs`). A request whose pages are one
run on both sides (as in a fresh pool) is one copy; at worst one per page (256 of 917 KB for a
7B model's 4,096 tokens in pages of 16). No socket, no port.

Mapping is the handshake: the export's KV layout and page bytes are compared with this
pool's, and a pool of another host, of this very process, or of a GPU this process cannot
reach (not visible, or no peer access) is refused, saying why: :class:`LinkRefused`,
counted in ``kv_links_refused`` (a deployment mistake, answered with an error, never a
recompute). A pool that cannot be opened (its worker stopped) is a :class:`TransferError`:
the decode worker computes the prompt itself, counted. ``kv_links_opened`` counts mappings.

The pool must come from the caching allocator's ordinary ``cudaMalloc`` segments: with
``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``) or the ``cudaMallocAsync`` backend
its memory has no ``cudaIpcMemHandle``, and the backend refuses to start.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson
import torch

from pdserve.engine.kv_pool import KVPool
from pdserve.schemas import KVLayout
from pdserve.workers.transfer.base import LinkRefused, TransferError, copy_runs
from pdserve.workers.transfer.p2p import layout_differences

if TYPE_CHECKING:
    from nats.aio.client import Client

log = logging.getLogger(__name__)

PROTOCOL = "ipc"
VERSION = 1
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads both (the second since 2.9)
_HANDLE_BYTES = 64  # a cudaIpcMemHandle_t
_NO_EVENT = bytes(_HANDLE_BYTES)  # the producer synchronised before exporting: no event to wait for
# This process, to a peer: pids repeat across containers of one host (each one's first is 1).
PROCESS = uuid.uuid4().hex
_INTEGERS = ("pid", "storage_bytes", "storage_offset", "ref_counter_offset", "tensor_offset", "address")


@dataclasses.dataclass(frozen=True, slots=True)
class IpcExport:
    """What a peer needs to map a worker's pool. ``handle``, ``storage_bytes``,
    ``storage_offset``, ``ref_counter`` and ``ref_counter_offset`` are
    ``UntypedStorage._share_cuda_()``'s (the storage's offset in its allocator block, in bytes);
    ``tensor_offset`` is the pool's first byte in that storage; ``address`` the pool's address
    in its own process, which the handle's segments are given in."""

    pid: int
    process: str  # :data:`PROCESS` of the exporting process
    gpu: str  # the GPU's UUID
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    tensor_offset: int
    address: int
    nbytes: int
    page_bytes: int
    layout: KVLayout

    def encode(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["handle"] = base64.b64encode(self.handle).decode()
        fields["ref_counter"] = base64.b64encode(self.ref_counter).decode()
        fields["layout"] = dataclasses.asdict(self.layout)
        return base64.urlsafe_b64encode(orjson.dumps({"v": VERSION, **fields})).decode()

    @classmethod
    def decode(cls, text: str) -> IpcExport:
        """Raises ``ValueError`` (or ``KeyError``, ``TypeError``, ``AttributeError``) for anything but an export."""
        fields = orjson.loads(base64.urlsafe_b64decode(text.encode()))
        if fields.pop("v") != VERSION:
            raise ValueError("another export version")
        fields["handle"] = base64.b64decode(fields["handle"])
        fields["ref_counter"] = base64.b64decode(fields["ref_counter"])
        fields["layout"] = KVLayout(**fields["layout"])
        export = cls(**fields)
        for name in (*_INTEGERS, "nbytes", "page_bytes"):
            if not isinstance(getattr(export, name), int) or getattr(export, name) < 0:
                raise ValueError(name)
        if export.nbytes <= 0 or export.page_bytes <= 0 or export.tensor_offset + export.nbytes > export.storage_bytes:
            raise ValueError("sizes")
        return export


def ipc_endpoint(host: str, worker_id: str, export: IpcExport) -> str:
    return f"{PROTOCOL}:{host}:{worker_id}:{export.encode()}"


def parse_endpoint(endpoint: str) -> tuple[str, str, IpcExport]:
    """``(host, worker id, export)`` of an endpoint; :class:`LinkRefused` if malformed."""
    try:
        kind, host, worker_id, text = endpoint.split(":", 3)
        if kind != PROTOCOL:
            raise ValueError(kind)
        return host, worker_id, IpcExport.decode(text)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise LinkRefused(f"{endpoint[:80]!r} is not an ipc endpoint") from None


def expandable_segments(environ: Mapping[str, str]) -> str:
    """The allocator setting that turns expandable segments on (``"PYTORCH_CUDA_ALLOC_CONF=..."``), or ``""``."""
    for var in ALLOC_CONF_VARS:
        for option in environ.get(var, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return f"{var}={environ[var]}"
    return ""


def handle_kind(handle: bytes) -> str:
    """``cudaMalloc`` or ``expandable`` (torch's handle: a version byte, a kind byte, the
    handle; before torch 2.3, the 64-byte ``cudaIpcMemHandle`` alone), else ``unknown``."""
    if len(handle) == _HANDLE_BYTES:
        return "cudaMalloc"
    kind = handle[1:2]
    return {b"c": "cudaMalloc", b"e": "expandable"}.get(kind, "unknown") if len(handle) > 2 else "unknown"


def refusal(export: IpcExport, peer_host: str, host: str, process: str, layout: KVLayout, page_bytes: int) -> str:
    """Why a worker of ``host`` in ``process`` whose pool has ``layout`` and ``page_bytes``
    can never map ``export`` (a pool of ``peer_host``), or ``""``. The GPU is checked apart."""
    if peer_host != host:
        return (
            f"a pool of host {peer_host}, this is {host}: the ipc backend moves KV between the GPU processes of one "
            "host (use mooncake across hosts)"
        )
    if export.process == process:
        return "a pool of this very process: CUDA IPC maps another process's memory (one process: the local backend)"
    differences = layout_differences(export.layout, layout)
    if not differences and export.page_bytes != page_bytes:
        differences.append(f"page bytes: prefill {export.page_bytes}, decode {page_bytes}")
    return "KV layouts differ: " + "; ".join(differences) if differences else ""


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class IpcTransfer:
    """One worker's end over its CUDA page pool, exported at construction."""

    name = "ipc"
    protocol = PROTOCOL

    def __init__(self, pool: KVPool, worker_id: str, environ: Mapping[str, str] = os.environ) -> None:
        if pool.device.type != "cuda":
            raise TransferError(
                f"the ipc backend maps CUDA page pools, not {pool.device.type} ones (CPU pools of one host move "
                "over shm)"
            )
        setting = expandable_segments(environ)
        if setting:
            raise TransferError(
                f"the ipc backend cannot export a page pool allocated with expandable segments ({setting}): CUDA "
                "IPC handles need cudaMalloc'd memory; unset expandable_segments (or use nccl or mooncake)"
            )
        self.pool = pool
        self.device = pool.tensor.device  # with its index, whatever the configuration said
        self.host = socket.gethostname()
        self.worker_id = worker_id
        self.endpoint = ipc_endpoint(self.host, worker_id, self._export())
        self._bytes = pool.tensor.view(-1).view(torch.uint8)
        self._stream = torch.cuda.Stream(self.device)
        self._peers: dict[str, tuple[str, torch.Tensor, int]] = {}  # endpoint -> (worker id, bytes, address)
        self._counts = dict.fromkeys(("kv_links_opened", "kv_links_refused"), 0)
        self._lock = threading.Lock()

    def _export(self) -> IpcExport:
        pool = self.pool
        storage = pool.tensor.untyped_storage()
        try:
            shared: tuple[Any, ...] = storage._share_cuda_()
        except RuntimeError as exc:
            raise TransferError(f"the ipc backend cannot export this page pool: {exc}") from None
        _, handle, storage_bytes, storage_offset, ref_counter, ref_counter_offset, _, _ = shared
        kind = handle_kind(handle)
        if kind != "cudaMalloc":
            raise TransferError(
                f"the ipc backend cannot export this page pool: its memory is a {kind} segment, not cudaMalloc'd "
                "(expandable_segments on, through PYTORCH_CUDA_ALLOC_CONF or torch.cuda.memory._set_allocator_settings?)"
            )
        torch.cuda.synchronize(self.device)  # the pool's zeros are written: a peer waits for no event
        # torch counts one consumer per export; peers are many and the pool lives as long as the
        # worker, so the producer does not hold its memory for them (reads are leased anyway).
        torch.UntypedStorage._release_ipc_counter_cuda(ref_counter, ref_counter_offset)
        return IpcExport(
            pid=os.getpid(),
            process=PROCESS,
            gpu=gpu_uuid(self.device),
            handle=bytes(handle),
            storage_bytes=int(storage_bytes),
            storage_offset=int(storage_offset),
            ref_counter=bytes(ref_counter),
            ref_counter_offset=int(ref_counter_offset),
            tensor_offset=pool.data_ptr - storage.data_ptr(),
            address=pool.data_ptr,
            nbytes=pool.nbytes,
            page_bytes=pool.page_bytes,
            layout=pool.layout,
        )

    def register(self, address: int, nbytes: int) -> None:
        if address != self.pool.data_ptr or nbytes != self.pool.nbytes:
            raise TransferError("the ipc backend shares whole page pools: register the worker's own pool")

    async def attach(self, nc: Client, serve: bool, crash: Callable[[str, BaseException], None]) -> None:
        """Nothing to attach: peers map the exported pool."""

    def _refuse(self, worker_id: str, reason: str) -> LinkRefused:
        with self._lock:
            self._counts["kv_links_refused"] += 1
        log.error("a prefill worker's KV pool cannot be mapped here", extra={"peer": worker_id, "reason": reason})
        return LinkRefused(f"prefill worker {worker_id} (ipc): {reason}")

    def _visible_index(self, gpu: str) -> int | None:
        """This process's index of the GPU of UUID ``gpu``, if it sees that GPU."""
        for index in range(torch.cuda.device_count()):
            if gpu_uuid(torch.device("cuda", index)) == gpu:
                return index
        return None

    def _mapped(self, endpoint: str) -> tuple[torch.Tensor, int]:
        with self._lock:
            known = self._peers.get(endpoint)
        if known is not None:
            return known[1], known[2]
        host, worker_id, export = parse_endpoint(endpoint)
        pool = self.pool
        reason = refusal(export, host, self.host, PROCESS, pool.layout, pool.page_bytes)
        index = self._visible_index(export.gpu) if not reason else None
        if not reason and index is None:
            reason = f"its GPU {export.gpu} is not visible to this process (CUDA_VISIBLE_DEVICES?)"
        mine = self.device.index
        assert mine is not None
        if not reason and index != mine and not torch.cuda.can_device_access_peer(mine, index):
            reason = f"GPU {mine} here has no peer access to its GPU {index} (no NVLink or PCIe peer path)"
        if reason:
            raise self._refuse(worker_id, reason)
        try:  # mapped on this worker's device: a peer GPU's memory is reached through peer access
            storage = torch.UntypedStorage._new_shared_cuda(
                mine,
                export.handle,
                export.storage_bytes,
                export.storage_offset,
                export.ref_counter,
                export.ref_counter_offset,
                _NO_EVENT,
                False,
            )
        except RuntimeError as exc:
            raise TransferError(f"prefill worker {worker_id}'s page pool cannot be opened (gone?): {exc}") from None
        whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (export.storage_bytes,), (1,))
        mapped = whole[export.tensor_offset : export.tensor_offset + export.nbytes]
        with self._lock:
            if endpoint not in self._peers:
                for old in [e for e, (w, _, _) in self._peers.items() if w == worker_id]:
                    del self._peers[old]  # that worker's earlier pool: it restarted under the same id
                self._peers[endpoint] = (worker_id, mapped, export.address)
                self._counts["kv_links_opened"] += 1
                log.info(
                    "KV pool of a peer mapped (CUDA IPC)",
                    extra={"peer": worker_id, "gpu": index, "here": mine, "bytes": export.nbytes},
                )
            _, mapped, address = self._peers[endpoint]
        return mapped, address

    def read(self, endpoint: str, reads: Sequence[tuple[int, int, int]]) -> int:
        """Copy the runs on this backend's stream, one copy each, and wait for them."""
        src, address = self._mapped(endpoint)
        try:
            with torch.cuda.stream(self._stream):
                copies = copy_runs(self._bytes, self.pool.data_ptr, src, address, reads)
                done = torch.cuda.Event()
                done.record(self._stream)
            done.synchronize()
        except RuntimeError as exc:  # TransferError included: a run outside the pools
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"copy from {parse_endpoint(endpoint)[1]}'s page pool failed: {exc}") from None
        return copies

    def retain(self, live: set[str]) -> None:
        """Unmap the pools of peers that left the registry."""
        with self._lock:
            for endpoint in [e for e, (w, _, _) in self._peers.items() if w not in live]:
                del self._peers[endpoint]

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        with self._lock:
            self._peers.clear()
