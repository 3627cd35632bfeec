"""The endpoints around generation that clients call: ``/tokenize`` and ``/detokenize``
(vLLM's shapes), ``/version``, SGLang's ``/get_server_info``, ``/health_generate`` and
``/abort_request``, and the benchmark-only ``/flush_cache`` (off unless
``--enable-flush-cache``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdserve.api import access, tools
from pdserve.api.errors import APIError, bad_request
from pdserve.api.gateway import StreamError
from pdserve.api.http import ORJSONResponse, read_body, state_of
from pdserve.api.model_info import ModelInfo
from pdserve.api.protocol import (
    _bool,
    _token_ids,
    chat_messages,
    check_model,
    parse_json,
    prompt_mode,
    render_chat,
    template_kwargs,
)
from pdserve.broker.connection import QueueFullError
from pdserve.schemas import FlushCacheReply, SamplingParams


def pdserve_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "0+unknown"


async def _body(request: Request) -> dict[str, Any]:
    state = state_of(request)
    body = parse_json(await read_body(request, state.config.max_body_bytes))
    check_model(body, state.info)
    return body


def _pieces(info: ModelInfo, ids: list[int]) -> list[str]:
    return [str(t) for t in info.tokenizer.convert_ids_to_tokens(ids)]


async def tokenize(request: Request) -> Response:
    """``{"prompt": text}`` or ``{"messages": [...]}`` (through the chat template) to token
    ids: ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    body = await _body(request)
    info = state_of(request).info
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    flags = {"add_special_tokens": _bool(body, "add_special_tokens", True)}
    strs = _bool(body, "return_token_strs", False)
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt")
        special = flags["add_special_tokens"]
    else:
        if not info.has_chat_template:
            raise bad_request("this model has no chat template", "messages")
        messages = chat_messages(body)
        generation, carry_on = prompt_mode(body, messages)
        shown = tools.parse_tools(body, info.tool_format)
        listed = shown if shown and shown.shown else None
        prompt = render_chat(info, messages, listed, generation, template_kwargs(body), carry_on)
        special = _bool(body, "add_special_tokens", False)
    if info.max_prompt_chars and len(prompt) > info.max_prompt_chars:
        raise bad_request(f"the text has {len(prompt)} characters, more than any prompt can", "prompt")
    ids = list(info.tokenizer.encode(prompt, add_special_tokens=special))
    pieces = _pieces(info, ids) if strs else None
    return ORJSONResponse(
        {"count": len(ids), "max_model_len": info.context_length, "tokens": ids, "token_strs": pieces}
    )


async def detokenize(request: Request) -> Response:
    """``{"tokens": [ids]}`` to ``{"prompt": text}``."""
    body = await _body(request)
    info = state_of(request).info
    if "tokens" not in body:
        raise bad_request("'tokens' is required", "tokens")
    ids = _token_ids(body["tokens"], "tokens", len(info.tokenizer))
    skip = _bool(body, "skip_special_tokens", False)
    return ORJSONResponse({"prompt": info.tokenizer.decode(ids, skip_special_tokens=skip)})


async def server_version(request: Request) -> Response:
    return ORJSONResponse({"version": pdserve_version()})


async def server_info(request: Request) -> Response:
    """SGLang's ``/get_server_info``: what this server runs and its limits."""
    state = state_of(request)
    cfg, info = state.config, state.info
    workers = await state.gateway.workers()
    return ORJSONResponse(
        {
            "version": pdserve_version(),
            "model_path": str(info.path),
            "tokenizer_path": str(info.path),
            "served_model_name": info.name,
            "context_length": info.context_length,
            "max_total_num_tokens": sum(w.pages_total * w.page_size for w in workers if w.role != "prefill"),
            "default_max_tokens": cfg.default_max_tokens,
            "max_prompt_tokens": cfg.max_prompt_tokens,
            "max_output_tokens": cfg.max_output_tokens,
            "max_batch_prompts": cfg.max_batch_prompts,
            "api_id": state.gateway.api_id,
            "enable_flush_cache": cfg.enable_flush_cache,
            "disaggregation_mode": "unified" if any(w.role == "unified" for w in workers) else "pd",
            "workers": {role: sum(1 for w in workers if w.role == role) for role in ("prefill", "decode", "unified")},
        }
    )


async def flush_cache(request: Request) -> Response:
    """Every worker forgets its cached prefixes (for benchmarks that need a cold cache).
    200 when every registered worker did; 503 naming those that did not answer."""
    state = state_of(request)
    if not state.config.enable_flush_cache:
        raise APIError("/flush_cache is off: start the API with --enable-flush-cache", 403, "permission_error")
    answers = await state.gateway.flush_cache()
    done = [a for a in answers if isinstance(a, FlushCacheReply)]
    failed = [a for a in answers if isinstance(a, str)]
    body = {
        "flushed": not failed,
        "workers": [{"id": a.worker_id, "pages_freed": a.pages_freed, "running": a.running} for a in done],
        "errors": failed,
    }
    return ORJSONResponse(body, status_code=200 if not failed else 503)


# /health_generate's one-token request: answered within this many seconds, or 503 (SGLang's 20)
HEALTH_GENERATE_SECONDS = 20.0
HEALTH_SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.0)


async def health_generate(request: Request) -> Response:
    """SGLang's ``/health_generate``: one token generated through the whole pipeline (the
    broker, a prefill and a decode worker or a unified one) within
    :data:`HEALTH_GENERATE_SECONDS`: 200 with its seconds, else 503 saying why (no worker
    took it in time, a worker failed it, the queue is full)."""
    state = state_of(request)
    ids = state.info.tokenizer.encode("ping", add_special_tokens=False)[:1] or [0]
    rid = f"health-{uuid.uuid4().hex}"
    began = time.perf_counter()
    try:
        async with asyncio.timeout(HEALTH_GENERATE_SECONDS):
            chunks = state.gateway.generate(ids, HEALTH_SAMPLING, rid, HEALTH_GENERATE_SECONDS)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk.finish_reason is not None:
                        break
    except TimeoutError:
        return _unhealthy(f"no token within {HEALTH_GENERATE_SECONDS:.0f}s")
    except (StreamError, QueueFullError) as exc:
        return _unhealthy(str(exc))
    return ORJSONResponse({"status": "ok", "seconds": round(time.perf_counter() - began, 4)})


def _unhealthy(why: str) -> Response:
    return ORJSONResponse({"status": "unavailable", "error": why}, status_code=503)


async def abort_request(request: Request) -> Response:
    """SGLang's ``/abort_request``: ``{"rid": id}`` ends that request's streams (its samples'
    too), ``{"abort_all": true}`` every request, of those the caller's API key published
    (without keys, anyone's): each ends with finish reason ``abort`` (SGLang's), and its
    workers cancel it. Answers the ids it ended (none is no error: the request may be done)."""
    state = state_of(request)
    body = parse_json(await read_body(request, state.config.max_body_bytes))
    if "abort_all" in body and body["abort_all"] is not True:
        raise bad_request("'abort_all' may only be true (or left out)", "abort_all")
    every = "abort_all" in body
    rid = body.get("rid")
    if every == ("rid" in body) or ("rid" in body and not (isinstance(rid, str) and rid)):
        raise bad_request("give either 'rid' (a request id) or 'abort_all': true", "rid")
    ended = await state.gateway.abort(None if every else rid, access.CALLER.get())
    return ORJSONResponse({"aborted": ended})


def routes() -> list[Route]:
    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", server_version, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
    ]
