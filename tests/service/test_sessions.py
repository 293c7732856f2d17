"""Live sessions on a server with a key: the key may come in the Authorization header, in a
subprotocol (what a browser can send) or in the start message; a socket holds a session slot
only once its start is valid and is closed if none comes in time; after an answer the idle
timer runs again. Refused sockets do no work."""

import base64
import contextlib
import io
import json
import struct
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from stillcut.service.config import ServerConfig

from .conftest import running_server, settled_pool_state, work_done

KEY = "sk-live-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
START_S = 1.0
IDLE_S = 1.5
START = {"type": "start", "threshold": 0.1, "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    config = ServerConfig(
        api_key=KEY, max_sessions=1, session_start_s=START_S, session_idle_s=IDLE_S
    )
    with running_server(tiny_checkpoint, config) as server:
        yield server


def _frame(timestamp: float, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return struct.pack("<d", timestamp) + buffer.getvalue()


def _connect(server, **options):
    url = server.url.replace("http://", "ws://") + "/v1/stream"
    return connect(url, proxy=None, open_timeout=30, **options)


def _key_protocol(key: str) -> str:
    return "stillcut.bearer." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def _closed(socket) -> tuple[list[dict], int]:
    """The messages before the server closed the socket, and its close code."""
    messages = []
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            messages.append(json.loads(socket.recv(timeout=30)))
    return messages, closed.value.rcvd.code


def _live_sessions(server) -> int:
    return httpx.get(f"{server.url}/health").json()["live_sessions"]


@pytest.mark.parametrize(
    ("how", "key"),
    [
        ("header", KEY),
        ("subprotocol", KEY),
        ("start", KEY),
        ("header", "wrong"),
        ("subprotocol", "wrong"),
        ("start", "wrong"),
        ("none", None),
    ],
)
def test_the_key_may_come_in_a_header_a_subprotocol_or_the_start(server, how, key):
    options, start = {}, dict(START)
    if how == "header":
        options["additional_headers"] = {"Authorization": f"Bearer {key}"}
    elif how == "subprotocol":
        options["subprotocols"] = ["stillcut", _key_protocol(key)]
    elif how == "start":
        start["api_key"] = key
    before = work_done(server.url, AUTH)
    with _connect(server, **options) as socket:
        if how == "subprotocol":
            assert socket.subprotocol == "stillcut"  # the key is never echoed back
        socket.send(json.dumps(start))
        try:  # frames right behind the start: a refused socket decodes none
            for k in range(2):
                socket.send(_frame(k / 2, seed=k))
        except ConnectionClosed:
            pass  # the server closed it first
        if key == KEY:
            assert json.loads(socket.recv(timeout=30))["type"] == "started"
            socket.send(json.dumps({"type": "stop"}))
            messages, code = _closed(socket)
            assert code == 1000 and messages[0]["type"] == "frame"
        else:
            messages, code = _closed(socket)
            assert code == 1008
            assert messages == [
                {"type": "error", "code": "invalid_api_key", "message": messages[0]["message"]}
            ]
            assert work_done(server.url, AUTH) == before
    assert settled_pool_state(server) == (True, 0)


def test_sockets_without_a_valid_start_never_take_a_slot(server):
    with contextlib.ExitStack() as stack:
        idle = [stack.enter_context(_connect(server)) for _ in range(3)]  # open, and silent
        assert _live_sessions(server) == 0
        with _connect(server, additional_headers=AUTH) as keyed:
            keyed.send(json.dumps(START))
            assert json.loads(keyed.recv(timeout=30))["type"] == "started"
            assert _live_sessions(server) == 1
            with _connect(server, additional_headers=AUTH) as second:  # max_sessions=1
                second.send(json.dumps(START))
                messages, code = _closed(second)
                assert code == 1008 and messages[0]["code"] == "too_many_sessions"
            keyed.send(json.dumps({"type": "stop"}))
        for socket in idle:  # closed by the server once session_start_s passed
            messages, code = _closed(socket)
            assert code == 1008 and messages[0]["code"] == "start_timeout"
            assert f"session_start_s={START_S:g}" in messages[0]["message"]
    assert _live_sessions(server) == 0
    assert settled_pool_state(server) == (True, 0)


def test_the_idle_timer_runs_again_after_an_answer(server):
    with _connect(server, additional_headers=AUTH) as socket:
        socket.send(json.dumps(START))
        assert json.loads(socket.recv(timeout=30))["type"] == "started"
        socket.send(_frame(0.0, seed=5))
        socket.send(_frame(0.5, seed=6))
        assert json.loads(socket.recv(timeout=30))["type"] == "frame"
        socket.send(json.dumps({"type": "ask", "prompt": "What?"}))
        while json.loads(socket.recv(timeout=30))["type"] != "answer":
            pass
        answered = time.monotonic()
        messages, code = _closed(socket)  # silence after the answer
        assert time.monotonic() - answered >= IDLE_S * 0.9
    assert code == 1008 and [m["code"] for m in messages] == ["idle_timeout"]
    assert _live_sessions(server) == 0
    assert settled_pool_state(server) == (True, 0)
