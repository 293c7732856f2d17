"""Hostile and broken input: every case gets the right status (or WebSocket close code) and a
message that says what was wrong; afterwards the server still answers /health and its KV block
pool is whole."""

import io
import json
import socket
import struct
import time
from dataclasses import dataclass, field
from fractions import Fraction

import httpx
import numpy as np
import pytest
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from stillcut.vision.synthetic import moving_texture, write_video

from .conftest import MAX_DURATION_S, MAX_UPLOAD_BYTES, data_url, pool_state

DESCRIBE = "/v1/videos/describe"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    status: int
    phrase: str  # part of the error message a user needs
    files: dict | None = None
    data: dict = field(default_factory=dict)
    json_body: dict | None = None
    content: bytes | None = None
    headers: dict = field(default_factory=dict)


def _long_clip(tmp_path) -> bytes:
    """Two frames 40 s apart: tiny, but longer than the server's max_duration_s."""
    path = tmp_path / "long.mp4"
    frames = list(moving_texture(2, 64, 48))
    write_video(path, frames, pts=[0, 40], time_base=Fraction(1, 1))
    return path.read_bytes()


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((48, 64, 3), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _chat(url: str, text: str = "What?", **extra) -> dict:
    parts = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2, **extra}


def video(data: bytes, kind: str = "video/mp4") -> dict:
    return {"file": ("v.mp4", data, kind)}


def _cases(main_server, samples_dir, tmp_path) -> list[Case]:
    clip = main_server.clip
    outside = main_server.media_dir.parent / "outside.mp4"
    outside.write_bytes(clip)
    sample = (samples_dir / "moving_object.mp4").read_bytes()
    return [
        Case(
            "oversized upload",
            DESCRIBE,
            413,
            "exceeds the limit",
            video(b"\0" * (MAX_UPLOAD_BYTES + 70_000)),
        ),
        Case(
            "wrong request content type",
            DESCRIBE,
            415,
            "multipart/form-data",
            json_body={"prompt": "x"},
        ),
        Case("wrong file content type", DESCRIBE, 415, "video/*", video(clip, "text/plain")),
        Case("an image as the video", DESCRIBE, 415, "still image", video(_png(), "video/mp4")),
        Case(
            "corrupt video",
            DESCRIBE,
            422,
            "not a readable video",
            video(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8),
        ),
        Case(
            "video over the duration limit",
            DESCRIBE,
            413,
            f"max_duration_s={MAX_DURATION_S:g}",
            video(_long_clip(tmp_path)),
        ),
        Case("missing file", DESCRIBE, 400, "'file' field", {"prompt": (None, "x")}),
        Case(
            "unknown form field",
            DESCRIBE,
            400,
            "unknown form field",
            video(clip),
            {"colour": "red"},
        ),
        Case("bad number", DESCRIBE, 400, "max_tokens", video(clip), {"max_tokens": "many"}),
        Case(
            "bad sampling value", DESCRIBE, 400, "temperature", video(clip), {"temperature": "-1"}
        ),
        Case("bad evs", DESCRIBE, 400, "threshold", video(clip), {"evs": '{"mode": "threshold"}'}),
        Case(
            "malformed JSON body",
            CHAT,
            400,
            "not valid JSON",
            content=b'{"messages": [',
            headers={"content-type": "application/json"},
        ),
        Case(
            "chat as text/plain",
            CHAT,
            415,
            "application/json",
            content=b"{}",
            headers={"content-type": "text/plain"},
        ),
        Case(
            "bad data URL",
            CHAT,
            400,
            "invalid base64",
            json_body=_chat("data:video/mp4;base64,@@@not base64@@@"),
        ),
        Case(
            "data URL not base64",
            CHAT,
            400,
            "base64 data URL",
            json_body=_chat("data:video/mp4,rawbytes"),
        ),
        Case(
            "data URL of text",
            CHAT,
            415,
            "text/plain",
            json_body=_chat(data_url(b"hi", "text/plain")),
        ),
        Case(
            "data URL over the limit",
            CHAT,
            413,
            "exceeds the limit",
            json_body=_chat(data_url(b"\0" * (MAX_UPLOAD_BYTES + 3))),
        ),
        Case(
            "file:// outside the media folder",
            CHAT,
            400,
            "outside the server's media folder",
            json_body=_chat(outside.as_uri()),
        ),
        Case(
            "file:// escaping with ..",
            CHAT,
            400,
            "outside",
            json_body=_chat(f"file://{main_server.media_dir}/../outside.mp4"),
        ),
        Case(
            "unlisted http host",
            CHAT,
            400,
            "not in the server's allowed hosts",
            json_body=_chat("http://example.com/v.mp4"),
        ),
        Case(
            "unsupported scheme",
            CHAT,
            400,
            "scheme 'ftp'",
            json_body=_chat("ftp://example.com/v.mp4"),
        ),
        Case(
            "unsupported parameter",
            CHAT,
            400,
            "tools",
            json_body={**_chat(data_url(clip)), "tools": []},
        ),
        Case(
            "bad role",
            CHAT,
            400,
            "role",
            json_body={"messages": [{"role": "robot", "content": "x"}]},
        ),
        Case(
            "prompt over max_model_len",
            CHAT,
            400,
            "max_model_len",
            json_body={"messages": [{"role": "user", "content": "hello " * 2500}]},
        ),
        Case(
            "too many visual tokens",
            CHAT,
            400,
            "max_visual_tokens_per_request",
            json_body=_chat(data_url(sample), evs="off"),
        ),
        Case("unknown route", "/v1/nothing", 404, "Not Found", json_body={}),
    ]


def test_hostile_inputs_get_the_right_status(main_server, samples_dir, tmp_path):
    with httpx.Client(base_url=main_server.url, timeout=30) as client:
        for case in _cases(main_server, samples_dir, tmp_path):
            response = client.post(
                case.path,
                files=case.files,
                data=case.data,
                json=case.json_body,
                content=case.content,
                headers=case.headers,
            )
            assert response.status_code == case.status, (case.name, response.text)
            error = response.json()["error"]
            assert case.phrase in error["message"], (case.name, error)
            assert error["request_id"] == response.headers["x-request-id"]
        assert client.get("/health").json()["status"] == "ok"
    assert pool_state(main_server.server) == (True, 0)


def test_an_oversized_upload_is_refused_before_it_ends(main_server):
    """Chunked, with no Content-Length, and never finished: only a server that counts bytes
    as they arrive can answer at all."""
    host, port = main_server.url.removeprefix("http://").split(":")
    head = (
        'Content-Disposition: form-data; name="file"; filename="v.mp4"\r\n'
        "Content-Type: video/mp4\r\n\r\n"
    )
    chunks = [f"--b\r\n{head}".encode()] + [b"\0" * 65536] * (MAX_UPLOAD_BYTES // 65536 + 4)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(
            f"POST {DESCRIBE} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\n\r\n".encode()
        )
        for chunk in chunks:
            connection.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        reply = b""
        while b"}}" not in reply and (data := connection.recv(65536)):
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"exceeds the limit" in reply
    assert httpx.get(f"{main_server.url}/health").status_code == 200


def _ws(main_server, **options):
    url = main_server.url.replace("http://", "ws://") + "/v1/stream"
    return connect(url, proxy=None, max_size=None, **options)


def _closed_with(socket, code) -> str:
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            socket.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == code
    return closed.value.rcvd.reason


def _frame(timestamp: float, image: bytes) -> bytes:
    return struct.pack("<d", timestamp) + image


def test_websocket_protocol_errors(main_server):
    start = json.dumps({"type": "start", "threshold": 0.1})
    with _ws(main_server) as socket:  # a binary frame that is not an image
        socket.send(start)
        assert json.loads(socket.recv(timeout=30))["type"] == "started"
        socket.send(_frame(0.0, b"not an image at all"))
        error = json.loads(socket.recv(timeout=30))
        assert error["type"] == "error" and "PNG or JPEG" in error["message"]
        _closed_with(socket, 1003)
    with _ws(main_server) as socket:  # a message over the size limit
        socket.send(start)
        socket.recv(timeout=30)
        socket.send(_frame(0.0, b"\0" * (MAX_UPLOAD_BYTES + 1)))
        _closed_with(socket, 1009)
    with _ws(main_server) as socket:  # ask before any frame: reported, the session goes on
        socket.send(start)
        socket.recv(timeout=30)
        socket.send(json.dumps({"type": "ask", "prompt": "What moves?"}))
        error = json.loads(socket.recv(timeout=30))
        assert error == {"type": "error", "code": "no_frame_yet", "message": error["message"]}
        assert "before any frame" in error["message"]
        socket.send(json.dumps({"type": "stop"}))
        _closed_with(socket, 1000)
    for first in (b"\0" * 16, json.dumps({"type": "ask", "prompt": "x"})):  # not a start
        with _ws(main_server) as socket:
            socket.send(first)
            assert json.loads(socket.recv(timeout=30))["code"] == "bad_start"
            _closed_with(socket, 1008)
    with _ws(main_server) as socket:  # bad start options
        socket.send(json.dumps({"type": "start", "threshold": 7}))
        assert "threshold" in json.loads(socket.recv(timeout=30))["message"]
        _closed_with(socket, 1008)
    with _ws(main_server) as socket:  # text that is not JSON
        socket.send(start)
        socket.recv(timeout=30)
        socket.send("{not json")
        assert json.loads(socket.recv(timeout=30))["code"] == "bad_message"
        _closed_with(socket, 1003)
    assert httpx.get(f"{main_server.url}/health").json()["live_sessions"] == 0
    assert pool_state(main_server.server) == (True, 0)


def test_a_websocket_frame_gets_its_tubelet_event(main_server):
    frames = list(moving_texture(2, 84, 56, seed=1))
    pngs = []
    for frame in frames:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    with _ws(main_server) as socket:
        socket.send(json.dumps({"type": "start", "threshold": 0.1, "max_tokens": 3}))
        socket.recv(timeout=30)
        socket.send(_frame(0.0, pngs[0]))
        socket.send(_frame(0.5, pngs[1]))
        event = json.loads(socket.recv(timeout=30))
        assert event["type"] == "frame" and event["tubelet"] == 0 and event["t"] == 0.0
        assert event["kept"] == event["total"] > 0  # the first tubelet is always kept
        socket.send(json.dumps({"type": "ask", "prompt": "What?"}))
        messages = []
        while not messages or messages[-1]["type"] != "answer":
            messages.append(json.loads(socket.recv(timeout=30)))
        answer = messages[-1]
        assert answer["text"] == "".join(m["text"] for m in messages if m["type"] == "token")
        assert answer["usage"]["completion_tokens"] == 3
        assert set(answer["timings"]) == {"queue_s", "ttft_s", "total_s"}
    # the client closed the socket: the server releases the session's prefix once it sees that
    for _ in range(200):
        if pool_state(main_server.server) == (True, 0):
            break
        time.sleep(0.05)
    assert pool_state(main_server.server) == (True, 0)
