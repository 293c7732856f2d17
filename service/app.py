"""The FastAPI app: routes, error handling, and the objects that live as long as the server.

`create_app(llm, config)` wires the endpoints to one `VideoLLM`. At startup its engine goes to
a background `AsyncEngine`, one `Worker` takes the vision pipeline and another tokenizes
prompts; at shutdown in-flight requests get `shutdown_timeout_s` to finish, then are aborted.
Every error leaves as the one JSON shape of `errors`, with the request's id; a client that
hung up is logged once, as 499.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from stillcut.service.api import VideoLLM
from stillcut.service.async_engine import EngineStats
from stillcut.service.chat_route import chat_endpoint, models_endpoint
from stillcut.service.config import ServerConfig
from stillcut.service.describe_route import describe_endpoint
from stillcut.service.errors import APIError, ClientGone, api_error
from stillcut.service.metrics import CONTENT_TYPE, ServiceMetrics
from stillcut.service.middleware import RequestContextMiddleware
from stillcut.service.page_routes import add_page_routes
from stillcut.service.state import ServiceState, record_of
from stillcut.service.stream_route import stream_endpoint
from stillcut.service.worker import Worker

_HTTP_ERRORS = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "bad_method")}


def create_app(llm: VideoLLM, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The service for `llm`; run it with uvicorn (see `stillcut.service.server`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = llm.start_async(max_queue=config.max_queue)
        encoder = Worker("encode", max_pending=config.max_queue)
        prompter = Worker("prompt", max_pending=config.max_queue)
        timeout = httpx.Timeout(config.fetch_timeout_s)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
            app.state.service = ServiceState(llm, engine, encoder, prompter, config, metrics, http)
            try:
                yield
            finally:
                timeout_s = config.shutdown_timeout_s
                await asyncio.to_thread(engine.shutdown, graceful=True, timeout=timeout_s)
                for worker in (encoder, prompter):
                    await asyncio.to_thread(worker.shutdown)

    app = FastAPI(title="stillcut", lifespan=lifespan, docs_url=None, redoc_url=None)
    metrics = ServiceMetrics(
        lambda: _engine_stats(app), lambda: _encoder_pending(app), lambda: llm.pipeline.work
    )
    app.add_api_route("/v1/videos/describe", describe_endpoint, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_endpoint, methods=["POST"])
    app.add_api_route("/v1/models", models_endpoint, methods=["GET"])
    app.add_api_websocket_route("/v1/stream", stream_endpoint)
    app.add_api_route("/health", health_endpoint, methods=["GET"])

    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"])
    add_page_routes(app)
    for kind in (APIError, ValueError, RuntimeError, TimeoutError, HTTPException, Exception):
        app.add_exception_handler(kind, _error_response)
    for gone in (ClientGone, ClientDisconnect):
        app.add_exception_handler(gone, lambda request, error: Response(status_code=499))
    known_paths = frozenset(route.path for route in app.routes)
    app.add_middleware(
        RequestContextMiddleware, config=config, metrics=metrics, known_paths=known_paths
    )
    return app


async def health_endpoint(request: Request) -> Response:
    """200 while the engine loop runs, else 503; with the KV pool's state and what the
    weights and the pool are stored in."""
    state: ServiceState = request.app.state.service
    stats = state.engine.stats
    running = state.engine.is_running
    memory = state.llm.engine.memory
    body = {
        "status": "ok" if running else "unavailable",
        "model": state.llm.name,
        "weight_format": memory.weight_format,
        "weight_bytes": memory.weight_bytes,
        "vision_weight_bytes": state.llm.vision_weight_bytes,
        "kv_cache_dtype": memory.kv_cache_dtype,
        "kv_cache_bytes": memory.kv_cache_bytes,
        "kv_blocks_used": stats.num_blocks_used,
        "kv_blocks_total": stats.num_blocks,
        "requests_waiting": stats.num_waiting + state.num_jobs_pending,
        "requests_running": stats.num_running,
        "live_sessions": state.live_sessions,
        "evs_default": state.llm.evs_default.to_dict(),
    }
    return JSONResponse(body, status_code=200 if running else 503)


async def _error_response(request: Request, error: Exception) -> Response:
    state: ServiceState | None = getattr(request.app.state, "service", None)
    retry_after = state.config.retry_after_s if state is not None else 1
    if isinstance(error, HTTPException):
        type_, code = _HTTP_ERRORS.get(error.status_code, ("invalid_request_error", None))
        message = f"{error.detail}: {request.method} {request.url.path}"
        error = APIError(error.status_code, message, type=type_, code=code)
    api = api_error(error, retry_after=retry_after)
    record = record_of(request)
    record.error_code = api.code
    return JSONResponse(api.body(record.request_id), status_code=api.status, headers=api.headers)


def _engine_stats(app: FastAPI) -> EngineStats:
    state = getattr(app.state, "service", None)
    return state.engine.stats if state is not None else EngineStats()


def _encoder_pending(app: FastAPI) -> int:
    state = getattr(app.state, "service", None)
    return state.num_jobs_pending if state is not None else 0
