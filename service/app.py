"""The FastAPI app: routes, error handling, and the objects that live as long as the server.

`create_app(llm, config)` wires the endpoints to one `VideoLLM`. At startup its engine goes to
a background `AsyncEngine`, one `Worker` takes the vision pipeline and another tokenizes
prompts (and looks up media already in the encoder cache); at shutdown in-flight requests get
`shutdown_timeout_s` to finish, then are aborted. Every error leaves as the one JSON shape of
`errors`, with the request's id; a client that hung up is logged once, as 499.
`add_service_routes` is the app's skeleton (paths, page, error handlers, request middleware)
given the endpoints, so the cluster ingress, whose endpoints forward to replicas, answers the
same paths with the same checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

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
from stillcut.service.plan_route import plan_endpoint
from stillcut.service.record import RecordObserver
from stillcut.service.state import ServiceState, record_of
from stillcut.service.stream_route import stream_endpoint
from stillcut.service.summarize_route import summarize_endpoint
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

    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    endpoints = Endpoints(
        describe_endpoint,
        chat_endpoint,
        models_endpoint,
        stream_endpoint,
        health_endpoint,
        metrics_endpoint,
        plan_endpoint,
        summarize_endpoint,
    )
    return add_service_routes(app, config, metrics, endpoints)


@dataclass(frozen=True)
class Endpoints:
    """The handlers behind the service's paths."""

    describe: Callable  # POST /v1/videos/describe
    chat: Callable  # POST /v1/chat/completions
    models: Callable  # GET /v1/models
    stream: Callable  # WebSocket /v1/stream
    health: Callable  # GET /health
    metrics: Callable  # GET /metrics
    plan: Callable  # POST /v1/videos/plan
    summarize: Callable  # POST /v1/videos/summarize


def add_service_routes(
    app: FastAPI, config: ServerConfig, metrics: RecordObserver, endpoints: Endpoints
) -> FastAPI:
    """`app` with the service's paths served by `endpoints`, the page, the error handlers and
    the request middleware (ids, Host and Origin checks, key, body deadline, log, `metrics`)."""
    app.add_api_route("/v1/videos/describe", endpoints.describe, methods=["POST"])
    app.add_api_route("/v1/chat/completions", endpoints.chat, methods=["POST"])
    app.add_api_route("/v1/models", endpoints.models, methods=["GET"])
    app.add_api_route("/v1/videos/plan", endpoints.plan, methods=["POST"])
    app.add_api_route("/v1/videos/summarize", endpoints.summarize, methods=["POST"])
    app.add_api_websocket_route("/v1/stream", endpoints.stream)
    app.add_api_route("/health", endpoints.health, methods=["GET"])
    app.add_api_route("/metrics", endpoints.metrics, methods=["GET"])
    add_page_routes(app)
    for kind in (APIError, ValueError, RuntimeError, TimeoutError, HTTPException):
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
    body = service_health(request.app.state.service)
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)


def service_health(state: ServiceState) -> dict:
    """The server's health: "ok" while its engine loop runs, else "unavailable"; the stored
    formats and bytes of the weights and the KV pool, the arithmetic prefill and the tower
    compute in (and why), the pool, the queues and the live
    sessions."""
    stats = state.engine.stats
    running = state.engine.is_running
    memory = state.llm.engine.memory
    return {
        "status": "ok" if running else "unavailable",
        "model": state.llm.name,
        "weight_format": memory.weight_format,
        "arithmetic": memory.arithmetic.to_dict(),
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
