"""Per-request plumbing as plain ASGI middleware: request ids, the Host and Origin checks, the
API key, the body deadline, one log line and the request metrics, and the 500 for an error no
handler mapped (logged once, with its traceback; Starlette's own catch-all would log it again).

Plain ASGI (not Starlette's `BaseHTTPMiddleware`) so that streamed responses pass through
untouched and a client that leaves mid-stream cancels the handler. A request's record closes
when the last body chunk is sent, so streams are timed to their end. The id comes from the
client's `X-Request-Id` when it is sane, else it is made here; it goes back in the same header.
A request body must have arrived `body_timeout_s` after the request did, else 408. WebSockets
get an id, the Host and Origin checks (a refused handshake is answered 403) and a log line;
their key is checked by the endpoint, since it may come in the first message.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stillcut.service.config import ServerConfig
from stillcut.service.errors import APIError, api_error
from stillcut.service.origins import host_is_trusted, origin_is_allowed
from stillcut.service.record import RecordObserver, RequestRecord

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


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header `name` (lowercase bytes), if sent."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def bearer_token(scope: Scope) -> str | None:
    value = header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def key_matches(api_key: str | None, token: str | None) -> bool:
    """True when no key is required, or `token` is the key (compared in constant time)."""
    if api_key is None:
        return True
    return token is not None and hmac.compare_digest(token.encode(), api_key.encode())


class BodyTimeout(APIError):
    """The request body did not arrive in time (408; the connection is closed)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408,
            f"the request body did not arrive within body_timeout_s={timeout_s:g} s",
            type="timeout",
            code="body_timeout",
            headers={"Connection": "close"},
        )


def body_deadline(receive: Receive, timeout_s: float) -> Receive:
    """`receive` that raises `BodyTimeout` while the body is still arriving past `timeout_s`
    from now; once the body is in, waiting (for a disconnect) has no deadline."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    body_done = False

    async def receive_body() -> Message:
        nonlocal body_done
        if body_done:
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            raise BodyTimeout(timeout_s) from None
        body_done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return receive_body


class RequestContextMiddleware:
    """Gives each HTTP request and WebSocket a `RequestRecord` in `scope["state"]["record"]`."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        config: ServerConfig,
        metrics: RecordObserver,
        known_paths: frozenset[str],
    ) -> None:
        self.app = app
        self.config = config
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
                await self._websocket(scope, receive, send, record)
            else:
                await self._http(scope, receive, send, record)
        finally:
            self._finish(scope, record)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, record: RequestRecord):
        refusal = self._refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        record.error_code = refusal.code
        record.status = 403
        await send({"type": "websocket.close", "code": 1008, "reason": refusal.message[:120]})

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
        refusal = self._refusal(scope)
        is_open = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        if (
            refusal is None
            and not is_open
            and not key_matches(self.config.api_key, bearer_token(scope))
        ):
            refusal = APIError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )
        if refusal is not None:
            record.error_code = refusal.code
            await _send_json(send_with_id, refusal.status, refusal.body(record.request_id))
            return
        try:
            await self.app(scope, body_deadline(receive, self.config.body_timeout_s), send_with_id)
        except Exception as error:  # one the handlers do not map: logged here, once
            api = api_error(error)
            record.error_code = api.code
            if record.status is None:  # nothing was sent yet: the client gets the error
                await _send_json(send_with_id, api.status, api.body(record.request_id))

    def _refusal(self, scope: Scope) -> APIError | None:
        """400 for more than one `Host` (RFC 9112) or one the server does not answer to, 403
        for a foreign browser `Origin`."""
        if sum(key == b"host" for key, _ in scope.get("headers", ())) > 1:
            return APIError(400, "the request has more than one Host header", code="bad_host")
        host = header(scope, b"host")
        if not host_is_trusted(host, self.config.trusted_hosts):
            return APIError(
                400,
                f"Host {host!r} is not one this server answers to; its trusted hosts are set "
                "by --trusted-hosts",
                code="untrusted_host",
            )
        origin = header(scope, b"origin")
        if not origin_is_allowed(origin, host, self.config.allowed_origins):
            return APIError(
                403,
                f"Origin {origin!r} may not call this server; allowed: its own origin and "
                "--allowed-origins",
                type="permission_error",
                code="origin_not_allowed",
            )
        return None

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
