"""A held request's KV moved from one engine's pool into another's over Mooncake (TCP on
loopback), the way a decode worker pulls it: one batched read into the pages it reserved."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pdserve.engine.engine import Engine
from pdserve.schemas import SamplingParams


@contextmanager
def mooncake_pair(prefill: Engine, decode: Engine) -> Iterator[tuple[Any, Any]]:
    """Two Mooncake engines, each with its engine's pool registered: ``(src, dst)``."""
    from pdserve.workers.transfer import create_transfer

    src = create_transfer("mooncake", host="127.0.0.1", protocol="tcp")
    dst = create_transfer("mooncake", host="127.0.0.1", protocol="tcp")
    try:
        for engine, backend in ((prefill, src), (decode, dst)):
            pool = engine.runner.pool
            backend.register(pool.data_ptr, pool.nbytes)
        yield src, dst
    finally:
        src.close()
        dst.close()


def pull(
    ends: tuple[Any, Any],
    prefill: Engine,
    decode: Engine,
    rid: str,
    prompt: list[int],
    output_ids: list[int],
    params: SamplingParams,
) -> int:
    """Import ``rid`` (held by ``prefill``, its output so far ``output_ids``) into ``decode``
    and let ``prefill`` release it; returns the tokens of KV moved."""
    from pdserve.workers.transfer import plan_reads

    src, dst = ends
    pages, num_tokens = prefill.held_pages(rid)
    page = prefill.runner.pool.layout.page_size
    seq = decode.reserve_import(rid, prompt, output_ids, params)
    assert seq is not None
    reads = plan_reads(
        prefill.runner.pool.segments(pages[: -(-num_tokens // page)]),
        decode.runner.pool.page_bytes,
        seq.page_table[: -(-num_tokens // page)],
        decode.runner.pool.data_ptr,
        seq.num_cached // page,
    )
    dst.read(src.endpoint, reads)
    decode.commit_import(seq)
    assert prefill.release(rid)
    return num_tokens
