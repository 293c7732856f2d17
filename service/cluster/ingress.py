"""The cluster's ingress: the service's own app, whose endpoints forward to engine replicas.

It is built by the same `add_service_routes` as a single server, so the paths, the page, the
Host and Origin checks, the API key, the body deadline, the request ids, the error shapes and
the access log are the same. A describe, chat, plan or summarize request's body is read here
within the service's limits (413 past them; 408 past the body deadline), keyed (`affinity`; a
plan warms no cache, so it has no key and goes to the less loaded of two replicas), and sent
with what is left of its deadline to the replica the router picks; the answer is relayed as it
streams. `/health` and `/metrics` ask every replica. The ingress runs in a Ray Serve replica of
its own behind Ray's HTTP proxy and reserves no CPU.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stillcut.service.app import Endpoints, add_service_routes
from stillcut.service.chat_route import chat_body_limit
from stillcut.service.cluster.affinity import RouteHint, chat_key, upload_key
from stillcut.service.cluster.cluster_metrics import IngressMetrics
from stillcut.service.cluster.forwarding import ForwardedRequest
from stillcut.service.cluster.live_relay import relay_session
from stillcut.service.cluster.logs import configure_logging
from stillcut.service.cluster.relay import RelayedResponse, open_replica_stream
from stillcut.service.config import ServerConfig
from stillcut.service.media import FORM_OVERHEAD_BYTES, read_body
from stillcut.service.metrics import CONTENT_TYPE
from stillcut.service.middleware import REQUEST_ID_HEADER
from stillcut.service.state import record_of, seconds_left, until_disconnect

_SHARED_HEALTH = ("model", "weight_format", "kv_cache_dtype", "evs_default")
_SUMMED_HEALTH = (
    "weight_bytes",
    "vision_weight_bytes",
    "kv_cache_bytes",
    "kv_blocks_used",
    "kv_blocks_total",
    "requests_waiting",
    "requests_running",
    "live_sessions",
)
ASK_REPLICAS_S = 5.0  # how long /health and /metrics wait for the replicas
DEADLINE_GRACE_S = 1.0  # past a request's deadline, the replica's own 504 has had its chance


@dataclass
class IngressState:
    """What the ingress's endpoints share (its `app.state.service`)."""

    config: ServerConfig
    replicas: DeploymentHandle  # the engine replicas, routed by `MediaAffinityRouter`
    num_replicas: int
    metrics: IngressMetrics

    async def ask_replicas(self, method: str) -> list:
        """`method()` of every replica that answers within `ASK_REPLICAS_S`."""
        try:
            answers = await self.replicas.broadcast(method).results_async(
                timeout_s=ASK_REPLICAS_S, return_exceptions=True
            )
        except TimeoutError:
            return []
        return [answer for answer in answers if not isinstance(answer, BaseException)]


def create_ingress_app(state: IngressState) -> FastAPI:
    app = FastAPI(title="stillcut", docs_url=None, redoc_url=None)
    app.state.service = state
    endpoints = Endpoints(
        forward_describe,
        forward_chat,
        forward_models,
        relay_session,
        health,
        metrics,
        forward_plan,
        forward_summarize,
    )
    add_service_routes(app, state.config, state.metrics, endpoints)
    app.add_middleware(_ProxyEchoesRequestId)
    return app


async def forward_describe(request: Request) -> Response:
    config = request.app.state.service.config
    body = await read_body(request, config.max_upload_bytes + FORM_OVERHEAD_BYTES, "the upload")
    return await forward(request, body, await upload_key(body, request.headers))


async def forward_summarize(request: Request) -> Response:
    """A summary's form, keyed by its video like a describe upload: a second summary or a
    question about the same video finds its chunks in that replica's caches."""
    return await forward_describe(request)


async def forward_chat(request: Request) -> Response:
    config = request.app.state.service.config
    body = await read_body(request, chat_body_limit(config.max_upload_bytes))
    return await forward(request, body, await asyncio.to_thread(chat_key, body))


async def forward_models(request: Request) -> Response:
    return await forward(request, b"", None)


async def forward_plan(request: Request) -> Response:
    config = request.app.state.service.config
    body = await read_body(request, config.max_upload_bytes, "the video")
    return await forward(request, body, None)


async def forward(request: Request, body: bytes, key: bytes | None) -> Response:
    """Send the request to the replica the router picks for `key`; relay its answer."""
    state: IngressState = request.app.state.service
    record = record_of(request)
    budget = seconds_left(request, state.config)
    forwarded = ForwardedRequest.of(request.scope, body, record.request_id, budget)
    hint = RouteHint(key=key)
    call = state.replicas.options(stream=True).forward.remote(forwarded, route=hint)
    retry_after_s = state.config.retry_after_s
    try:
        async with asyncio.timeout(budget + DEADLINE_GRACE_S):
            opening = open_replica_stream(call, hint, retry_after_s)
            stream = await until_disconnect(request, opening)
    except BaseException:  # past the deadline, or the client left: the replica stops too
        call.cancel()
        raise
    record.replica, record.affinity = stream.replica, stream.affinity
    return RelayedResponse(stream, record, retry_after_s)


async def health(request: Request) -> Response:
    """Replicas up and deployed, with each one's own health; 503 only when none is up."""
    state: IngressState = request.app.state.service
    body = cluster_health(await state.ask_replicas("health"), state.num_replicas)
    return JSONResponse(body, status_code=503 if body["status"] == "unavailable" else 200)


def cluster_health(reports: list[dict], num_replicas: int) -> dict:
    """The cluster's `/health` body from the replicas' own (`reports`, those that answered):
    "ok" with every replica up, "degraded" with some, "unavailable" with none; the settings
    every replica shares; the sums of their bytes held, KV and queue figures; each report."""
    reports = sorted(reports, key=lambda report: report["replica"])
    num_up = sum(report["status"] == "ok" for report in reports)
    status = "ok" if num_up == num_replicas else "degraded" if num_up else "unavailable"
    body = {"status": status, "replicas_up": num_up, "replicas_total": num_replicas}
    for name in _SHARED_HEALTH if reports else ():
        body[name] = reports[0][name]
    for name in _SUMMED_HEALTH:
        body[name] = sum(report[name] for report in reports)
    body["replicas"] = reports
    return body


async def metrics(request: Request) -> Response:
    state: IngressState = request.app.state.service
    texts = sorted(await state.ask_replicas("metrics_text"))
    return Response(state.metrics.render(texts, state.num_replicas), media_type=CONTENT_TYPE)


class _ProxyEchoesRequestId:
    """Ray's HTTP proxy puts the request id in every response itself (the same id the
    service's middleware took from the request), so the ingress's copy is dropped."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_once(message: Message) -> None:
            if message["type"] == "http.response.start":
                own = REQUEST_ID_HEADER.encode()
                headers = [header for header in message.get("headers", ()) if header[0] != own]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_once)


@serve.ingress()
class Ingress:
    """The Ray Serve deployment class of the ingress (see the module docstring)."""

    def __init__(
        self, replicas: DeploymentHandle, config: ServerConfig, num_replicas: int, log_level: str
    ) -> None:
        configure_logging(log_level)
        self._state = IngressState(config, replicas, num_replicas, IngressMetrics())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_ingress_app(self._state)
