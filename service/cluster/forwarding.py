"""Requests crossing from the ingress to a replica, and the replica running them in-process.

The ingress forwards a request as its ASGI scope's plain fields plus the body it has already
read (under the service's limits), with two headers rewritten: `X-Request-Id` to the
ingress's id, so both log lines share it, and `X-Request-Timeout` to what is left of the
request's deadline. The replica runs it through the same app a single server runs, with an
in-memory receive and send, and streams the app's ASGI messages back; once the app is done, a
last `stillcut.record` message carries the replica's log fields (tokens, EVS counts, timings)
so the ingress's log line has them too. Cancelling the stream (the client left, the ingress
gave up) cancels the app's task, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Scope

from stillcut.service.middleware import REQUEST_ID_HEADER
from stillcut.service.state import TIMEOUT_HEADER

RECORD_MESSAGE = "stillcut.record"
_SCOPE_FIELDS = (
    "type",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "headers",
    "client",
    "server",
    "subprotocols",
)
logger = logging.getLogger("stillcut.service")


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request or WebSocket handshake, as it travels to a replica."""

    scope: dict[str, Any]  # the ASGI scope's plain fields
    body: bytes = b""

    @classmethod
    def of(
        cls, scope: Scope, body: bytes, request_id: str, seconds_left: float | None
    ) -> ForwardedRequest:
        """`scope` and `body` with the request's id and remaining deadline in its headers."""
        rewritten = {REQUEST_ID_HEADER.encode(), TIMEOUT_HEADER.encode()}
        headers = [(name, value) for name, value in scope["headers"] if name not in rewritten]
        headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
        if seconds_left is not None:
            headers.append((TIMEOUT_HEADER.encode(), b"%.3f" % max(seconds_left, 1e-3)))
        plain = {name: scope[name] for name in _SCOPE_FIELDS if name in scope}
        return cls({**plain, "headers": headers}, body)

    def first_messages(self) -> list[Message]:
        """What the app receives before the client says anything more."""
        if self.scope["type"] == "websocket":
            return [{"type": "websocket.connect"}]
        return [{"type": "http.request", "body": self.body, "more_body": False}]


async def run_forwarded(
    app: ASGIApp, request: ForwardedRequest, inbox: asyncio.Queue
) -> AsyncIterator[Message]:
    """Run `request` through `app`: the messages it sends, then its record's log fields.
    `inbox` holds what the app receives (after `first_messages`)."""
    scope = {**request.scope, "headers": list(request.scope["headers"]), "state": {}}
    for message in request.first_messages():
        inbox.put_nowait(message)
    outbox: asyncio.Queue[Message] = asyncio.Queue()
    task = asyncio.create_task(app(scope, inbox.get, outbox.put))
    try:
        while True:
            sent = asyncio.ensure_future(outbox.get())
            await asyncio.wait({sent, task}, return_when=asyncio.FIRST_COMPLETED)
            if not sent.done():
                sent.cancel()
                break
            yield sent.result()
        while not outbox.empty():
            yield outbox.get_nowait()
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if not task.cancelled() and task.exception() is not None:  # answered by the app already
        logger.error("a forwarded request failed", exc_info=task.exception())
    record = scope["state"].get("record")
    if record is not None:
        yield {"type": RECORD_MESSAGE, "fields": record.log_fields()}
