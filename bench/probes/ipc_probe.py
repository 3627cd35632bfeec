"""KV between two processes of one host through the ``ipc`` backend (CUDA IPC), timed.

A second process (the prefill side) holds a page pool on GPU 0 at Qwen2.5-7B dimensions
(28 layers, 4 KV heads of 128, bf16, pages of 16 tokens), filled with a known pattern, and
exports it. This process (the decode side) pulls a 4,096-token prompt's pages (235 MB)
through ``IpcTransfer.read`` into its own pool, on GPU 0 (the same GPU) and on GPU 1 when
there is one (a peer GPU), and checks every byte. Each pull is timed from the call to its
return (the copies are waited for): the first one apart (it maps the peer's pool), then the
median of ``--repeats``. Two cases per GPU: the pages as one run on both sides (one copy
launch) and scattered one page per run (256 copy launches: the worst a page table allows).

    python bench/probes/ipc_probe.py --out ipc_probe.json [--tokens 4096] [--repeats 10]

Every wait is bounded (``--start-timeout`` for the peer process, ``--limit`` for the whole
probe: past it the probe prints every thread's stack and exits 1); the JSON is rewritten after
each GPU, so what was measured survives a later failure. Exit 0: every case equal; 1: a case
failed or differed (its ``error`` or ``equal`` says which), or the peer did not start; 2: no
CUDA device.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.ipc_peer import START_TIMEOUT, PeerError, pattern, start_peer
from pdserve.engine.kv_pool import KVPool
from pdserve.schemas import KVLayout
from pdserve.workers.transfer import create_transfer, plan_reads

QWEN_7B = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, page_size=16, dtype="bfloat16")
SPARE_PAGES = 8  # the peer's run starts this far in, so source and destination offsets differ
SEED = 11


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""


def timed_pulls(transfer: Any, endpoint: str, reads: list[tuple[int, int, int]], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` pulls (each returns when its copies are done)."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        transfer.read(endpoint, reads)
        times.append(time.perf_counter() - began)
    return times


def measure(peer: Any, device: str, pages: int, repeats: int) -> dict[str, Any]:
    """Both cases on ``device``, read from ``peer``'s pool (pages ``SPARE_PAGES..``)."""
    page_bytes = peer.page_bytes
    nbytes = pages * page_bytes
    pool = KVPool(QWEN_7B, pages + SPARE_PAGES, torch.device(device))
    transfer = create_transfer("ipc", pool=pool, worker_id=f"probe-{device}")
    transfer.register(pool.data_ptr, pool.nbytes)
    source = pattern((pages + SPARE_PAGES) * page_bytes, SEED, pool.tensor.device).view(-1, page_bytes)
    remote = list(range(SPARE_PAGES, SPARE_PAGES + pages))
    got = pool.tensor.view(pool.num_pages, -1).view(torch.uint8)
    out: dict[str, Any] = {"dst": device, "same_gpu": torch.device(device).index in (None, 0), "bytes": nbytes}
    try:
        for case, local in (("one_run", list(range(pages))), ("page_per_run", list(range(pages - 1, -1, -1)))):
            pool.tensor.zero_()
            reads = plan_reads(peer.segments(remote), page_bytes, local, pool.data_ptr)
            began = time.perf_counter()
            copies = transfer.read(peer.endpoint, reads)
            first = time.perf_counter() - began
            times = timed_pulls(transfer, peer.endpoint, reads, repeats)
            equal = bool(torch.equal(got[local], source[remote]))
            median = statistics.median(times)
            out[case] = {
                "copies": copies,
                "first_ms": round(first * 1e3, 3),
                "median_ms": round(median * 1e3, 4),
                "gb_s": round(nbytes / median / 1e9, 1),
                "times_ms": [round(t * 1e3, 4) for t in times],
                "equal": equal,
            }
            print(
                f"{device} {case}: {copies} copies, first {first * 1e3:.2f} ms, median of {repeats} "
                f"{median * 1e3:.3f} ms ({nbytes / median / 1e9:.0f} GB/s), equal {equal}",
                flush=True,
            )
        out["counts"] = transfer.counts()
    finally:
        transfer.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--tokens", type=int, default=4096, help="the prompt's tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=10, help="timed pulls per case (default: %(default)s)")
    parser.add_argument(
        "--devices", help="the decode side's devices, comma-separated (default: cuda:0, and cuda:1 when there is one)"
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=START_TIMEOUT,
        help="seconds for the peer to start (default: %(default)s)",
    )
    parser.add_argument("--limit", type=float, default=300, help="seconds for the whole probe (default: %(default)s)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ipc_probe: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if args.tokens < QWEN_7B.page_size or args.repeats < 1:
        parser.error("--tokens must fill a page and --repeats be at least 1")
    faulthandler.dump_traceback_later(args.limit, exit=True)
    count = torch.cuda.device_count()
    devices = args.devices.split(",") if args.devices else ["cuda:0", *(["cuda:1"] if count > 1 else [])]
    pages = -(-args.tokens // QWEN_7B.page_size)
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "gpus": count,
        "torch": torch.__version__,
        "commit": git_commit(),
        "layout": QWEN_7B.describe(),
        "tokens": pages * QWEN_7B.page_size,
        "src": "cuda:0 (another process)",
        "pulls": [],
    }

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    failed = False
    try:
        peer = start_peer(QWEN_7B, pages + SPARE_PAGES, "cuda:0", seed=SEED, timeout=args.start_timeout)
    except PeerError as exc:
        result["error"] = str(exc)
        save()
        print(f"ipc_probe: {exc}", file=sys.stderr)
        return 1
    try:
        for device in devices:
            try:
                pull = measure(peer, device, pages, args.repeats)
                failed |= not all(pull[c]["equal"] for c in ("one_run", "page_per_run"))
            except Exception as exc:  # recorded and reported; the other devices still run
                traceback.print_exc()
                pull = {"dst": device, "error": f"{type(exc).__name__}: {exc}"}
                failed = True
            result["pulls"].append(pull)
            save()
    finally:
        peer.stop()
        faulthandler.cancel_dump_traceback_later()
    save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
