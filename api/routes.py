"""``/generate``, ``/v1/completions`` and ``/v1/chat/completions``, streaming or not."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from pdserve.api import formats
from pdserve.api.completion import Delta, Result, collect, deltas
from pdserve.api.config import ApiConfig
from pdserve.api.errors import APIError
from pdserve.api.http import AppState, ORJSONResponse, read_body, state_of, translate, until_disconnect
from pdserve.api.protocol import Job, Limits, Parsed, parse_chat, parse_completion, parse_generate, parse_json

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(body: Any) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


# Bodies larger than this are parsed and tokenized in a thread, off the event loop.
INLINE_PARSE_BYTES = 64 << 10


def limits(config: ApiConfig) -> Limits:
    return Limits(
        config.default_max_tokens, config.max_prompt_tokens, config.max_output_tokens, config.max_batch_prompts
    )


async def _parse(request: Request, parser: Callable[[dict[str, Any], Any, Limits], Parsed]) -> tuple[AppState, Parsed]:
    state = state_of(request)
    raw = await read_body(request, state.config.max_body_bytes)

    def parse() -> Parsed:
        return parser(parse_json(raw), state.info, limits(state.config))

    return state, parse() if len(raw) <= INLINE_PARSE_BYTES else await asyncio.to_thread(parse)


def _job_rids(parsed: Parsed, rid: str) -> list[str]:
    """One request id per job: the client's (``/generate``), else ``rid`` numbered for a batch."""
    if isinstance(parsed.rid, list):
        return parsed.rid
    return [f"{rid}-{i}" for i in range(len(parsed.jobs))] if parsed.batch else [rid]


async def _collect_all(
    request: Request, state: AppState, parsed: Parsed, rid: str, skip_special: bool = True
) -> list[Result | APIError]:
    """Every job's result; a job that fails is its own error, the others go on. When
    every job fails the request fails with the first error."""
    cfg = state.config
    rids = _job_rids(parsed, rid)

    async def run() -> list[Result | BaseException]:
        return await asyncio.gather(
            *(
                collect(
                    state.gateway,
                    state.info,
                    job,
                    rids[i],
                    cfg.request_timeout,
                    skip_special,
                )
                for i, job in enumerate(parsed.jobs)
            ),
            return_exceptions=True,
        )

    try:
        results = await until_disconnect(request, run())
    except Exception as exc:
        raise translate(exc) from None
    out: list[Result | APIError] = []
    for r in results:
        if isinstance(r, Exception):
            out.append(translate(r))
        elif isinstance(r, BaseException):
            raise r
        else:
            out.append(r)
    if all(isinstance(r, APIError) for r in out):
        raise out[0]  # type: ignore[misc]
    return out


async def _first_and_rest(request: Request, stream: AsyncIterator[Delta]) -> tuple[Delta | None, AsyncIterator[Delta]]:
    """Wait for the first delta before answering 200, so queue-full and bad
    requests still get a proper status code."""
    try:
        first = await until_disconnect(request, stream.__anext__())
    except StopAsyncIteration:
        return None, stream
    except Exception as exc:
        raise translate(exc) from None
    return first, stream


def _stream_deltas(state: AppState, job: Job, rid: str, skip_special: bool = True) -> AsyncIterator[Delta]:
    cfg = state.config
    return deltas(state.gateway, state.info, job, rid, cfg.request_timeout, skip_special)


async def _sse_body(
    first: Delta | None, rest: AsyncIterator[Delta], render: Callable[[Delta], list[Any]]
) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            for event in render(first):
                yield _sse(event)
        async for d in rest:
            for event in render(d):
                yield _sse(event)
    except Exception as exc:
        yield _sse(translate(exc).body())
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    yield _DONE


def _stream_events(head: dict[str, Any], choice: dict[str, Any], d: Delta, include_usage: bool) -> list[Any]:
    """One OpenAI stream chunk, and after the last one the usage chunk if it was asked for."""
    events: list[Any] = [{**head, "choices": [choice]}]
    if d.finish_reason is not None and include_usage:
        events.append({**head, "choices": [], "usage": formats.usage_body(d.usage)})
    return events


def _prompt_text(state: AppState, job: Job) -> str:
    return job.prompt_text or state.info.tokenizer.decode(job.prompt_ids)


# ---- /v1/completions ------------------------------------------------------------
async def completions(request: Request) -> Response:
    state, parsed = await _parse(request, parse_completion)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    name = state.info.name
    if parsed.stream:
        job = parsed.jobs[0]
        first, rest = await _first_and_rest(request, _stream_deltas(state, job, rid))
        prefix = [_prompt_text(state, job)] if parsed.echo else []

        def render(d: Delta) -> list[Any]:
            text = (prefix.pop() if prefix else "") + d.text
            choice = {
                "index": 0,
                "text": text,
                "logprobs": formats.completion_logprobs(state.info, d.token_ids, d.logprobs),
                "finish_reason": formats.openai_finish(d.finish_reason),
            }
            head = {"id": rid, "object": "text_completion", "created": created, "model": name}
            return _stream_events(head, choice, d, parsed.include_usage)

        return StreamingResponse(_sse_body(first, rest, render), media_type="text/event-stream", headers=SSE_HEADERS)
    results = await _collect_all(request, state, parsed, rid)
    choices = []
    for i, (job, r) in enumerate(zip(parsed.jobs, results, strict=True)):
        if isinstance(r, APIError):  # this prompt failed; the others did not
            choices.append({"index": i, "text": "", "logprobs": None, "finish_reason": "error", **r.body()})
            continue
        text = (_prompt_text(state, job) if parsed.echo else "") + r.text
        choices.append(
            {
                "index": i,
                "text": text,
                "logprobs": formats.completion_logprobs(state.info, r.token_ids, r.logprobs),
                "finish_reason": formats.openai_finish(r.finish_reason),
            }
        )
    return ORJSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": _sum_usage(results),
        }
    )


def _sum_usage(results: list[Result | APIError]) -> dict[str, Any] | None:
    from pdserve.schemas import Usage

    usages = [r.usage for r in results if isinstance(r, Result) and r.usage is not None]
    total = Usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
    )
    return formats.usage_body(total)


# ---- /v1/chat/completions -------------------------------------------------------
async def chat_completions(request: Request) -> Response:
    state, parsed = await _parse(request, parse_chat)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    name = state.info.name
    job = parsed.jobs[0]
    if parsed.stream:
        first, rest = await _first_and_rest(request, _stream_deltas(state, job, rid))
        sent_role = [False]

        def render(d: Delta) -> list[Any]:
            delta: dict[str, Any] = {}
            if not sent_role[0]:
                delta["role"] = "assistant"
                sent_role[0] = True
            if d.text:
                delta["content"] = d.text
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": formats.chat_logprobs(state.info, d.token_ids, d.logprobs),
                "finish_reason": formats.openai_finish(d.finish_reason),
            }
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}
            return _stream_events(head, choice, d, parsed.include_usage)

        return StreamingResponse(_sse_body(first, rest, render), media_type="text/event-stream", headers=SSE_HEADERS)
    (r,) = await _collect_all(request, state, parsed, rid)
    assert isinstance(r, Result)  # a single job's failure is raised
    return ORJSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": r.text},
                    "logprobs": formats.chat_logprobs(state.info, r.token_ids, r.logprobs),
                    "finish_reason": formats.openai_finish(r.finish_reason),
                }
            ],
            "usage": formats.usage_body(r.usage),
        }
    )


# ---- /generate (SGLang) ---------------------------------------------------------
async def generate(request: Request) -> Response:
    state, parsed = await _parse(request, parse_generate)
    rid = parsed.rid if isinstance(parsed.rid, str) else uuid.uuid4().hex
    if parsed.stream:
        job = parsed.jobs[0]
        started = time.perf_counter()
        first, rest = await _first_and_rest(request, _stream_deltas(state, job, rid, parsed.skip_special_tokens))
        text: list[str] = []
        ids: list[int] = []

        def render(d: Delta) -> list[Any]:
            text.append(d.text)
            ids.extend(d.token_ids)
            usage = d.usage
            done = d.finish_reason is not None
            meta = formats.sglang_meta(
                rid,
                d,
                len(job.prompt_ids),
                len(ids),
                usage.cached_tokens if usage else 0,
                time.perf_counter() - started if done else None,
            )
            formats.sglang_logprobs(meta, d.token_ids, d.logprobs)
            return [{"text": "".join(text), "output_ids": list(ids), "meta_info": meta}]

        return StreamingResponse(_sse_body(first, rest, render), media_type="text/event-stream", headers=SSE_HEADERS)
    results = await _collect_all(request, state, parsed, rid, parsed.skip_special_tokens)
    bodies = []
    for i, (job, r) in enumerate(zip(parsed.jobs, results, strict=True)):
        if isinstance(r, APIError):  # this prompt failed; the others did not
            meta = {
                "id": _job_rids(parsed, rid)[i],
                "prompt_tokens": len(job.prompt_ids),
                "completion_tokens": 0,
                "finish_reason": {"type": "abort", "message": r.message},
            }
            bodies.append({"text": "", "output_ids": [], "meta_info": meta, **r.body()})
            continue
        usage = r.usage
        meta = formats.sglang_meta(
            r.rid, r, len(job.prompt_ids), len(r.token_ids), usage.cached_tokens if usage else 0, r.seconds
        )
        formats.sglang_logprobs(meta, r.token_ids, r.logprobs)
        bodies.append({"text": r.text, "output_ids": r.token_ids, "meta_info": meta})
    return ORJSONResponse(bodies if parsed.batch else bodies[0])


def generation_routes() -> list[Route]:
    return [
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
