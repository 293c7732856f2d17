"""Per-request plumbing as plain ASGI middleware: request ids, the API key, one log line and
the request metrics.

Plain ASGI (not Starlette's `BaseHTTPMiddleware`) so that streamed responses pass through
untouched and a client that leaves mid-stream cancels the handler. A request's record closes
when the last body chunk is sent, so streams are timed to their end. The id comes from the
client's `X-Request-Id` when it is sane, else it is made here; it goes back in the same header.
WebSockets get an id and a log line too; their key is checked by the endpoint, which must
accept before it can close with 1008.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stillcut.service.errors import APIError
from stillcut.service.metrics import ServiceMetrics
from stillcut.service.record import RequestRecord

REQUEST_ID_HEADER = "x-request-id"
OPEN_PATHS = ("/health", "/")  # answered without the API key
OPEN_PREFIXES = ("/static/",)  # the page's files: it asks for the key itself
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
access_log = logging.getLogger("stillcut.access")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def request_id_from(scope: Scope) -> str:
    """The client's `X-Request-Id` if it is short and plain, else a new one."""
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER.encode():
            client_id = value.decode("latin-1")
            if _CLIENT_ID.fullmatch(client_id):
                return client_id
    return new_request_id()


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def key_matches(api_key: str | None, token: str | None) -> bool:
    """True when no key is required, or `token` is the key (compared in constant time)."""
    if api_key is None:
        return True
    return token is not None and hmac.compare_digest(token.encode(), api_key.encode())


class RequestContextMiddleware:
    """Gives each HTTP request and WebSocket a `RequestRecord` in `scope["state"]["record"]`."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        metrics: ServiceMetrics,
        known_paths: frozenset[str],
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.known_paths = known_paths  # metric labels: never a client-chosen path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        record = RequestRecord(
            request_id=request_id_from(scope),
            endpoint=scope["path"],
            method=scope.get("method", "WS"),
            arrival=time.monotonic(),
        )
        scope.setdefault("state", {})["record"] = record
        try:
            if scope["type"] == "websocket":
                await self.app(scope, receive, send)
            else:
                await self._http(scope, receive, send, record)
        finally:
            self._finish(scope, record)

    async def _http(self, scope: Scope, receive: Receive, send: Send, record: RequestRecord):
        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [*message.get("headers", ())]
                headers.append((REQUEST_ID_HEADER.encode(), record.request_id.encode()))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                record.ended = time.monotonic()
            await send(message)

        path = scope["path"]
        is_open = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        if not is_open and not key_matches(self.api_key, bearer_token(scope)):
            error = APIError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )
            record.error_code = error.code
            await _send_json(send_with_id, error.status, error.body(record.request_id))
            return
        await self.app(scope, receive, send_with_id)

    def _finish(self, scope: Scope, record: RequestRecord) -> None:
        path = getattr(scope.get("route"), "path", None) or scope["path"]
        record.endpoint = path if path in self.known_paths else "unmatched"
        if record.status is None:
            record.status = 499  # the client left before a response started (nginx's code)
        record.ended = record.ended or time.monotonic()
        self.metrics.observe(record)
        access_log.info(json.dumps(record.log_fields()))


async def _send_json(send: Send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
