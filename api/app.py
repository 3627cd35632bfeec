"""The Starlette application: the lifespan, the routes, and the endpoints that are not generation."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdserve.api.config import ApiConfig
from pdserve.api.errors import APIError, error_response
from pdserve.api.gateway import Gateway
from pdserve.api.http import AppState, ORJSONResponse, state_of
from pdserve.api.model_info import ModelInfo, load_model_info
from pdserve.api.routes import generation_routes

log = logging.getLogger(__name__)


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


async def models(request: Request) -> Response:
    info = state_of(request).info
    return ORJSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": info.name,
                    "object": "model",
                    "created": info.created,
                    "owned_by": "pdserve",
                    "root": str(info.path),
                    "parent": None,
                    "max_model_len": info.context_length,
                }
            ],
        }
    )


async def model_info(request: Request) -> Response:
    info = state_of(request).info
    return ORJSONResponse(
        {
            "model_path": str(info.path),
            "tokenizer_path": str(info.path),
            "is_generation": True,
            "served_model_name": info.name,
        }
    )


async def workers(request: Request) -> Response:
    gateway = state_of(request).gateway
    listing = await gateway.workers()
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
                "transfer_endpoint": w.transfer_endpoint,
                "transfer_backend": w.transfer_backend,
                "transfer_protocol": w.transfer_protocol,
                "kv_layout": dataclasses.asdict(w.kv_layout) if w.kv_layout else None,
                "counters": dataclasses.asdict(w.counters),
                "age_seconds": round(time.time() - w.started_at, 1),
                "last_seen_seconds": round(time.time() - w.updated_at, 1),
            }
            for w in listing
        ]
    )


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(exc.detail or "error", exc.status_code, kind))


def create_app(config: ApiConfig, info: ModelInfo | None = None) -> Starlette:
    """The app; the model's tokenizer loads and NATS connects in the lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        model = info or load_model_info(
            config.model_path, config.model_name, config.trust_remote_code, config.context_length
        )
        gateway = Gateway(
            config.nats_url,
            model.name,
            config.broker,
            config.api_id,
            stall_timeout=config.stall_timeout,
            gap_timeout=config.gap_timeout,
            max_migrations=config.max_migrations,
        )
        await gateway.start()
        app.state.pd = AppState(config, model, gateway, time.time())
        log.info("api ready", extra={"model": model.name, "api_id": gateway.api_id})
        try:
            yield
        finally:
            await gateway.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/workers", workers, methods=["GET"]),
        *generation_routes(),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error},
    )
