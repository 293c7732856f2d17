"""One error shape for every endpoint, and which status each failure earns.

Errors are OpenAI-style, `{"error": {"message", "type", "code", "request_id"}}`. A handler
raises `APIError` for what it checks itself; `api_error` maps the library's exceptions:
media over a limit is 413, media that is not a (supported) video 415, media that cannot be
decoded (or has an aspect ratio the model cannot take) 422, a prompt over `max_model_len` or
with too many visual tokens 400, a full queue 503 with `Retry-After`, a missed deadline 504,
a request whose engine step failed a 500 `step_failed` with `Retry-After` (the engine goes on;
the engine loop logged the step's traceback). Anything else is a 500 whose message hides the
internals (they go to the log). Messages never carry an object's repr
(`<_io.BytesIO object at 0x...>`): they name what was wrong, not where
it sat in memory.
"""

from __future__ import annotations

import logging
import re

from stillcut.engine.admission import (
    BidirectionalItemTooLong,
    RequestTooLong,
    ResourceExhausted,
    TooManyVisualTokens,
)
from stillcut.engine.llm_engine import StepFailed
from stillcut.engine.models.pixels import AspectRatioError
from stillcut.engine.processor import PromptError
from stillcut.service.async_engine import EngineStopped, QueueFull
from stillcut.vision import errors as video_errors

logger = logging.getLogger("stillcut.service")
_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class APIError(Exception):
    """An error answered to the client as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = client_message(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self, request_id: str | None) -> dict:
        error = {"message": self.message, "type": self.type, "code": self.code}
        return {"error": {**error, "request_id": request_id}}


def client_message(message: str) -> str:
    """`message` with any object repr (it names a heap address) replaced by "<object>"."""
    return _OBJECT_REPR.sub("<object>", message)


def shown(value: object, limit: int = 60) -> str:
    """A client's value as a message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def bad_request(message: str, code: str = "invalid_request") -> APIError:
    return APIError(400, message, code=code)


def retryable(status: int, message: str, *, type: str, code: str, retry_after: float) -> APIError:
    """An error the client may retry, `Retry-After` whole seconds later (at least 1)."""
    headers = {"Retry-After": str(max(1, round(retry_after)))}
    return APIError(status, message, type=type, code=code, headers=headers)


def overloaded(message: str, retry_after: float) -> APIError:
    return retryable(
        503, message, type="overloaded_error", code="queue_full", retry_after=retry_after
    )


def step_failed(retry_after: float) -> APIError:
    """The answer to a request whose engine step raised: it was stopped, the server is fine."""
    message = "the model failed while running this request; it was stopped, and may be retried"
    return retryable(
        500, message, type="internal_error", code="step_failed", retry_after=retry_after
    )


_VIDEO_STATUS = (  # most specific first
    (video_errors.VideoLimitExceeded, 413, "request_too_large", "media_over_limit"),
    (video_errors.NotAVideo, 415, "unsupported_media_type", "not_a_video"),
    (video_errors.NotAnImage, 415, "unsupported_media_type", "not_an_image"),
    (video_errors.UnsupportedCodec, 415, "unsupported_media_type", "unsupported_codec"),
    (video_errors.InvalidTimeRange, 400, "invalid_request_error", "invalid_time_range"),
    (video_errors.VideoError, 422, "unprocessable_media", "unreadable_media"),
    (AspectRatioError, 422, "unprocessable_media", "unsupported_aspect_ratio"),
)
_REQUEST_STATUS = (
    (RequestTooLong, 400, "context_length_exceeded"),
    (TooManyVisualTokens, 400, "too_many_visual_tokens"),
    (BidirectionalItemTooLong, 400, "media_item_too_long"),
    (PromptError, 400, "invalid_prompt"),
)


def api_error(error: BaseException, *, retry_after: float = 1.0) -> APIError:
    """The client-facing error for an exception raised while serving a request."""
    if isinstance(error, APIError):
        return error
    for kind, status, type_, code in _VIDEO_STATUS:
        if isinstance(error, kind):
            return APIError(status, str(error), type=type_, code=code)
    for kind, status, code in _REQUEST_STATUS:
        if isinstance(error, kind):
            return APIError(status, str(error), code=code)
    if isinstance(error, QueueFull | ResourceExhausted):
        return overloaded(str(error), retry_after)
    if isinstance(error, StepFailed):
        return step_failed(retry_after)
    if isinstance(error, EngineStopped):
        return APIError(503, str(error), type="unavailable_error", code="engine_stopped")
    if isinstance(error, TimeoutError):
        return APIError(
            504, "the request passed its deadline and was aborted", type="timeout", code="timeout"
        )
    logger.error("internal error while serving a request", exc_info=error)
    return APIError(500, "internal server error", type="internal_error", code="internal_error")
