"""The ``nccl`` and ``gloo`` backends: the prefill worker sends a request's pages to the
decode worker over a torch.distributed point-to-point communicator, one per
prefill/decode pair, set up once over NATS and reused.

``nccl`` moves CUDA pools (GPU to GPU, over NVLink where the GPUs have it); ``gloo`` moves
CPU pools over TCP, so the very same protocol runs in the CPU tests. The worker names one
(``--disaggregation-transfer-backend``) and it is checked against the pool's device at
start: neither stands in for the other.

A pull, on the decode side, runs in one of its transfer threads and holds that peer's lock,
so one transfer per pair is in flight and both ends issue their operations in one order
(NCCL matches sends to receives by order alone):

1. no link to that prefill worker yet: ask ``KV_LINK`` with this pool's layout and device.
   The prefill worker compares them with its own (a difference is refused, saying which,
   and logged on both sides), answers with its TCP store and a key prefix, and both ends
   build a two-rank group (prefill rank 0, decode rank 1), proven by one small message;
2. ask ``KV_PUSH`` with the remote page runs: the prefill worker checks they are whole
   pages of its pool and queues one send on the link's thread;
3. receive one message, straight into the reserved pages when they are one run, else into
   a staging buffer scattered by one ``index_copy_``.

The prefill side sends the pages as they lie when they are one run (no copy), else gathers
them by one ``index_select``. A page holds every layer's K and V, so a request is one
message whatever the number of layers: 235 MB of a 7B model's KV took 0.67 ms between two
H200s as one NCCL message and 2.96 ms as 56 per-layer messages.

A link is dropped when a transfer on it fails (the next pull opens a new one, under a new
epoch) and when its peer leaves the worker registry (:meth:`P2PTransfer.retain`).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pdserve.broker import contract
from pdserve.engine.kv_pool import KVPool, dtype_difference, page_runs
from pdserve.schemas import KVLayout, KVLink, KVLinkReply, KVPush, KVPushReply, Message
from pdserve.workers.transfer.base import (
    P2P_DEVICES,
    LinkRefused,
    TransferError,
    advertised_host,
    backend_device_error,
    pages_of,
)

if TYPE_CHECKING:
    from nats.aio.client import Client

log = logging.getLogger(__name__)

ASK_TIMEOUT = 2.0
POLL_SECONDS = 5e-5
PROBE_BYTES = 8
_LAYOUT_FIELDS = {  # and the dtype, said by kv_pool.dtype_difference
    "page_size": "page size",
    "num_layers": "layers",
    "num_kv_heads": "KV heads",
    "head_dim": "head dim",
    "order": "page order",
}
R = TypeVar("R", bound=Message)


def device_id(device: torch.device) -> str:
    """What names a pool's device to a peer: a GPU's UUID (the two ranks of an NCCL
    communicator must be on different GPUs), or the device type."""
    if device.type == "cuda":
        return f"cuda-{torch.cuda.get_device_properties(device).uuid}"
    return device.type


def layout_differences(prefill: KVLayout, decode: KVLayout) -> list[str]:
    """Each field in which the two layouts differ, as ``"page size: prefill 16, decode 8"``."""
    dtype = dtype_difference(prefill, decode)
    return [
        f"{label}: prefill {getattr(prefill, name)}, decode {getattr(decode, name)}"
        for name, label in _LAYOUT_FIELDS.items()
        if getattr(prefill, name) != getattr(decode, name)
    ] + ([dtype] if dtype else [])


def merge_runs(runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(address, nbytes)`` runs with adjacent ones joined."""
    merged: list[tuple[int, int]] = []
    for address, nbytes in runs:
        if merged and merged[-1][0] + merged[-1][1] == address:
            merged[-1] = (merged[-1][0], merged[-1][1] + nbytes)
        else:
            merged.append((address, nbytes))
    return merged


def new_group(backend: str, store: Any, rank: int, host: str, timeout: float) -> Any:
    """A two-rank torch.distributed group over ``store``, outside any default group (so a
    worker holds one per peer). gloo's constructor waits for the other rank; NCCL connects
    at the first operation."""
    from torch.distributed import distributed_c10d as c10d

    seconds = datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        gloo: Any = c10d.ProcessGroupGloo  # its options class is private and untyped
        options = gloo._Options()
        options._timeout = seconds
        options._devices = [gloo.create_device(hostname=host)]
        return gloo(store, rank, 2, options)
    nccl: Any = c10d.ProcessGroupNCCL
    options = nccl.Options()
    # Past our own deadline, so a stuck transfer is ours to end (by aborting the link).
    options._timeout = seconds + datetime.timedelta(seconds=5)
    return nccl(store, rank, 2, options)


def abort_group(group: Any) -> None:
    """End a group now: an operation blocked on it fails instead of waiting out its timeout."""
    stop = getattr(group, "abort", None) or getattr(group, "shutdown", None)
    if stop is None:
        return
    try:
        stop()
    except RuntimeError as exc:  # a group whose peer is gone may fail to say goodbye
        log.debug("KV link abort failed", extra={"error": str(exc)})


@dataclass
class Link:
    """This worker's end of a communicator with ``peer``. The prefill end runs its build and
    its sends, in order, on ``thread``."""

    peer: str
    epoch: int
    group: Any = None
    store: Any = None  # the decode end's client of the prefill worker's TCP store
    thread: ThreadPoolExecutor | None = None
    broken: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def retire(self, reason: str) -> None:
        self.broken = reason
        if self.group is not None:
            abort_group(self.group)
        if self.thread is not None:
            self.thread.shutdown(wait=False, cancel_futures=True)


class P2PTransfer:
    """One worker's end of the ``nccl`` or ``gloo`` backend over its page pool.

    ``timeout`` bounds a link's set-up and each transfer (the decode worker uses its lease:
    a read that ends later is not trusted anyway)."""

    def __init__(self, name: str, pool: KVPool, worker_id: str, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
        if name not in P2P_DEVICES:
            raise ValueError(f"not a point-to-point backend: {name!r}")
        wrong_device = backend_device_error(name, pool.device.type)
        if wrong_device is not None:
            raise TransferError(wrong_device)
        if name == "nccl":
            # A failed NCCL operation aborts its communicator and raises, instead of ending the process.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self.name = name
        self.protocol = name
        self.endpoint = worker_id
        self.worker_id = worker_id
        self.pool = pool
        self.host = advertised_host(host)
        self.timeout = timeout
        self.device = device_id(pool.device)
        self._links: dict[str, Link] = {}
        self._lock = threading.Lock()  # guards _links, _counts, _epoch
        self._counts = dict.fromkeys(
            ("kv_links_opened", "kv_links_refused", "kv_sends", "kv_send_bytes", "kv_send_failures"), 0
        )
        self._epoch = 0
        self._nc: Client | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._crash: Callable[[str, BaseException], None] | None = None
        self._store: Any = None
        self._store_address = ""

    # ---- the backend protocol ---------------------------------------------------------
    def register(self, address: int, nbytes: int) -> None:
        """Only the page pool the backend was built on moves; anything else is a mistake."""
        if (address, nbytes) != (self.pool.data_ptr, self.pool.nbytes):
            raise TransferError(f"the {self.name} backend moves its page pool only")

    async def attach(self, nc: Client, serve: bool, crash: Callable[[str, BaseException], None]) -> None:
        self._nc, self._loop, self._crash = nc, asyncio.get_running_loop(), crash
        if not serve:
            return
        from torch.distributed import TCPStore

        self._store = TCPStore(
            self.host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=self.timeout)
        )
        self._store_address = f"{self.host}:{self._store.port}"
        await contract.answer(nc, contract.KV_LINK, self._on_link, self.worker_id)
        await contract.answer(nc, contract.KV_PUSH, self._on_push, self.worker_id)
        log.info("KV links served", extra={"backend": self.name, "store": self._store_address})

    def read(self, endpoint: str, reads: Sequence[tuple[int, int, int]]) -> int:
        """Receive the pages of ``reads`` from prefill worker ``endpoint`` as one message."""
        if not reads:
            return 0
        pool = self.pool
        local = pages_of(pool.data_ptr, pool.page_bytes, [(r[0], r[2]) for r in reads], pool.num_pages)
        remote = merge_runs([(r[1], r[2]) for r in reads])
        link = self._link_to(endpoint)
        with link.lock:
            if link.broken:  # its opening failed, or it was dropped, while this pull waited
                raise TransferError(f"the {self.name} link with {endpoint} is gone: {link.broken}")
            try:
                self._pull(link, remote, local)
            except TransferError as exc:
                self._forget(link)
                link.retire(str(exc))
                raise
        return 1

    def retain(self, live: set[str]) -> None:
        with self._lock:
            gone = [link for peer, link in self._links.items() if peer not in live]
            for link in gone:
                del self._links[link.peer]
        for link in gone:
            log.info("KV link closed: its peer left the registry", extra={"peer": link.peer, "epoch": link.epoch})
            link.retire("the peer left")

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.retire("closed")
        self._store = None

    # ---- decode side ------------------------------------------------------------------
    def _link_to(self, peer: str) -> Link:
        """The open link to ``peer``, opened now (under its lock) if there is none."""
        with self._lock:
            link = self._links.get(peer)
            if link is not None:
                return link
            link = Link(peer, 0)
            self._links[peer] = link
            link.lock.acquire()
        try:
            self._open(link)
        except TransferError as exc:
            link.broken = str(exc)
            self._forget(link)
            raise
        finally:
            link.lock.release()
        return link

    def _open(self, link: Link) -> None:
        pool = self.pool
        ask = KVLink(self.worker_id, link.peer, self.name, pool.layout, pool.page_bytes, self.device)
        reply: KVLinkReply = self._ask(contract.KV_LINK, ask, link.peer)
        if not reply.granted:
            self._count("kv_links_refused")
            log.error(
                "a prefill worker refused a KV link: its KV cannot be read here",
                extra={"peer": link.peer, "reason": reply.reason},
            )
            raise LinkRefused(f"prefill worker {link.peer} refuses a {self.name} link: {reply.reason}")
        from torch.distributed import PrefixStore, TCPStore

        host, _, port = reply.store.rpartition(":")
        deadline = time.monotonic() + self.timeout
        self._use_device()
        try:
            link.store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=self.timeout))
            link.group = new_group(self.name, PrefixStore(reply.prefix, link.store), 1, self.host, self.timeout)
            probe = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=pool.device)
            self._finish(link.group.recv([probe], 0, 0), deadline)
        except RuntimeError as exc:
            if link.group is not None:
                abort_group(link.group)
            raise TransferError(f"{self.name} link with {link.peer} failed: {exc}") from None
        link.epoch = reply.epoch
        self._count("kv_links_opened")
        log.info("KV link open", extra={"peer": link.peer, "backend": self.name, "epoch": link.epoch})

    def _pull(self, link: Link, remote: list[tuple[int, int]], pages: list[int]) -> None:
        push = KVPush(self.worker_id, link.peer, link.epoch, tuple(remote))
        reply: KVPushReply = self._ask(contract.KV_PUSH, push, link.peer)
        if not reply.accepted:
            raise TransferError(f"prefill worker {link.peer} will not push: {reply.reason}")
        pool = self.pool.tensor
        runs = page_runs(pages)
        deadline = time.monotonic() + self.timeout
        self._use_device()
        if len(runs) == 1:
            first, count = runs[0]
            target = pool[first : first + count]
            self._finish(self._op(link.group.recv, target, 0), deadline)
        else:
            target = torch.empty((len(pages), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
            self._finish(self._op(link.group.recv, target, 0), deadline)
            pool.index_copy_(0, torch.tensor(pages, device=pool.device), target)
        self._synchronize()

    def _ask(self, service: contract.Service[Any, R], message: Message, peer: str) -> R:
        """``contract.ask`` on the worker's event loop, from a transfer thread."""
        assert self._nc is not None and self._loop is not None, "attach() first"
        ask = contract.ask(self._nc, service, message, peer, timeout=ASK_TIMEOUT)
        try:
            return asyncio.run_coroutine_threadsafe(ask, self._loop).result(ASK_TIMEOUT + 1.0)
        except (contract.Unanswered, TimeoutError) as exc:
            raise TransferError(f"{service.name} to {peer}: {exc or 'no answer'}") from None

    def _forget(self, link: Link) -> None:
        with self._lock:
            if self._links.get(link.peer) is link:
                del self._links[link.peer]

    # ---- prefill side -----------------------------------------------------------------
    async def _on_link(self, ask: KVLink) -> KVLinkReply:
        reason = self._mismatch(ask)
        if reason:
            self._count("kv_links_refused")
            log.error(
                "a decode worker cannot read this worker's KV: refused its link",
                extra={"peer": ask.decode_id, "reason": reason},
            )
            return KVLinkReply(granted=False, reason=reason)
        with self._lock:
            old = self._links.pop(ask.decode_id, None)
            self._epoch += 1
            link = Link(ask.decode_id, self._epoch, thread=ThreadPoolExecutor(1, thread_name_prefix="kv-link"))
            self._links[ask.decode_id] = link
        if old is not None:
            old.retire("replaced by a new link")
        prefix = f"{ask.decode_id}/{link.epoch}"
        self._submit(link, "link", self._build, link, prefix)
        return KVLinkReply(granted=True, store=self._store_address, prefix=prefix, epoch=link.epoch)

    def _mismatch(self, ask: KVLink) -> str:
        """Why this (prefill) worker cannot pair with the asking decode worker, or ``""``."""
        pool = self.pool
        reasons = []
        if ask.backend != self.name:
            reasons.append(f"backend: prefill {self.name}, decode {ask.backend}")
        reasons += layout_differences(pool.layout, ask.layout)
        if not reasons and ask.page_bytes != pool.page_bytes:
            reasons.append(f"page bytes: prefill {pool.page_bytes}, decode {ask.page_bytes}")
        if self.name == "nccl" and ask.device == self.device:
            reasons.append(f"both on GPU {self.device}: NCCL pairs two GPUs (place the workers on different devices)")
        return "; ".join(reasons)

    async def _on_push(self, push: KVPush) -> KVPushReply:
        with self._lock:
            link = self._links.get(push.decode_id)
        if link is None or link.epoch != push.epoch or link.broken:
            return KVPushReply(
                accepted=False, reason=f"no open link of epoch {push.epoch} (the decode worker opens one)"
            )
        pool = self.pool
        try:
            pages = pages_of(pool.data_ptr, pool.page_bytes, [(a, n) for a, n in push.segments], pool.num_pages)
        except TransferError as exc:
            return KVPushReply(accepted=False, reason=str(exc))
        self._submit(link, "push", self._send, link, pages)
        return KVPushReply(accepted=True)

    def _build(self, link: Link, prefix: str) -> None:
        from torch.distributed import PrefixStore

        deadline = time.monotonic() + self.timeout
        self._use_device()
        try:
            group = new_group(self.name, PrefixStore(prefix, self._store), 0, self.host, self.timeout)
            probe = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=self.pool.device)
            self._finish(group.send([probe], 1, 0), deadline)
        except RuntimeError as exc:
            raise TransferError(f"{self.name} link with {link.peer} failed: {exc}") from None
        link.group = group
        self._count("kv_links_opened")
        log.info("KV link open", extra={"peer": link.peer, "backend": self.name, "epoch": link.epoch})

    def _send(self, link: Link, pages: list[int]) -> None:
        if link.group is None:
            raise TransferError("the link was never built")
        pool = self.pool.tensor
        runs = page_runs(pages)
        deadline = time.monotonic() + self.timeout
        self._use_device()
        if len(runs) == 1:
            first, count = runs[0]
            source = pool[first : first + count]
        else:
            source = pool.index_select(0, torch.tensor(pages, device=pool.device))
        self._finish(self._op(link.group.send, source, 1), deadline)
        self._synchronize()
        with self._lock:
            self._counts["kv_sends"] += 1
            self._counts["kv_send_bytes"] += len(pages) * self.pool.page_bytes

    def _submit(self, link: Link, what: str, job: Callable[..., None], *args: Any) -> None:
        """Run ``job`` on the link's thread. A :class:`TransferError` retires the link (its
        peer's receive fails and it opens a new one); anything else ends the worker."""
        assert link.thread is not None
        try:
            future = link.thread.submit(job, *args)
        except RuntimeError:  # the link was retired meanwhile: its peer's receive fails
            return

        def settled(future: Future[None]) -> None:
            if future.cancelled():
                return
            exc = future.exception()
            if exc is None:
                return
            if not isinstance(exc, TransferError):
                assert self._crash is not None
                self._crash(f"kv link {what}", exc)
                return
            if what == "push":
                self._count("kv_send_failures")
            log.warning("KV link failed", extra={"peer": link.peer, "step": what, "error": str(exc)})
            self._forget(link)
            link.retire(str(exc))

        future.add_done_callback(settled)

    # ---- both sides ---------------------------------------------------------------------
    def _op(self, op: Callable[[list[torch.Tensor], int, int], Any], tensor: torch.Tensor, peer: int) -> Any:
        """One send or receive of ``tensor``'s bytes."""
        try:
            return op([tensor.view(torch.uint8)], peer, 0)
        except RuntimeError as exc:
            raise TransferError(f"{self.name} {getattr(op, '__name__', 'op')} failed: {exc}") from None

    def _finish(self, work: Any, deadline: float) -> None:
        """Wait for ``work``. gloo's wait ends at the group's timeout; NCCL's is polled, so a
        stuck peer costs at most ``timeout`` before the caller retires the link."""
        try:
            if self.name == "nccl":
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TransferError(f"{self.name} transfer not done within {self.timeout:g}s")
                    time.sleep(POLL_SECONDS)
            work.wait()
        except RuntimeError as exc:
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"{self.name} transfer failed: {exc}") from None

    def _use_device(self) -> None:
        if self.pool.device.type == "cuda":
            torch.cuda.set_device(self.pool.device)

    def _synchronize(self) -> None:
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()

    def _count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self._counts[counter] += n


__all__ = ["P2PTransfer", "device_id", "layout_differences", "merge_runs"]
