"""From token chunks to text: deltas for streaming, one result for the rest."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.api.detokenizer import IncrementalDetokenizer, StopMatcher
from pdserve.api.gateway import Gateway
from pdserve.api.model_info import ModelInfo
from pdserve.api.protocol import Job
from pdserve.schemas import PromptLogprobs, TokenChunk, TokenLogprob, Usage
from pdserve.schemas.sampling import sample_rid


@dataclass
class Delta:
    """New text of one request; the last delta has ``finish_reason`` and ``usage``."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timings: dict[str, float] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # on the first delta, when the request asks for them


@dataclass
class Result:
    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_reason: str | int | None = None
    usage: Usage | None = None
    first_token_seconds: float = 0.0
    seconds: float = 0.0
    timings: dict[str, float] | None = None
    prompt_logprobs: PromptLogprobs | None = None


async def deltas(
    gateway: Gateway,
    info: ModelInfo,
    job: Job,
    rid: str,
    timeout: float,
    skip_special_tokens: bool = True,
) -> AsyncIterator[Delta]:
    """Stream ``job``; text is cut exactly before the first stop string."""
    detok = IncrementalDetokenizer(info.tokenizer, skip_special_tokens)
    stop = StopMatcher(job.sampling.stop, job.sampling.stop_regex)
    chunks = gateway.generate(job.prompt_ids, job.sampling, rid, timeout)
    async with contextlib.aclosing(chunks):
        async for delta in _deltas(chunks, job, detok, stop):
            yield delta
            if delta.finish_reason is not None:
                return


async def _deltas(
    chunks: AsyncIterator[TokenChunk], job: Job, detok: IncrementalDetokenizer, stop: StopMatcher
) -> AsyncIterator[Delta]:
    num_tokens = 0
    async for chunk in chunks:
        if not job.show_output:  # max_tokens 0: the prompt alone (the token drawn is not shown)
            if chunk.finish_reason is None:
                continue
            usage = chunk.usage or Usage(len(job.prompt_ids), 0)
            yield Delta(
                "",
                [],
                [],
                "length",
                None,
                Usage(usage.prompt_tokens, 0, usage.cached_tokens),
                chunk.timings,
                chunk.prompt_logprobs,
            )
            return
        ids = chunk.token_ids
        unchecked = min(max(job.sampling.min_new_tokens - num_tokens, 0), len(ids))  # no stop string before that
        num_tokens += len(ids)
        text = (
            detok.add(ids[:unchecked]) + stop.feed(detok.add(ids[unchecked:]))
            if unchecked
            else stop.feed(detok.add(ids))
        )
        done = chunk.finish_reason is not None
        if done:
            text += stop.feed(detok.flush()) + stop.flush()
        if stop.matched is not None:
            usage = chunk.usage or Usage(len(job.prompt_ids), num_tokens)
            yield Delta(
                text + stop.matched_text if job.keep_stop else text,
                list(chunk.token_ids),
                list(chunk.logprobs or ()),
                "stop",
                stop.matched,
                usage,
                chunk.timings,
                chunk.prompt_logprobs,
            )
            return
        yield Delta(
            text,
            list(chunk.token_ids),
            list(chunk.logprobs or ()),
            chunk.finish_reason,
            chunk.stop_reason,
            chunk.usage,
            chunk.timings,
            chunk.prompt_logprobs,
        )
        if done:
            return


async def sample_deltas(
    gateway: Gateway,
    info: ModelInfo,
    job: Job,
    rid: str,
    timeout: float,
    skip_special_tokens: bool = True,
) -> list[AsyncIterator[Delta]]:
    """One stream of deltas per sample of ``job`` (``n`` of them; with ``n > 1`` one request
    is published now for them all, its samples streaming under ``rid#i``)."""
    if job.sampling.n == 1:
        return [deltas(gateway, info, job, rid, timeout, skip_special_tokens)]
    streams = await gateway.generate_samples(job.prompt_ids, job.sampling, rid, timeout)
    return [_sample(chunks, info, job, skip_special_tokens) for chunks in streams]


async def _sample(
    chunks: AsyncIterator[TokenChunk], info: ModelInfo, job: Job, skip_special_tokens: bool
) -> AsyncIterator[Delta]:
    detok = IncrementalDetokenizer(info.tokenizer, skip_special_tokens)
    stop = StopMatcher(job.sampling.stop, job.sampling.stop_regex)
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for delta in _deltas(chunks, job, detok, stop):
            yield delta
            if delta.finish_reason is not None:
                return


async def collect(
    gateway: Gateway,
    info: ModelInfo,
    job: Job,
    rid: str,
    timeout: float,
    skip_special_tokens: bool = True,
) -> list[Result]:
    """Every sample of ``job``, whole (one result for ``n`` of 1)."""
    started = time.perf_counter()
    streams = await sample_deltas(gateway, info, job, rid, timeout, skip_special_tokens)
    rids = [rid] if len(streams) == 1 else [sample_rid(rid, i) for i in range(len(streams))]
    try:
        return list(await asyncio.gather(*(_collect(s, job, r, started) for s, r in zip(streams, rids, strict=True))))
    finally:
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]


async def _collect(stream: AsyncIterator[Delta], job: Job, rid: str, started: float) -> Result:
    result = Result(rid)
    parts: list[str] = []
    async for d in stream:
        if not result.token_ids:
            result.first_token_seconds = time.perf_counter() - started
        parts.append(d.text)
        result.token_ids.extend(d.token_ids)
        result.logprobs.extend(d.logprobs)
        result.prompt_logprobs = result.prompt_logprobs or d.prompt_logprobs
        if d.finish_reason is not None:
            result.finish_reason = d.finish_reason
            result.stop_reason = d.stop_reason
            result.usage = d.usage
            result.timings = d.timings
    result.text = "".join(parts)
    result.seconds = time.perf_counter() - started
    if result.usage is None:
        result.usage = Usage(len(job.prompt_ids), len(result.token_ids))
    return result


def total_usage(results: list[Result]) -> Usage:
    """Usage of one prompt's samples: its prompt (and cached part) once, every sample's output."""
    usages = [r.usage or Usage(0, len(r.token_ids)) for r in results]
    first = usages[0] if usages else Usage(0, 0)
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages), first.cached_tokens)
