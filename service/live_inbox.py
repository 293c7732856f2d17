"""A live session's incoming messages: each awaited against the session's deadline and an idle
or start limit, and checked (size, JSON bounds) before the protocol sees it.

Until the socket is authenticated (a key in its handshake, or a start message holding one), a
message may hold at most `UNAUTHENTICATED_BYTES`, so a client without the key cannot make the
server parse megabytes; larger text messages are parsed on a thread, off the event loop.

The receive in progress survives a wait that ends for another reason (an answer finishing,
which starts the idle time again), so no message is lost between waits. Whatever is wrong ends
the session with a `SessionEnd` that carries its close code.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from stillcut.service.config import ServerConfig
from stillcut.service.request_limits import MAX_JSON_DEPTH, JSONRefused, loads_json

CLOSE_NORMAL = 1000
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
UNAUTHENTICATED_BYTES = 64 * 1024  # a start message with its key fits easily
_PARSE_ON_LOOP_BYTES = 64 * 1024


class SessionEnd(Exception):
    """Close the session with `code`, after telling the client why (when `error_code`)."""

    def __init__(self, code: int, message: str = "", error_code: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.error_code = error_code


class Inbox:
    """One socket's messages, in order; see the module docstring."""

    def __init__(
        self,
        websocket: WebSocket,
        config: ServerConfig,
        authenticated: bool,
        run_parse: Callable[[Callable[[], Any]], Awaitable[Any]] = asyncio.to_thread,
    ) -> None:
        """`run_parse` runs the parse of a large text message off the event loop."""
        self._websocket = websocket
        self._config = config
        self._run_parse = run_parse
        self.authenticated = authenticated  # set once the start message's key is checked
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
            data = message_data(message, self._config, self.authenticated)
            if isinstance(data, bytes):
                return data
            if len(data) <= _PARSE_ON_LOOP_BYTES:
                return parse_text(data)
            return await self._run_parse(functools.partial(parse_text, data))
        if time.monotonic() >= self._deadline:
            limit = f"max_session_s={self._config.max_session_s:g}"
            raise SessionEnd(CLOSE_POLICY, f"the session reached {limit}", "session_expired")
        raise late

    def close(self) -> None:
        if self._receiving is not None:
            self._receiving.cancel()


def message_data(message: dict[str, Any], config: ServerConfig, authenticated: bool) -> bytes | str:
    """The payload of an ASGI WebSocket message, within the size limit (`UNAUTHENTICATED_BYTES`
    until `authenticated`); `WebSocketDisconnect` once the client left, `SessionEnd` if too big."""
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", CLOSE_NORMAL))
    data = message.get("bytes")
    if data is None:
        data = message.get("text") or ""
    limit = config.max_message_bytes
    if not authenticated:
        limit = min(limit, UNAUTHENTICATED_BYTES)
    if len(data) > limit:
        before = "" if authenticated else " before the API key is given"
        raise SessionEnd(
            CLOSE_TOO_BIG, f"a message exceeds {limit} bytes{before}", "message_too_big"
        )
    return data


def parse_text(text: str) -> dict[str, Any]:
    """A text message as a JSON object; `SessionEnd` otherwise."""
    try:
        parsed = loads_json(text)
    except JSONRefused as error:
        raise SessionEnd(CLOSE_UNSUPPORTED_DATA, str(error), "bad_message") from None
    except ValueError:  # not JSON
        parsed = None
    if not isinstance(parsed, dict):
        raise SessionEnd(
            CLOSE_UNSUPPORTED_DATA,
            f"text messages must be JSON objects nested at most {MAX_JSON_DEPTH} deep",
            "bad_message",
        )
    return parsed
