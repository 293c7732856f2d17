"""A live session's incoming messages: each awaited against the session's deadline and an idle
or start limit, and checked (size, JSON depth) before the protocol sees it.

The receive in progress survives a wait that ends for another reason (an answer finishing,
which starts the idle time again), so no message is lost between waits. Whatever is wrong ends
the session with a `SessionEnd` that carries its close code.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from stillcut.service.config import ServerConfig
from stillcut.service.request_limits import MAX_JSON_DEPTH, loads_json

CLOSE_NORMAL = 1000
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009


class SessionEnd(Exception):
    """Close the session with `code`, after telling the client why (when `error_code`)."""

    def __init__(self, code: int, message: str = "", error_code: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.error_code = error_code


class Inbox:
    """One socket's messages, in order; see the module docstring."""

    def __init__(self, websocket: WebSocket, config: ServerConfig) -> None:
        self._websocket = websocket
        self._config = config
        self._deadline = time.monotonic() + config.max_session_s
        self._receiving: asyncio.Task | None = None

    async def next(
        self, wait_s: float | None, late: SessionEnd, also: asyncio.Task | None = None
    ) -> bytes | dict[str, Any] | None:
        """The next frame (bytes) or text message (a JSON object); None once `also` has
        finished (a message that arrived as well is the next call's); `WebSocketDisconnect`
        once the client left. Waits at most `wait_s` (None: no limit but the session's), then
        raises `late`."""
        if self._receiving is None:
            self._receiving = asyncio.ensure_future(self._websocket.receive())
        left = self._deadline - time.monotonic()
        timeout = max(0.0, left if wait_s is None else min(wait_s, left))
        waits = {self._receiving} if also is None else {self._receiving, also}
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if also is not None and also in done:  # before a message: `ask` may follow at once
            return None
        if self._receiving in done:
            message, self._receiving = self._receiving.result(), None
            return parse_message(message, self._config)
        if time.monotonic() >= self._deadline:
            limit = f"max_session_s={self._config.max_session_s:g}"
            raise SessionEnd(CLOSE_POLICY, f"the session reached {limit}", "session_expired")
        raise late

    def close(self) -> None:
        if self._receiving is not None:
            self._receiving.cancel()


def parse_message(message: dict[str, Any], config: ServerConfig) -> bytes | dict[str, Any]:
    """An ASGI WebSocket message as a frame (bytes) or a JSON object; `SessionEnd` otherwise."""
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", CLOSE_NORMAL))
    data = message.get("bytes")
    if data is None:
        data = message.get("text") or ""
    if len(data) > config.max_message_bytes:
        limit = config.max_message_bytes
        raise SessionEnd(CLOSE_TOO_BIG, f"a message exceeds {limit} bytes", "message_too_big")
    if isinstance(data, bytes):
        return data
    try:
        parsed = loads_json(data)
    except ValueError:  # not JSON, or too deep
        parsed = None
    if not isinstance(parsed, dict):
        raise SessionEnd(
            CLOSE_UNSUPPORTED_DATA,
            f"text messages must be JSON objects nested at most {MAX_JSON_DEPTH} deep",
            "bad_message",
        )
    return parsed
