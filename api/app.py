"""The Starlette application: the lifespan, the routes, and the endpoints that are not generation."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from pdserve.api import messages, responses
from pdserve.api.access import AccessMiddleware, is_trusted
from pdserve.api.config import ApiConfig
from pdserve.api.errors import APIError, error_response
from pdserve.api.gateway import Gateway
from pdserve.api.http import AppState, ORJSONResponse, state_of
from pdserve.api.model_info import ModelInfo, load_model_info
from pdserve.api.openapi import describe
from pdserve.api.routes import generation_routes
from pdserve.api.tokens import routes as token_routes
from pdserve.api.tracing import TraceMiddleware

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# The dashboard's throughput chart: one bar per this many seconds of the window.
DASHBOARD_STEP_SECONDS = 5.0


async def health(request: Request) -> Response:
    """200 while the API can serve (a prefill and a decode worker, or a unified one), else
    503; ``requests`` holds this API's totals (migrations, duplicate and stale chunks, dead letters)."""
    gateway = state_of(request).gateway
    workers = await gateway.workers()
    roles = {role: sum(1 for w in workers if w.role == role) for role in ("prefill", "decode", "unified")}
    ready = (roles["prefill"] >= 1 and roles["decode"] >= 1) or roles["unified"] >= 1
    body = {
        "status": "ok" if ready else "unavailable",
        "workers": roles,
        "api_id": gateway.api_id,
        "requests": dataclasses.asdict(gateway.stats),
    }
    return ORJSONResponse(body, status_code=200 if ready else 503)


def _model_card(info: ModelInfo, name: str) -> dict[str, object]:
    return {
        "id": name,
        "object": "model",
        "created": info.created,
        "owned_by": "pdserve",
        "root": str(info.path),
        "parent": None,
        "max_model_len": info.context_length,
    }


async def models(request: Request) -> Response:
    info = state_of(request).info
    return ORJSONResponse({"object": "list", "data": [_model_card(info, name) for name in info.names]})


async def model_by_id(request: Request) -> Response:
    """OpenAI's ``GET /v1/models/{model}`` (the SDK's ``models.retrieve``): the card of the served
    model or of an alias, else 404 ``model_not_found`` (an id may hold a ``/``: a hub id)."""
    info = state_of(request).info
    model = request.path_params["model"]
    if model not in info.names:
        raise APIError(info.not_found(model), 404, "invalid_request_error", "model_not_found", "model")
    return ORJSONResponse(_model_card(info, model))


async def model_info(request: Request) -> Response:
    info = state_of(request).info
    return ORJSONResponse(
        {
            "model_path": str(info.path),
            "tokenizer_path": str(info.path),
            "is_generation": True,
            "served_model_name": info.name,
            "context_length": info.context_length,
            "generation_config": state_of(request).config.generation_config,
            # what a request that does not set them samples with (the model's generation config)
            "preferred_sampling_params": info.sampling_defaults,
            # how tool calls are read (None: tool_choice auto is refused) and why
            "tool_call_parser": info.tool_format.name,
            "tool_call_parser_reason": info.tool_format.why,
            "chat_template_takes_tools": info.tool_format.native,
            # whether chat replies' thinking goes to reasoning_content, and why
            "reasoning_parser": "think" if info.reasoning.on else None,
            "reasoning_parser_reason": info.reasoning.why,
        }
    )


async def workers(request: Request) -> Response:
    """The registry. Transfer endpoints (a window into each worker's KV memory, see
    docs/security.md) only for a caller with an API key, or on this machine when no key
    is configured; anyone else sees ``null``."""
    gateway = state_of(request).gateway
    listing = await gateway.workers()
    trusted = is_trusted(request.scope)
    return ORJSONResponse(
        [
            {
                "id": w.worker_id,
                "role": w.role,
                "model": w.model,
                "host": w.host,
                "pid": w.pid,
                "capacity": w.capacity,
                "pages_total": w.pages_total,
                "pages_used": w.pages_used,
                "page_size": w.page_size,
                "requests_in_flight": w.requests_in_flight,
                "transfer_endpoint": w.transfer_endpoint if trusted else None,
                "transfer_backend": w.transfer_backend,
                "transfer_protocol": w.transfer_protocol,
                "kv_layout": dataclasses.asdict(w.kv_layout) if w.kv_layout else None,
                "tp_size": w.tp_size,
                "counters": dataclasses.asdict(w.counters),
                "stats": dataclasses.asdict(w.stats),
                "age_seconds": round(time.time() - w.started_at, 1),
                "last_seen_seconds": round(time.time() - w.updated_at, 1),
            }
            for w in listing
        ]
    )


async def metrics(request: Request) -> Response:
    """Prometheus text format: this API's metrics and every live worker's (from the registry)."""
    gateway = state_of(request).gateway
    await gateway.refresh_view()
    return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def dashboard(request: Request) -> Response:
    return FileResponse(STATIC / "dashboard.html", media_type="text/html")


async def dashboard_data(request: Request) -> Response:
    """What ``/dashboard`` draws: workers by role, queues, throughput and latency
    percentiles over the API's window (the last few minutes)."""
    state = state_of(request)
    gateway = state.gateway
    await gateway.refresh_view()
    m = gateway.metrics
    now = time.monotonic()
    in_flight, tokens_waiting = gateway.in_flight()
    body = {
        "model": state.info.name,
        "api_id": gateway.api_id,
        "uptime_seconds": round(time.time() - state.started_at, 1),
        "window_seconds": m.window.seconds,
        "step_seconds": DASHBOARD_STEP_SECONDS,
        "requests": {
            "in_flight": in_flight,
            "prefill_tokens_waiting": tokens_waiting,
            "totals": dataclasses.asdict(gateway.stats),
            "finished": dict(m.finished_by_outcome),
        },
        "workers": [
            {
                "id": w.worker_id,
                "role": w.role,
                "pages_total": w.pages_total,
                "pages_used": w.pages_used,
                "requests_in_flight": w.requests_in_flight,
                "capacity": w.capacity,
                "waiting": w.stats.waiting,
                "running": w.stats.running,
                "generated_tokens": w.stats.generated_tokens,
                "cached_tokens": w.stats.cached_tokens,
                "prompt_tokens": w.stats.prompt_tokens,
                "kv_pull_bytes": w.counters.kv_pull_bytes,
                "last_seen_seconds": round(time.time() - w.updated_at, 1),
            }
            for w in m.view.workers
        ],
        "queues": [dataclasses.asdict(q) for q in m.view.queues],
        "throughput": {
            "output_tokens_per_second_10s": round(m.window.rate("tokens", now, 10.0), 1),
            "output_tokens_per_second_60s": round(m.window.rate("tokens", now, 60.0), 1),
            "series": m.window.series("tokens", now, DASHBOARD_STEP_SECONDS),
        },
        "latency_ms": {kind: m.window.percentiles(kind, now, 1000.0) for kind in ("ttft", "itl", "e2e")},
    }
    return ORJSONResponse(body)


async def openapi(request: Request) -> Response:
    """This API's OpenAPI description, with this server's limits and model."""
    state = state_of(request)
    return ORJSONResponse(describe(state.config, state.info))


def warn_if_open(config: ApiConfig) -> None:
    """One line when anyone on the network may use the API: every interface, no key."""
    if config.api_keys or config.host not in WILDCARD_HOSTS:
        return
    log.warning(
        f"the API listens on every interface ({config.host}:{config.port}) with no API key: anyone who reaches "
        "this port may use it; set --api-key-file (or PDSERVE_API_KEYS), or --host 127.0.0.1"
    )


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    headers = dict(exc.headers) if exc.headers else None  # 405 keeps its Allow
    return error_response(APIError(exc.detail or "error", exc.status_code, kind, headers=headers))


def create_app(config: ApiConfig, info: ModelInfo | None = None, collectors: Sequence[Collector] = ()) -> Starlette:
    """The app; the model's tokenizer loads and NATS connects in the lifespan. ``collectors``
    join ``/metrics`` (``pdserve up --autoscale`` adds its autoscaler's)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        model = info or load_model_info(
            config.model_path,
            config.model_name,
            config.trust_remote_code,
            config.context_length,
            config.generation_config,
            config.tool_call_parser,
            config.reasoning_parser,
            config.model_aliases,
        )
        gateway = Gateway(
            config.nats_url,
            model.name,
            config.broker,
            config.api_id,
            stall_timeout=config.stall_timeout,
            gap_timeout=config.gap_timeout,
            max_migrations=config.max_migrations,
            nats_auth=config.nats_auth,
            placement=config.placement,
        )
        await gateway.start()
        for collector in collectors:
            gateway.metrics.registry.register(collector)
        app.state.pd = AppState(config, model, gateway, time.time())
        tool = model.tool_format
        log.info(
            "api ready",
            extra={
                "model": model.name,
                "api_id": gateway.api_id,
                "api_keys": len(config.api_keys),
                "tool_calls": tool.name or "none",
                "tool_calls_why": tool.why,
                "reasoning": model.reasoning.on,
                "reasoning_why": model.reasoning.why,
            },
        )
        if model.sampling_defaults:
            log.info(
                "sampling defaults from the model's generation config (a request's own values win)",
                extra=model.sampling_defaults,
            )
        warn_if_open(config)
        try:
            yield
        finally:
            await gateway.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_by_id, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/workers", workers, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/dashboard/data", dashboard_data, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *generation_routes(),
        Route("/v1/responses", responses.responses, methods=["POST"]),
        Route("/v1/messages", messages.messages, methods=["POST"]),
        *token_routes(),
    ]
    access = Middleware(AccessMiddleware, keys=config.api_keys, max_concurrent=config.max_concurrent_requests)
    return Starlette(
        routes=routes,
        middleware=[access, Middleware(TraceMiddleware)],
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error},
    )
