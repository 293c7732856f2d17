"""Deadlines and bounds: a body that does not arrive in time gets 408, connections past the
cap get 503, a huge prompt is tokenized off the event loop (the server keeps answering), stop
strings, JSON depth and image pixels are bounded. Each refusal does no work."""

import json
import socket
import struct
import threading
import time
import zlib

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from stillcut.service.config import ServerConfig

from .conftest import assert_error, assert_healthy, data_url, running_server, work_done

BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 6
CHAT = "/v1/chat/completions"
DESCRIBE = "/v1/videos/describe"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    config = ServerConfig(body_timeout_s=BODY_TIMEOUT_S, max_connections=MAX_CONNECTIONS)
    with running_server(tiny_checkpoint, config) as server:
        yield server


def _address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _chat(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{CHAT}", json=body, timeout=60)


def _refused_without_work(server, send, status: int, code: str, phrase: str) -> None:
    before = work_done(server.url)
    assert_error(send(), status, code, phrase)
    assert work_done(server.url) == before
    assert_healthy(server)


@pytest.mark.parametrize("content_type", ["application/json", "multipart/form-data; boundary=b"])
def test_a_body_that_does_not_arrive_in_time_gets_408(server, content_type):
    path = CHAT if content_type == "application/json" else DESCRIBE
    host, port = _address(server)
    before = work_done(server.url)
    with socket.create_connection((host, port), timeout=30) as connection:
        connection.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
            "Content-Length: 100000\r\n\r\n".encode()
            + b"--b" * 10
        )
        reply = b""
        while data := connection.recv(65536):  # the server answers, then closes
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert (
        error["code"] == "body_timeout" and f"body_timeout_s={BODY_TIMEOUT_S:g}" in error["message"]
    )
    assert work_done(server.url) == before
    assert_healthy(server)


def test_connections_past_the_cap_get_503(server):
    host, port = _address(server)
    idle = [socket.create_connection((host, port), timeout=30) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # let the server register them
        response = httpx.get(f"{server.url}/v1/models", timeout=30)
        assert response.status_code == 503
    finally:
        for connection in idle:
            connection.close()
    for _ in range(100):  # the server notices the closed connections
        if httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 200:
            break
        time.sleep(0.05)
    assert_healthy(server)


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    """2.7 MB of text, refused as too long; /health keeps answering while it is tokenized (it
    counts the prompt as waiting then), which it could not if the event loop were stalled."""
    body = {"messages": [{"role": "user", "content": "lorem ipsum dolor " * 150_000}]}
    waiting, done = [], threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not done.is_set():
                waiting.append(client.get("/health").json()["requests_waiting"])

    poller = threading.Thread(target=poll)
    before = work_done(server.url)
    poller.start()
    try:
        response = _chat(server, body)
    finally:
        done.set()
        poller.join()
    assert_error(response, 400, "context_length_exceeded", "max_model_len")
    assert sum(count > 0 for count in waiting) >= 6, waiting
    assert work_done(server.url) == before
    assert_healthy(server)


@pytest.mark.parametrize(
    ("stop", "phrase"),
    [
        (["x"] * 17, "17 strings; at most 16"),
        (["x" * 257], "257 characters; at most 256"),
        (["x"] * 300_000, "300000 strings; at most 16"),
    ],
)
def test_stop_strings_are_bounded(server, stop, phrase):
    body = {"messages": [{"role": "user", "content": "Hi"}], "stop": stop}
    _refused_without_work(server, lambda: _chat(server, body), 400, "invalid_parameter", phrase)
    files = {"file": ("v.mp4", b"\0", "video/mp4")}
    data = {"stop": stop[:20]}
    if len(stop) <= 20:
        _refused_without_work(
            server,
            lambda: httpx.post(f"{server.url}{DESCRIBE}", files=files, data=data, timeout=60),
            400,
            "invalid_parameter",
            phrase,
        )
    url = server.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url, proxy=None, max_size=None) as live:
        live.send(json.dumps({"type": "start", "stop": stop[:20]}))
        error = json.loads(live.recv(timeout=30))
        with pytest.raises(ConnectionClosed) as closed:
            live.recv(timeout=30)
    assert error["code"] == "bad_start" and "at most" in error["message"]
    assert closed.value.rcvd.code == 1008


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_json_deeper_than_64_levels_is_refused(server):
    deep = '{"messages": ' + _nested(64) + "}"  # 65 levels
    _refused_without_work(
        server,
        lambda: httpx.post(
            f"{server.url}{CHAT}", content=deep, headers={"content-type": "application/json"}
        ),
        400,
        "json_too_deep",
        "64 levels",
    )
    at_limit = '{"messages": ' + _nested(63) + "}"  # 64 levels: parsed, then checked
    _refused_without_work(
        server,
        lambda: httpx.post(
            f"{server.url}{CHAT}", content=at_limit, headers={"content-type": "application/json"}
        ),
        400,
        "invalid_messages",
        "messages[0] must be an object",
    )


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def test_images_over_the_pixel_cap_are_refused_from_their_header(server):
    image = {
        "type": "image_url",
        "image_url": {"url": data_url(_png_header(5000, 4000), "image/png")},
    }
    body = {"messages": [{"role": "user", "content": [image]}]}
    _refused_without_work(
        server,
        lambda: _chat(server, body),
        413,
        "media_over_limit",
        "5000x4000 = 20000000 pixels, over max_image_pixels=16777216",
    )


def test_a_prompt_within_bounds_is_answered(server):
    """The bounds leave ordinary requests alone."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "stop": ["x"] * 16, "max_tokens": 2}
    assert _chat(server, body).status_code == 200
