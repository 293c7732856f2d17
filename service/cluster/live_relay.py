"""`WebSocket /v1/stream` at the ingress: a live session pinned to one replica, frames relayed.

When a socket opens, the router places its session (no key: Ray's least-loaded of two), and
the session stays on that replica: the replica's app runs the whole protocol (the key check,
`max_sessions`, which is per replica, every limit), and the ingress only carries messages. The
replica's messages come back on the session's stream; each client message goes to the same
replica by a call pinned there, awaited before the next is read, so order holds and a client
that sends faster than the replica reads is slowed down. A replica that dies mid-session ends
it with an `error` event (`replica_failed`) and close code 1011.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from starlette.websockets import WebSocket, WebSocketState

from stillcut.service.cluster.affinity import RouteHint
from stillcut.service.cluster.forwarding import RECORD_MESSAGE, ForwardedRequest
from stillcut.service.cluster.relay import REPLICA_FAILURES, ReplicaStream, open_replica_stream
from stillcut.service.errors import APIError
from stillcut.service.record import RequestRecord
from stillcut.service.state import record_of

CLOSE_INTERNAL = 1011
ENDING_S = 10.0  # how long a session may take to end once its client has gone


async def relay_session(websocket: WebSocket) -> None:
    """Run one live session on a replica, relaying messages both ways."""
    state = websocket.app.state.service
    record = record_of(websocket)
    await websocket.receive()  # the handshake's websocket.connect; the replica accepts or not
    session_id = f"live-{uuid.uuid4().hex}"
    hint = RouteHint()
    forwarded = ForwardedRequest.of(websocket.scope, b"", record.request_id, None)
    call = state.replicas.options(stream=True).live.remote(forwarded, session_id, route=hint)
    try:
        stream = await open_replica_stream(call, hint, state.config.retry_after_s)
    except APIError as error:
        record.error_code, record.status = error.code, CLOSE_INTERNAL
        await websocket.close(CLOSE_INTERNAL, error.message[:120])
        return
    except BaseException:
        call.cancel()
        raise
    record.replica, record.affinity = stream.replica, stream.affinity
    await websocket.send(stream.first)
    to_client = asyncio.ensure_future(_to_client(websocket, stream, record))
    to_replica = asyncio.ensure_future(_to_replica(websocket, state, session_id, stream.replica))
    try:
        await asyncio.wait({to_client, to_replica}, return_when=asyncio.FIRST_COMPLETED)
        if to_replica.done() and not to_client.done():  # the client left: let the session end
            await asyncio.wait({to_client}, timeout=ENDING_S)
        for task in (to_client, to_replica):
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
    except REPLICA_FAILURES:
        await _replica_failed(websocket, record)
    finally:
        for task in (to_client, to_replica):
            task.cancel()
        stream.rest.cancel()


async def _to_client(websocket: WebSocket, stream: ReplicaStream, record: RequestRecord) -> None:
    """The replica's messages to the client, until the replica's session ends."""
    async for message in stream.rest:
        if message["type"] == RECORD_MESSAGE:
            record.take_counts(message["fields"])
            record.status = message["fields"].get("status", record.status)
        elif websocket.application_state is WebSocketState.CONNECTED:
            await websocket.send(message)


async def _to_replica(websocket: WebSocket, state, session_id: str, replica: str) -> None:
    """The client's messages to the session's replica, until the client leaves or the
    session is gone from the replica."""
    pin = RouteHint(pin=replica)
    while True:
        message = await websocket.receive()
        delivered = await state.replicas.live_message.remote(session_id, message, route=pin)
        if message["type"] == "websocket.disconnect" or not delivered:
            return


async def _replica_failed(websocket: WebSocket, record: RequestRecord) -> None:
    record.error_code, record.status = "replica_failed", CLOSE_INTERNAL
    if websocket.application_state is not WebSocketState.CONNECTED:
        return
    message = "the replica serving this session stopped; open a new session"
    with contextlib.suppress(RuntimeError, OSError):
        await websocket.send_json({"type": "error", "code": "replica_failed", "message": message})
        await websocket.close(CLOSE_INTERNAL, "replica failed")
