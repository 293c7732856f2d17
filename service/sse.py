"""Server-sent events for streamed answers.

A stream is opened only once its request was admitted and produced a first output, so
admission errors still get their HTTP status. Later failures (a missed deadline, an engine
that stopped) arrive as one event holding the usual error object, then `[DONE]`. A client
that hangs up cancels the stream, which aborts the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from stillcut.engine.llm_engine import RequestOutput
from stillcut.service.errors import api_error
from stillcut.service.record import RequestRecord

DONE = b"data: [DONE]\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def sse_response(
    first: RequestOutput,
    rest: AsyncIterator[RequestOutput],
    *,
    seconds_left: float,
    record: RequestRecord,
    retry_after: float,
    events: Callable[[RequestOutput], list[dict]],
) -> StreamingResponse:
    """Stream `events(output)` for `first` and each later output, then `[DONE]`."""

    async def body() -> AsyncIterator[bytes]:
        try:
            for event in events(first):
                yield sse_event(event)
            async with asyncio.timeout(seconds_left):
                async for output in rest:
                    for event in events(output):
                        yield sse_event(event)
        except Exception as error:  # mid-stream: headers are sent, so report in the stream
            api = api_error(error, retry_after=retry_after)
            record.error_code = api.code
            yield sse_event(api.body(record.request_id))
        finally:
            await rest.aclose()
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers=_HEADERS)
