"""`WebSocket /v1/stream`: the protocol around a `LiveSession`.

The client's first message is text, `{"type": "start", ...options}`. When the server has an
API key, it comes as `api_key` in that message, as `Authorization: Bearer KEY`, or (what a
browser can send) as the WebSocket subprotocol `stillcut.bearer.<base64url of KEY>` offered
beside `stillcut`, which the server selects. A socket holds no session slot until its start is
valid, and one without a valid start within `session_start_s` is closed. Frames are binary: 8
bytes of little-endian float64 timestamp (seconds), then PNG or JPEG bytes.
`{"type": "ask", "prompt"}` may come at any time (one answer at a time) and frames keep flowing
while it is answered; the idle timer starts again when an answer ends. `{"type": "stop"}` ends
the session. The server sends `started`, then `frame` per encoded tubelet, `token` while
answering, `answer` at the end of one, and `error`. A start with `"mode": "narrate"` (see
`NarrateOptions`) narrates instead: no asks; `token` while the model speaks, `segment` at each
segment's end, `rollover` when the sequence starts afresh; `stop` ends the session once what
is queued has been narrated (the socket is still read, so a client leaving is noticed). Fatal
errors close with 1003 (unsupported data), 1008 (policy: auth, limits, protocol order, a
narration its options cannot fit), 1009 (message too big; 64 KiB until the key is given) or
1011 (internal, or a model step that failed the held prefix or the narration: `step_failed`);
others (an answer whose step failed among them) are reported and the session goes on.
Whatever ends the session, its held prefix is released.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState
from tokenizers import Tokenizer

from stillcut.engine.admission import RequestTooLong, ResourceExhausted, TooManyVisualTokens
from stillcut.engine.llm_engine import StepFailed
from stillcut.engine.processor import PromptError
from stillcut.service.async_engine import EngineStopped, QueueFull
from stillcut.service.errors import client_message, step_failed
from stillcut.service.live_inbox import (
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_UNSUPPORTED_DATA,
    Inbox,
    SessionEnd,
)
from stillcut.service.live_options import LiveError, LiveLimits, LiveOptions
from stillcut.service.live_session import LiveSession
from stillcut.service.middleware import bearer_token, key_matches
from stillcut.service.narrate_options import NarrateOptions
from stillcut.service.narration import Narration, NarrationFailed
from stillcut.service.openai_format import logprobs_body
from stillcut.service.record import RequestRecord
from stillcut.service.result import timings_of, usage_of
from stillcut.service.state import ServiceState, record_of

CLOSE_INTERNAL = 1011
SUBPROTOCOL = "stillcut"
KEY_SUBPROTOCOL = "stillcut.bearer."  # + the key, base64url without padding
_TIMESTAMP = struct.Struct("<d")
_RECOVERABLE = (RequestTooLong, TooManyVisualTokens, ResourceExhausted, PromptError, QueueFull)
logger = logging.getLogger("stillcut.service")


class _Connection:
    """One WebSocket: serialized sends (answers and frame events interleave) and the record."""

    def __init__(self, websocket: WebSocket, record: RequestRecord) -> None:
        self.websocket = websocket
        self.record = record
        self._send_lock = asyncio.Lock()

    @property
    def is_open(self) -> bool:
        return self.websocket.application_state is WebSocketState.CONNECTED

    async def send(self, message: dict[str, Any]) -> None:
        """Send a JSON message; a client that already left is not an error here (the receive
        loop sees it leave and ends the session)."""
        async with self._send_lock:
            if not self.is_open:
                return
            try:
                await self.websocket.send_text(json.dumps(message))
            except (WebSocketDisconnect, RuntimeError, OSError):
                pass

    async def error(self, code: str, message: str) -> None:
        self.record.error_code = code
        await self.send({"type": "error", "code": code, "message": client_message(message)})


async def stream_endpoint(websocket: WebSocket) -> None:
    state: ServiceState = websocket.app.state.service
    connection = _Connection(websocket, record_of(websocket))
    offered = websocket.scope.get("subprotocols") or []
    await websocket.accept(
        subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None,
        headers=[(b"x-request-id", connection.record.request_id.encode())],
    )
    code, reason = CLOSE_NORMAL, ""
    api_key = state.config.api_key
    authenticated = key_matches(api_key, _socket_key(websocket))
    inbox = Inbox(websocket, state.config, authenticated, state.prompter.run)
    try:
        options = await _start(state, connection, inbox)
        async with _session_slot(state):
            await _serve(state, connection, inbox, options)
    except SessionEnd as end:
        code, reason = end.code, _close_reason(end.message)
        if end.error_code is not None:
            await connection.error(end.error_code, end.message)
    except WebSocketDisconnect as gone:
        code = gone.code
    except Exception:
        logger.exception("live session %s failed", connection.record.request_id)
        code, reason = CLOSE_INTERNAL, "internal error"
        await connection.error("internal_error", "internal server error")
    finally:
        inbox.close()
    connection.record.status = code
    if connection.is_open:
        try:
            await websocket.close(code, reason)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the client left first


@asynccontextmanager
async def _session_slot(state: ServiceState) -> AsyncIterator[None]:
    """One of the server's `max_sessions` slots, for a socket whose start was valid."""
    if state.live_sessions >= state.config.max_sessions:
        limit = f"max_sessions={state.config.max_sessions}"
        raise SessionEnd(CLOSE_POLICY, f"{limit} already open", "too_many_sessions")
    state.live_sessions += 1
    try:
        yield
    finally:
        state.live_sessions -= 1


def _session(
    state: ServiceState, connection: _Connection, options: LiveOptions | NarrateOptions
) -> LiveSession:
    # engine request ids must be unique; a client's X-Request-Id need not be
    session_id = f"live-{uuid.uuid4().hex}"
    workers = {"run_encode": state.encoder.run, "run_prompt": state.prompter.run}
    try:
        if isinstance(options, NarrateOptions):
            return Narration(
                state.llm.pipeline, state.engine, options, session_id, connection.send, **workers
            )
        return LiveSession(state.llm.pipeline, state.engine, options, session_id, **workers)
    except LiveError as error:  # options that do not fit this engine
        raise SessionEnd(CLOSE_POLICY, f"bad start options: {error}", "bad_start") from None
    except ValueError as error:  # a model, or an engine without prefix caching, cannot stream
        raise SessionEnd(CLOSE_POLICY, str(error), "unsupported_model") from None


async def _serve(
    state: ServiceState,
    connection: _Connection,
    inbox: Inbox,
    options: LiveOptions | NarrateOptions,
) -> None:
    config = state.config
    session = _session(state, connection, options)
    session_id = session.session_id
    answering: asyncio.Task | None = None
    failure = session.failure if isinstance(session, Narration) else None
    try:
        await connection.send(
            {
                "type": "started",
                "session_id": session_id,
                "request_id": connection.record.request_id,
            }
        )
        idle_end = SessionEnd(
            CLOSE_POLICY, f"no message for session_idle_s={config.session_idle_s:g}", "idle_timeout"
        )
        while True:
            # no idle limit while an answer streams; once it ends, the idle time starts again
            idle = None if answering is not None else config.session_idle_s
            message = await inbox.next(idle, idle_end, answering or failure)
            if message is None and answering is None:  # the narration failed
                raise _narration_end(failure.result())
            if message is None:  # the answer ended
                answering = None
            elif isinstance(message, bytes):
                await _frame(session, connection, message)
            elif message.get("type") == "stop":
                # the answer asked for before stop is still delivered, and what is queued is
                # still narrated; the socket is read meanwhile, so a client leaving is noticed
                if answering is not None:
                    await _reading(inbox, answering)
                if isinstance(session, Narration):
                    await _reading(inbox, session.drain())
                return
            elif message.get("type") == "ask" and isinstance(session, Narration):
                await connection.error("bad_message", "a narrating session takes no ask")
            elif message.get("type") == "ask":
                if answering is not None:
                    await connection.error("busy", "an answer is still streaming; ask again after")
                else:
                    tokenizer = state.llm.processor.tokenizer
                    answering = asyncio.create_task(
                        _answer(session, connection, message, tokenizer)
                    )
            else:
                await connection.error(
                    "bad_message",
                    f"type={str(message.get('type'))[:40]!r}: allowed ask, stop (or a frame)",
                )
    finally:
        if answering is not None:
            answering.cancel()
        await session.close()


async def _reading(inbox: Inbox, work) -> None:
    """Await `work` while the socket is read (messages after a stop are ignored), so a client
    that leaves meanwhile ends the session (`WebSocketDisconnect`)."""
    task = asyncio.ensure_future(work)
    try:
        late = SessionEnd(CLOSE_POLICY, "the session ended while stopping", "session_expired")
        while await inbox.next(None, late, task) is not None:
            pass
    finally:
        task.cancel()


def _narration_end(failed: NarrationFailed) -> SessionEnd:
    """The close of a narration that failed (its error was already sent)."""
    return SessionEnd(CLOSE_POLICY if failed.caused_by_client else CLOSE_INTERNAL, str(failed))


def _close_reason(message: str) -> str:
    """A close reason: no object repr, at most 123 bytes of UTF-8."""
    return client_message(message).encode()[:120].decode(errors="ignore")


async def _start(
    state: ServiceState, connection: _Connection, inbox: Inbox
) -> LiveOptions | NarrateOptions:
    """The options of a valid start message, which must come within `session_start_s`:
    `"mode": "narrate"` starts a narration, no mode a question-answer session."""
    config = state.config
    limit = f"session_start_s={config.session_start_s:g}"
    late = SessionEnd(CLOSE_POLICY, f"no valid start message within {limit}", "start_timeout")
    message = await inbox.next(config.session_start_s, late)
    if not isinstance(message, dict) or message.get("type") != "start":
        raise SessionEnd(
            CLOSE_POLICY, 'the first message must be {"type": "start", ...}', "bad_start"
        )
    token = message.pop("api_key", None) or _socket_key(connection.websocket)
    if not key_matches(config.api_key, token if isinstance(token, str) else None):
        raise SessionEnd(CLOSE_POLICY, "a valid API key is required", "invalid_api_key")
    inbox.authenticated = True
    limits = LiveLimits(
        max_frames=config.max_session_frames,
        max_frame_bytes=config.max_message_bytes,
        max_queued_tubelets=config.max_queued_tubelets,
    )
    mode = message.pop("mode", None)
    try:
        if mode == "narrate":
            return NarrateOptions.from_message(message, limits)
        if mode is not None:
            raise ValueError(f"mode={str(mode)[:40]!r}: allowed 'narrate' or no mode")
        return LiveOptions.from_message(message, limits)
    except (TypeError, ValueError) as error:
        raise SessionEnd(CLOSE_POLICY, f"bad start options: {error}", "bad_start") from None


def _socket_key(websocket: WebSocket) -> str | None:
    """The key of the handshake: `Authorization: Bearer`, else the key subprotocol."""
    token = bearer_token(websocket.scope)
    if token is not None:
        return token
    for offered in websocket.scope.get("subprotocols") or []:
        if offered.startswith(KEY_SUBPROTOCOL):
            encoded = offered.removeprefix(KEY_SUBPROTOCOL)
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
            except (binascii.Error, ValueError):
                return None
    return None


async def _frame(session: LiveSession, connection: _Connection, data: bytes) -> None:
    if len(data) <= _TIMESTAMP.size:
        raise SessionEnd(
            CLOSE_UNSUPPORTED_DATA,
            "a frame is 8 bytes of little-endian float64 timestamp, then PNG or JPEG bytes",
            "bad_frame",
        )
    (timestamp,) = _TIMESTAMP.unpack_from(data)
    try:
        event = await session.add_frame(timestamp, data[_TIMESTAMP.size :])
    except LiveError as error:
        await _live_error(connection, error)
        return
    except _RECOVERABLE as error:
        await connection.error(_error_code(error), str(error))
        return
    except StepFailed:  # the held prefix went with the failed step: the session cannot go on
        raise SessionEnd(CLOSE_INTERNAL, step_failed(0).message, "step_failed") from None
    if event is not None:
        connection.record.evs_kept += event.kept
        connection.record.evs_total += event.total
        await connection.send(
            {
                "type": "frame",
                "t": event.t,
                "tubelet": event.tubelet,
                "kept": event.kept,
                "total": event.total,
            }
        )


async def _answer(
    session: LiveSession, connection: _Connection, message: dict, tokenizer: Tokenizer
) -> None:
    prompt = message.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        await connection.error("bad_message", "ask needs a non-empty 'prompt' string")
        return
    arrival = time.monotonic()
    final = None
    try:
        async for output in session.ask(prompt):
            if output.delta:
                await connection.send({"type": "token", "text": output.delta})
            final = output
    except (LiveError, *_RECOVERABLE, EngineStopped) as error:  # the session goes on
        await connection.error(_error_code(error), str(error))
        return
    except StepFailed:  # only this answer failed; the held prefix is untouched
        await connection.error("step_failed", step_failed(0).message)
        return
    except Exception:
        logger.exception("an answer in live session %s failed", connection.record.request_id)
        await connection.error("internal_error", "internal server error while answering")
        return
    assert final is not None and final.finished
    connection.record.add_output([], final)
    usage, timings = usage_of(final), timings_of([], final, arrival)
    extra = {}
    if session.options.logprobs is not None:  # OpenAI's shape, as chat completions give them
        extra["logprobs"] = logprobs_body(tokenizer, final, 0, len(final.token_ids))
    await connection.send(
        {
            **extra,
            "type": "answer",
            "text": final.text,
            "finish_reason": final.finish_reason,
            "stop_reason": final.stop_reason,
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "cached_tokens": usage.cached_tokens,
                "total_tokens": usage.total_tokens,
            },
            "timings": {
                "queue_s": timings.queue_s,
                "ttft_s": timings.ttft_s,
                "total_s": timings.total_s,
            },
        }
    )


async def _live_error(connection: _Connection, error: LiveError) -> None:
    """Report a session error; a fatal one ends the session with its close code."""
    if error.close_code is not None:
        raise SessionEnd(error.close_code, str(error), _error_code(error))
    await connection.error(_error_code(error), str(error))


def _error_code(error: Exception) -> str:
    """`BadFrame` -> "bad_frame", `QueueFull` -> "queue_full"."""
    name = type(error).__name__
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
