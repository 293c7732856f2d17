"""The ingress's side of a forwarded request: a stream opened to a replica, its answer relayed.

A replica's stream starts with the replica's id and its first ASGI message; the ingress
learns from the request's `RouteHint` whether that replica is the one its key prefers. A
replica that dies (its process killed, its node lost) before it answered is a 503 with
`Retry-After` (`replica_failed`); one that dies mid-stream ends a server-sent-event stream with
the same error as an event, then `[DONE]`, as the service ends any stream that fails late. A
client that leaves cancels the replica's stream, so the replica aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    RequestCancelledError,
)
from ray.serve.handle import DeploymentResponseGenerator
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from stillcut.service.cluster.affinity import RouteHint
from stillcut.service.cluster.forwarding import RECORD_MESSAGE
from stillcut.service.errors import APIError, retryable
from stillcut.service.record import RequestRecord
from stillcut.service.sse import DONE, sse_event

# a replica's process died or cannot be reached; Ray Serve refused the call
REPLICA_FAILURES = (RayActorError, BackPressureError, DeploymentUnavailableError)
RECORD_WAIT_S = 5.0  # how long the replica's record may trail its answer's last byte


def replica_failed(retry_after_s: int) -> APIError:
    message = "the replica serving this request stopped before it finished; retry"
    return retryable(
        503, message, type="unavailable_error", code="replica_failed", retry_after=retry_after_s
    )


@dataclass
class ReplicaStream:
    """An opened replica stream: who serves it, its first message, and the rest."""

    replica: str
    affinity: bool  # the replica is the one the request's key prefers
    first: Message
    rest: DeploymentResponseGenerator


async def open_replica_stream(
    stream: DeploymentResponseGenerator, hint: RouteHint, retry_after_s: int
) -> ReplicaStream:
    """The replica's id and first message; `replica_failed` if it dies first. Whatever ends
    it early (a deadline, a client that left), the caller cancels `stream`."""
    try:
        replica = await anext(stream)
        first = await anext(stream)
    except REPLICA_FAILURES:
        raise replica_failed(retry_after_s) from None
    return ReplicaStream(replica, replica == hint.preferred, first, stream)


class RelayedResponse(Response):
    """A replica's HTTP answer, passed on message by message as it arrives. A client that
    leaves before the body is out cancels the replica's stream."""

    def __init__(self, stream: ReplicaStream, record: RequestRecord, retry_after_s: int) -> None:
        super().__init__()
        self._stream = stream
        self._record = record
        self._retry_after_s = retry_after_s
        self._body_sent = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.ensure_future(self._relay(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not relay.done() and self._body_sent:  # only the replica's record is left
                await asyncio.wait({relay}, timeout=RECORD_WAIT_S)
        finally:
            gone.cancel()
            if not relay.done():
                relay.cancel()
                self._stream.rest.cancel()
        with contextlib.suppress(asyncio.CancelledError, RequestCancelledError):
            await relay

    async def _relay(self, send: Send) -> None:
        start = self._stream.first
        event_stream = any(
            name == b"content-type" and value.startswith(b"text/event-stream")
            for name, value in start.get("headers", ())
        )
        await send(start)
        try:
            async for message in self._stream.rest:
                if message["type"] == RECORD_MESSAGE:
                    self._record.take_counts(message["fields"])
                    continue
                await send(message)
                self._body_sent = not message.get("more_body", False)
        except REPLICA_FAILURES:
            if self._body_sent:
                return
            error = replica_failed(self._retry_after_s)
            self._record.error_code = error.code
            tail = sse_event(error.body(self._record.request_id)) + DONE if event_stream else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (the body was read before the stream was opened)."""
    while (await receive())["type"] != "http.disconnect":
        pass
