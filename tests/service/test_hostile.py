"""Hostile and broken input: every case gets the right status (or WebSocket close code) and a
message that says what was wrong, without a heap address; afterwards the server still answers
/health and its KV block pool is whole. Inputs that used to crash a handler (500, a dropped
connection) get their 4xx on a connection that stays open, and do no work."""

import asyncio
import http.client
import io
import json
import logging
import socket
import struct
import zlib
from dataclasses import dataclass, field
from fractions import Fraction

import httpx
import numpy as np
import pytest
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from stillcut.vision.synthetic import gray_frames, moving_texture, write_video

from .conftest import (
    MAX_DURATION_S,
    MAX_UPLOAD_BYTES,
    assert_error,
    assert_healthy,
    data_url,
    pool_state,
    settled_pool_state,
    work_done,
)

DESCRIBE = "/v1/videos/describe"
CHAT = "/v1/chat/completions"
INTERNALS = ("object at 0x", "sys.", "_ssl.c", "long long", "Traceback")


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


def _gif() -> bytes:
    """An animated GIF: 6 frames, 4 per second."""
    frames = [Image.fromarray(frame) for frame in moving_texture(6, 112, 84, seed=5)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=250)
    return buffer.getvalue()


def test_an_animated_gif_sent_as_image_gif_is_described_as_a_video(main_server):
    files = {"file": ("loop.gif", _gif(), "image/gif")}
    response = httpx.post(
        f"{main_server.url}{DESCRIBE}", files=files, data={"max_tokens": "2"}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["evs"]["frames"] >= 2


def _escaped(body: dict) -> bytes:
    """JSON with every non-ASCII character escaped: lone surrogates as `\\ud800`."""
    return json.dumps(body).encode()


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
        Case(
            "a lone surrogate in a message",
            CHAT,
            400,
            "lone surrogate",
            content=_escaped({"messages": [{"role": "user", "content": "What? \ud800"}]}),
            headers={"content-type": "application/json"},
        ),
        Case(
            "a lone surrogate in a file:// URL",
            CHAT,
            400,
            "lone surrogate",
            content=_escaped(_chat(f"file://{main_server.media_dir}/\udcff.mp4")),
            headers={"content-type": "application/json"},
        ),
        Case(
            "a template global as a template variable",
            CHAT,
            400,
            "['namespace'] are set by the server",
            json_body={**_chat(data_url(clip)), "chat_template_kwargs": {"namespace": 1}},
        ),
        Case(
            "a prompt over 64 KiB",
            DESCRIBE,
            400,
            "may hold at most 64 KiB each",
            video(clip),
            {"prompt": "x" * 70_000},
        ),
        Case(
            "a GIF as an image",
            CHAT,
            415,
            "send a GIF as a video",
            json_body={
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": data_url(_gif(), "image/gif")},
                            }
                        ],
                    }
                ]
            },
        ),
        Case(
            "https to a server that speaks http",
            CHAT,
            400,
            "the TLS handshake failed",
            json_body=_chat(main_server.http_url.replace("http://", "https://") + "/clip.mp4"),
        ),
        Case(
            "a number of 5000 digits",
            CHAT,
            400,
            "more than 4300 digits",
            content=b'{"messages": [], "max_tokens": ' + b"7" * 5000 + b"}",
            headers={"content-type": "application/json"},
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
            assert not any(word in error["message"] for word in INTERNALS), (case.name, error)
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
        assert "object at 0x" not in error["message"]
        assert "object at 0x" not in _closed_with(socket, 1003)
    with _ws(main_server) as socket:  # JSON nested past the limit: unsupported data, not 1011
        socket.send(start)
        socket.recv(timeout=30)
        socket.send("[" * 30_000 + "]" * 30_000)
        assert json.loads(socket.recv(timeout=30))["code"] == "bad_message"
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
    with _ws(main_server) as socket:  # a lone surrogate: not text, so not a question
        socket.send(start)
        socket.recv(timeout=30)
        socket.send('{"type": "ask", "prompt": "What \\ud800?"}')
        error = json.loads(socket.recv(timeout=30))
        assert error["code"] == "bad_message" and "lone surrogate" in error["message"]
        _closed_with(socket, 1003)
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
    assert settled_pool_state(main_server.server) == (True, 0)


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` and holds no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def _thin_clip(tmp_path) -> bytes:
    path = tmp_path / "thin.mp4"  # 2 x 800: an aspect ratio of 400
    write_video(path, gray_frames([50, 60, 70, 80], 2, 800))
    return path.read_bytes()


def _chat_body(*parts: dict) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 2}


def _media(kind: str, url: str) -> dict:
    return {"type": kind, kind: {"url": url}}


def _crash_cases(main_server, tmp_path) -> list[tuple[httpx.Request, int, str, str]]:
    """(request, status, code, phrase): each of these answered 500 and dropped the connection."""
    url = main_server.url

    def chat(body) -> httpx.Request:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.Request(
            "POST", f"{url}{CHAT}", content=content, headers={"content-type": "application/json"}
        )

    def describe(data: bytes, **fields) -> httpx.Request:
        files = {"file": ("v.mp4", data, "video/mp4")}
        return httpx.Request("POST", f"{url}{DESCRIBE}", files=files, data=fields)

    nested = "[" * 30_000 + "]" * 30_000
    text = {"type": "text", "text": "x"}
    return [
        (chat({"messages": [{"role": ["user"], "content": "x"}]}), 400, "invalid_messages", "role"),
        (chat(_chat_body({"type": ["text"]})), 400, "invalid_messages", "type=['text']"),
        (chat(b"[" * 100_000), 400, "json_too_deep", "64 levels"),
        (describe(main_server.clip, evs=nested), 400, "json_too_deep", "64 levels"),
        (
            chat(_chat_body(_media("video_url", f"file://{main_server.media_dir}/%00x"), text)),
            400,
            "invalid_url",
            "NUL",
        ),
        (
            chat(_chat_body(_media("video_url", "http://127.0.0.1:99999/v.mp4"), text)),
            400,
            "invalid_url",
            "Port",
        ),
        (
            chat(_chat_body(_media("video_url", "http://[::1/v.mp4"), text)),
            400,
            "invalid_url",
            "IPv6",
        ),
        (describe(_thin_clip(tmp_path)), 422, "unsupported_aspect_ratio", "aspect ratio 400"),
        (
            chat(_chat_body(_media("image_url", data_url(_png_header(15000, 15000), "image/png")))),
            413,
            "media_over_limit",
            "max_image_pixels",
        ),
    ]


def test_requests_that_crashed_a_handler_get_a_4xx_on_the_same_connection(main_server, tmp_path):
    host, port = main_server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.connect()
    tcp = connection.sock
    try:
        for request, status, code, phrase in _crash_cases(main_server, tmp_path):
            before = work_done(main_server.url)
            body = request.read()
            connection.request(
                request.method, request.url.raw_path.decode(), body, dict(request.headers)
            )
            reply = connection.getresponse()
            response = httpx.Response(
                reply.status, headers=reply.getheaders(), content=reply.read()
            )
            assert_error(response, status, code, phrase)
            assert not reply.will_close and connection.sock is tcp, code  # kept alive
            assert work_done(main_server.url) == before, code
    finally:
        connection.close()
    assert_healthy(main_server.server)


def test_a_client_leaving_mid_upload_is_logged_once_as_499(main_server, caplog):
    host, port = main_server.url.removeprefix("http://").split(":")
    head = (
        f"POST {DESCRIBE} HTTP/1.1\r\nHost: {host}:{port}\r\nX-Request-Id: leaves-mid-upload\r\n"
        "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n"
    )
    with caplog.at_level(logging.INFO):
        with socket.create_connection((host, int(port)), timeout=30) as connection:
            part = (
                '--b\r\nContent-Disposition: form-data; name="file"; filename="v.mp4"\r\n'
                "Content-Type: video/mp4\r\n\r\n"
            )
            connection.sendall((head + part).encode() + b"\0" * 1000)
        for _ in range(200):  # the line is written once the handler has unwound
            if any("leaves-mid-upload" in r.getMessage() for r in caplog.records):
                break
            asyncio.run(asyncio.sleep(0.02))
    lines = [r for r in caplog.records if "leaves-mid-upload" in r.getMessage()]
    assert [(r.name, r.levelno, json.loads(r.getMessage())["status"]) for r in lines] == [
        ("stillcut.access", logging.INFO, 499)
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert_healthy(main_server.server)


@pytest.mark.parametrize("error", [KeyError, ValueError, ZeroDivisionError])
def test_an_unexpected_error_is_a_500_logged_with_one_traceback(
    main_server, monkeypatch, caplog, error
):
    def broken(*args, **kwargs):
        raise error("planted")

    monkeypatch.setattr(main_server.llm.processor, "build", broken)
    with caplog.at_level(logging.INFO):
        response = httpx.post(
            f"{main_server.url}{CHAT}",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            timeout=30,
        )
    assert_error(response, 500, "internal_error", "internal server error")
    assert "planted" not in response.text
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
    assert tracebacks[0].exc_info[0] is error
