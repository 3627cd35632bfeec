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

from pdserve.api import formats, reasoning, tools
from pdserve.api.completion import Delta, Result, collect, sample_deltas, total_usage
from pdserve.api.config import ApiConfig
from pdserve.api.errors import APIError
from pdserve.api.http import AppState, ORJSONResponse, read_body, state_of, translate, until_disconnect
from pdserve.api.protocol import Job, Limits, Parsed, parse_chat, parse_completion, parse_generate, parse_json
from pdserve.schemas import TokenLogprob, Usage
from pdserve.schemas.sampling import sample_rid

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(body: Any) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


# Bodies larger than this are parsed and tokenized in a thread, off the event loop.
INLINE_PARSE_BYTES = 64 << 10


def limits(config: ApiConfig, max_message_bytes: int | None = None) -> Limits:
    return Limits(
        config.default_max_tokens,
        config.max_prompt_tokens,
        config.max_output_tokens,
        config.max_batch_prompts,
        max_message_bytes,
    )


async def _parse(request: Request, parser: Callable[[dict[str, Any], Any, Limits], Parsed]) -> tuple[AppState, Parsed]:
    state = state_of(request)
    raw = await read_body(request, state.config.max_body_bytes)

    nc = state.gateway.nc
    bound = limits(state.config, nc.max_payload if nc is not None and nc.is_connected else None)

    def parse() -> Parsed:
        return parser(parse_json(raw), state.info, bound)

    return state, parse() if len(raw) <= INLINE_PARSE_BYTES else await asyncio.to_thread(parse)


def _job_rids(parsed: Parsed, rid: str) -> list[str]:
    """One request id per job: the client's (``/generate``), else ``rid`` numbered for a batch."""
    if isinstance(parsed.rid, list):
        return parsed.rid
    return [f"{rid}-{i}" for i in range(len(parsed.jobs))] if parsed.batch else [rid]


async def _collect_all(
    request: Request, state: AppState, parsed: Parsed, rid: str, skip_special: bool = True
) -> list[list[Result] | APIError]:
    """Every job's samples; a job that fails is its own error, the others go on. When
    every job fails the request fails with the first error."""
    cfg = state.config
    rids = _job_rids(parsed, rid)

    async def run() -> list[list[Result] | BaseException]:
        return await asyncio.gather(
            *(
                collect(state.gateway, state.info, job, rids[i], cfg.request_timeout, skip_special)
                for i, job in enumerate(parsed.jobs)
            ),
            return_exceptions=True,
        )

    try:
        results = await until_disconnect(request, run())
    except Exception as exc:
        raise translate(exc) from None
    out: list[list[Result] | APIError] = []
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


async def _merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The samples' deltas as they come, each with its sample index."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for d in stream:
                await queue.put((i, d))
            await queue.put((i, None))
        except BaseException as exc:  # handed to the reader, which raises it
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


async def _open_stream(
    request: Request, state: AppState, job: Job, rid: str, skip_special: bool = True
) -> tuple[tuple[int, Delta] | None, AsyncIterator[tuple[int, Delta]]]:
    """Publish ``job`` and wait for its first delta before answering 200, so queue-full and
    bad requests still get a proper status code."""
    cfg = state.config
    try:
        streams = await until_disconnect(
            request, sample_deltas(state.gateway, state.info, job, rid, cfg.request_timeout, skip_special)
        )
    except Exception as exc:
        raise translate(exc) from None
    merged = _merge(streams)
    try:
        first = await until_disconnect(request, merged.__anext__())
    except StopAsyncIteration:
        return None, merged
    except Exception as exc:
        await merged.aclose()  # type: ignore[attr-defined]
        raise translate(exc) from None
    return first, merged


async def _sse_body(
    first: tuple[int, Delta] | None,
    rest: AsyncIterator[tuple[int, Delta]],
    render: Callable[[int, Delta], list[Any]],
    end: Callable[[], list[Any]] = list,
) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            for event in render(*first):
                yield _sse(event)
        async for i, d in rest:
            for event in render(i, d):
                yield _sse(event)
        for event in end():
            yield _sse(event)
    except Exception as exc:
        yield _sse(translate(exc).body())
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    yield _DONE


async def events_body(
    first: tuple[int, Delta] | None,
    rest: AsyncIterator[tuple[int, Delta]],
    render: Callable[[int, Delta], list[bytes]],
    error: Callable[[APIError], bytes],
) -> AsyncIterator[bytes]:
    """A stream's deltas as ``render`` writes them (server-sent events already framed, as the
    Responses and Messages APIs name each), an error as ``error`` writes it; no ``[DONE]``."""
    try:
        if first is not None:
            for event in render(*first):
                yield event
        async for i, d in rest:
            for event in render(i, d):
                yield event
    except Exception as exc:
        yield error(translate(exc))
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


class _Usage:
    """A streamed job's usage: its prompt once, every sample's output, once all have finished."""

    def __init__(self, n: int, prompt_tokens: int = 0) -> None:
        self.open = n
        self.usages: list[Usage] = []
        self.prompt_tokens = prompt_tokens
        self.generated = 0  # every sample's tokens so far
        self.cached = 0  # the prompt's cached part, once a sample has told it

    def add(self, d: Delta) -> None:
        self.generated += len(d.token_ids)
        if d.usage is not None:
            self.cached = d.usage.cached_tokens
        if d.finish_reason is not None:
            self.open -= 1
            if d.usage is not None:
                self.usages.append(d.usage)

    def so_far(self) -> dict[str, Any] | None:
        """vLLM's ``continuous_usage_stats``: the prompt and every token sent up to this chunk."""
        return formats.usage_body(Usage(self.prompt_tokens, self.generated, self.cached))

    def total(self) -> Usage | None:
        if not self.usages:
            return None
        first = self.usages[0]
        return Usage(first.prompt_tokens, sum(u.completion_tokens for u in self.usages), first.cached_tokens)


def _stream_end(head: dict[str, Any], usage: _Usage, include_usage: bool) -> Callable[[], list[Any]]:
    """After every sample's last chunk: the usage chunk, if it was asked for."""

    def end() -> list[Any]:
        return [{**head, "choices": [], "usage": formats.usage_body(usage.total())}] if include_usage else []

    return end


def _names(state: AppState, parsed: Parsed) -> formats.Names:
    """How this request's logprobs name tokens: their text, or (vLLM's
    ``return_tokens_as_token_ids``) ``token_id:N``."""
    return formats.TOKEN_ID_NAMES if parsed.tokens_as_ids else state.info


def _prompt_text(state: AppState, job: Job) -> str:
    return job.prompt_text or state.info.tokenizer.decode(job.prompt_ids)


# ---- /v1/completions ------------------------------------------------------------
async def completions(request: Request) -> Response:
    state, parsed = await _parse(request, parse_completion)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    name = state.info.name
    head = {"id": rid, "object": "text_completion", "created": created, "model": name}
    if parsed.stream:
        job = parsed.jobs[0]
        first, rest = await _open_stream(request, state, job, rid, parsed.skip_special_tokens)
        usage = _Usage(job.sampling.n, len(job.prompt_ids))
        unsent = set(range(job.sampling.n))  # choices whose first piece is still to come

        def render(i: int, d: Delta) -> list[Any]:
            usage.add(d)
            first = i in unsent
            unsent.discard(i)
            choice = _completion_choice(
                state, parsed, job, i, d.text, d.token_ids, d.logprobs, parsed.echo and first, d
            )
            if parsed.token_ids:  # vLLM's return_token_ids: the prompt's on a choice's first piece
                choice["token_ids"] = list(d.token_ids)
                if first:
                    choice["prompt_token_ids"] = list(job.prompt_ids)
            chunk = {**head, "choices": [{**choice, "finish_reason": formats.openai_finish(d.finish_reason)}]}
            if parsed.continuous_usage:
                chunk["usage"] = usage.so_far()
            return [chunk]

        body = _sse_body(first, rest, render, _stream_end(head, usage, parsed.include_usage))
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    results = await _collect_all(request, state, parsed, rid, parsed.skip_special_tokens)
    choices = []
    n = parsed.jobs[0].sampling.n
    for i, (job, samples) in enumerate(zip(parsed.jobs, results, strict=True)):
        if isinstance(samples, APIError):  # this prompt failed; the others did not
            for k in range(n):
                choices.append(
                    {"index": i * n + k, "text": "", "logprobs": None, "finish_reason": "error", **samples.body()}
                )
            continue
        for k, r in enumerate(samples):
            choice = _completion_choice(state, parsed, job, i * n + k, r.text, r.token_ids, r.logprobs, parsed.echo, r)
            if parsed.token_ids:  # vLLM's return_token_ids
                choice |= {"token_ids": list(r.token_ids), "prompt_token_ids": list(job.prompt_ids)}
            choices.append({**choice, "finish_reason": formats.openai_finish(r.finish_reason)})
    return ORJSONResponse({**head, "choices": choices, "usage": _sum_usage(results)})


def _completion_choice(
    state: AppState,
    parsed: Parsed,
    job: Job,
    index: int,
    text: str,
    ids: list[int],
    lps: list[TokenLogprob],
    echo: bool,
    got: Delta | Result,
) -> dict[str, Any]:
    """A completion choice (or a streamed piece of one): the prompt first where it is echoed
    (``echo``: this is the choice's first piece), with its log-probabilities where asked."""
    info = _names(state, parsed)
    scores = got.prompt_logprobs
    prefix = _prompt_text(state, job) if echo else ""
    logprobs: dict[str, Any] | None
    if echo and parsed.echo_logprobs and scores is not None:
        logprobs = formats.echo_logprobs(info, job.prompt_ids, scores, ids, lps)
    else:
        logprobs = formats.completion_logprobs(info, ids, lps, len(prefix))
    choice: dict[str, Any] = {"index": index, "text": prefix + text, "logprobs": logprobs}
    if parsed.prompt_logprobs is not None and scores is not None:
        choice["prompt_logprobs"] = formats.vllm_prompt_logprobs(info, job.prompt_ids, scores)
    return choice


def _sum_usage(results: list[list[Result] | APIError]) -> dict[str, Any] | None:
    usages = [total_usage(r) for r in results if not isinstance(r, APIError)]
    total = Usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
    )
    return formats.usage_body(total)


# ---- /v1/chat/completions -------------------------------------------------------
class _SampleReader:
    """One chat sample's text, read as it streams: thinking split off where the model thinks
    (:class:`reasoning.ThinkReader`), then tool calls read out of the answer
    (:class:`tools.CallReader`)."""

    def __init__(self, parsed: Parsed) -> None:
        self.think = reasoning.ThinkReader(parsed.thinking) if parsed.thinking is not None else None
        self.calls = tools.CallReader(parsed.tools) if parsed.tools is not None else None

    def read(self, text: str, final: bool) -> tuple[str, list[tools.Events]]:
        thinking = ""
        if self.think is not None:
            thinking, text = self.think.feed(text)
            if final:
                more, rest = self.think.finish()
                thinking, text = thinking + more, text + rest
        if self.calls is None:
            return thinking, [tools.Events(content=text)]
        events = [self.calls.feed(text)]
        if final:
            events.append(self.calls.finish())
        return thinking, events


class _ChatStream:
    """Renders one chat stream's deltas: thinking as ``reasoning_content``, content held back
    while it may begin a tool call, calls sent whole, a forced function's arguments as they come."""

    def __init__(self, state: AppState, head: dict[str, Any], parsed: Parsed, usage: _Usage) -> None:
        self.state, self.head, self.usage, self.parsed = state, head, usage, parsed
        n = parsed.jobs[0].sampling.n
        self.unsent_role = set(range(n))
        self.readers = [_SampleReader(parsed) for _ in range(n)]
        self.plain = parsed.tools is None and parsed.thinking is None  # the text is the content as it comes
        self.sent_calls = [0] * n
        self.sent_prompt_ids = False

    def render(self, i: int, d: Delta) -> list[Any]:
        self.usage.add(d)
        delta: dict[str, Any] = {}
        echo = ""
        if i in self.unsent_role:
            delta["role"] = "assistant"
            self.unsent_role.discard(i)
            echo = self.parsed.echo_text or ""  # vLLM's echo: the last message's text leads
        reason = d.finish_reason
        if self.plain:
            if d.text:
                delta["content"] = d.text
        else:
            reason = self._read(i, d, delta)
        if echo:
            delta["content"] = echo + delta.get("content", "")
        choice = {
            "index": i,
            "delta": delta,
            "logprobs": formats.chat_logprobs(_names(self.state, self.parsed), d.token_ids, d.logprobs),
            "finish_reason": formats.openai_finish(reason),
        }
        if self.parsed.prompt_logprobs is not None and d.prompt_logprobs is not None:  # on the first chunk
            prompt = self.parsed.jobs[0].prompt_ids
            names = _names(self.state, self.parsed)
            choice["prompt_logprobs"] = formats.vllm_prompt_logprobs(names, prompt, d.prompt_logprobs)
        chunk = {**self.head, "choices": [choice]}
        if self.parsed.token_ids:  # vLLM's return_token_ids: the prompt's on the stream's first chunk
            choice["token_ids"] = list(d.token_ids)
            if not self.sent_prompt_ids:
                chunk["prompt_token_ids"] = list(self.parsed.jobs[0].prompt_ids)
                self.sent_prompt_ids = True
        if self.parsed.continuous_usage:
            chunk["usage"] = self.usage.so_far()
        return [chunk]

    def _read(self, i: int, d: Delta, delta: dict[str, Any]) -> str | None:
        reader = self.readers[i]
        final = d.finish_reason is not None
        thinking, events = reader.read(d.text, final)
        if thinking:
            delta["reasoning_content"] = thinking
        content = "".join(ev.content for ev in events)
        if content:
            delta["content"] = content
        if reader.calls is None:
            return d.finish_reason
        calls: list[dict[str, Any]] = []
        forced = reader.calls.forced_call
        arguments = "".join(ev.arguments for ev in events)
        if forced is not None and (arguments or (final and not self.sent_calls[i])):
            if self.sent_calls[i]:  # the call's later fragments: its arguments alone
                calls.append({"index": 0, "function": {"arguments": arguments}})
            else:
                calls.append({**forced.body(), "index": 0, "function": {"name": forced.name, "arguments": arguments}})
                self.sent_calls[i] = 1
        for ev in events:
            for call in ev.calls:
                calls.append({"index": self.sent_calls[i], **call.body()})
                self.sent_calls[i] += 1
        if calls:
            delta["tool_calls"] = calls
        self.state.gateway.metrics.tool_reply(
            sum(len(ev.calls) for ev in events) + (1 if forced is not None and final else 0),
            sum(ev.failures for ev in events),
        )
        return tools.finish_reason(d.finish_reason, self.sent_calls[i])


def _chat_choice(state: AppState, parsed: Parsed, k: int, r: Result) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": r.text}
    reason: str | None = r.finish_reason
    if parsed.thinking is not None:
        message["reasoning_content"], message["content"] = reasoning.split_whole(r.text, parsed.thinking)
    if parsed.tools is not None:
        reply = tools.read_whole(parsed.tools, message["content"])
        message["content"] = reply.content
        if reply.calls:
            message["tool_calls"] = [c.body() for c in reply.calls]
        state.gateway.metrics.tool_reply(len(reply.calls), reply.failures)
        reason = tools.finish_reason(reason, len(reply.calls))
    if parsed.echo_text:  # vLLM's echo
        message["content"] = parsed.echo_text + (message["content"] or "")
    choice = {
        "index": k,
        "message": message,
        "logprobs": formats.chat_logprobs(_names(state, parsed), r.token_ids, r.logprobs),
        "finish_reason": formats.openai_finish(reason),
    }
    if parsed.prompt_logprobs is not None and r.prompt_logprobs is not None:
        choice["prompt_logprobs"] = formats.vllm_prompt_logprobs(
            _names(state, parsed), parsed.jobs[0].prompt_ids, r.prompt_logprobs
        )
    if parsed.token_ids:  # vLLM's return_token_ids
        choice["token_ids"] = list(r.token_ids)
    return choice


async def chat_completions(request: Request) -> Response:
    state, parsed = await _parse(request, parse_chat)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    name = state.info.name
    job = parsed.jobs[0]
    if parsed.stream:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}
        first, rest = await _open_stream(request, state, job, rid, parsed.skip_special_tokens)
        usage = _Usage(job.sampling.n, len(job.prompt_ids))
        chat = _ChatStream(state, head, parsed, usage)
        body = _sse_body(first, rest, chat.render, _stream_end(head, usage, parsed.include_usage))
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    (samples,) = await _collect_all(request, state, parsed, rid, parsed.skip_special_tokens)
    assert not isinstance(samples, APIError)  # a single job's failure is raised
    return ORJSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": [_chat_choice(state, parsed, k, r) for k, r in enumerate(samples)],
            "usage": formats.usage_body(total_usage(samples)),
            **({"prompt_token_ids": list(job.prompt_ids)} if parsed.token_ids else {}),
        }
    )


# ---- /generate (SGLang) ---------------------------------------------------------
async def generate(request: Request) -> Response:
    state, parsed = await _parse(request, parse_generate)
    rid = parsed.rid if isinstance(parsed.rid, str) else uuid.uuid4().hex
    if parsed.stream:
        job = parsed.jobs[0]
        n = job.sampling.n
        started = time.perf_counter()
        first, rest = await _open_stream(request, state, job, rid, parsed.skip_special_tokens)
        text: list[list[str]] = [[] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]

        def render(i: int, d: Delta) -> list[Any]:
            text[i].append(d.text)
            ids[i].extend(d.token_ids)
            usage = d.usage
            done = d.finish_reason is not None
            meta = formats.sglang_meta(
                rid if n == 1 else sample_rid(rid, i),
                d,
                len(job.prompt_ids),
                len(ids[i]),
                usage.cached_tokens if usage else 0,
                time.perf_counter() - started if done else None,
            )
            words = state.info if parsed.text_in_logprobs else None
            formats.sglang_logprobs(meta, d.token_ids, d.logprobs, words)
            if parsed.input_logprobs_from >= 0 and d.prompt_logprobs is not None:
                formats.sglang_input_logprobs(
                    meta, job.prompt_ids, d.prompt_logprobs, parsed.input_logprobs_from, words
                )
            body = {"text": "".join(text[i]), "output_ids": list(ids[i]), "meta_info": meta}
            return [body if n == 1 else {"index": i, **body}]

        return StreamingResponse(_sse_body(first, rest, render), media_type="text/event-stream", headers=SSE_HEADERS)
    results = await _collect_all(request, state, parsed, rid, parsed.skip_special_tokens)
    bodies = []
    for i, (job, samples) in enumerate(zip(parsed.jobs, results, strict=True)):
        if isinstance(samples, APIError):  # this prompt failed; the others did not
            meta = {
                "id": _job_rids(parsed, rid)[i],
                "prompt_tokens": len(job.prompt_ids),
                "completion_tokens": 0,
                "finish_reason": {"type": "abort", "message": samples.message},
            }
            bodies += [{"text": "", "output_ids": [], "meta_info": meta, **samples.body()}] * job.sampling.n
            continue
        for r in samples:
            usage = r.usage
            meta = formats.sglang_meta(
                r.rid, r, len(job.prompt_ids), len(r.token_ids), usage.cached_tokens if usage else 0, r.seconds
            )
            words = state.info if parsed.text_in_logprobs else None
            formats.sglang_logprobs(meta, r.token_ids, r.logprobs, words)
            if parsed.input_logprobs_from >= 0 and r.prompt_logprobs is not None:
                formats.sglang_input_logprobs(
                    meta, job.prompt_ids, r.prompt_logprobs, parsed.input_logprobs_from, words
                )
            bodies.append({"text": r.text, "output_ids": r.token_ids, "meta_info": meta})
    return ORJSONResponse(bodies if parsed.batch or len(bodies) > 1 else bodies[0])


def generation_routes() -> list[Route]:
    """The generation routes of this module (``/v1/responses`` and ``/v1/messages``, which
    build on it, are their modules' own)."""
    return [
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
