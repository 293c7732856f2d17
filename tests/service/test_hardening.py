"""Hardening: images only as PNG, JPEG or WebP; a Host check and an Origin check; media URLs
only to listed ports and never to private addresses unless listed by address, with compressed
replies inflated a bounded piece at a time; live encodes share the encode worker's bound.
Each refusal does no work."""

import asyncio
import functools
import gzip
import http.server
import io
import json
import socket
import threading
import time
import tracemalloc
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from PIL import Image
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from stillcut.service.config import ServerConfig

from .conftest import (
    assert_error,
    assert_healthy,
    data_url,
    random_frame,
    running_server,
    work_done,
)

CHAT = "/v1/chat/completions"
ALLOWED_ORIGIN = "http://app.example"
BOMB_BYTES = 64 * 2**20
MAX_UPLOAD_BYTES = 2**20


class _Routes(http.server.BaseHTTPRequestHandler):
    """Serves fixed replies by path and records every path asked for."""

    def __init__(self, *args, routes: dict, hits: list, **kwargs) -> None:
        self.routes, self.hits = routes, hits
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:
        self.hits.append((self.path, self.headers["Host"]))
        body, headers = self.routes.get(self.path, (b"", {}))
        self.send_response(200 if self.path in self.routes else 404)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:
        pass


@contextmanager
def _origin_server(routes: dict):
    hits: list[str] = []
    handler = functools.partial(_Routes, routes=routes, hits=hits)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], hits
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tiny_clip):
    gzipped = {"Content-Type": "video/mp4", "Content-Encoding": "gzip"}
    routes = {
        "/clip.mp4": (tiny_clip, {"Content-Type": "video/mp4"}),
        "/clip.gz": (gzip.compress(tiny_clip), gzipped),
        "/bomb": (gzip.compress(bytes(BOMB_BYTES), compresslevel=9), gzipped),
    }
    with _origin_server(routes) as (port, hits), _origin_server(routes) as (other, other_hits):
        config = ServerConfig(
            allowed_hosts=(
                f"127.0.0.1:{port}",
                f"localhost:{port}",
                f"localhost:{other}",
                "127.0.0.2",
            ),
            allowed_origins=(ALLOWED_ORIGIN,),
            max_upload_bytes=MAX_UPLOAD_BYTES,
            max_queue=1,
        )
        with running_server(tiny_checkpoint, config) as server:
            yield {
                "server": server,
                "port": port,
                "other": other,
                "clip": tiny_clip,
                "hit_lists": (hits, other_hits),
            }


def _hits(setup) -> int:
    return sum(len(hits) for hits in setup["hit_lists"])


def _ask(server, kind: str, url: str, headers: dict | None = None) -> httpx.Response:
    part = {"type": kind, kind: {"url": url}}
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
    return httpx.post(f"{server.url}{CHAT}", json=body, headers=headers, timeout=60)


def _refused_without_work(server, send, status: int, code: str, phrase: str) -> None:
    before = work_done(server.url)
    assert_error(send(), status, code, phrase)
    assert work_done(server.url) == before
    assert_healthy(server)


def _image(kind: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((40, 56, 3), 90, np.uint8)).save(buffer, format=kind)
    return buffer.getvalue()


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto 8 8 lineto stroke\n%%EOF\n"


@pytest.mark.parametrize(("name", "data"), [("BMP", None), ("GIF", None), ("EPS", EPS)])
def test_images_other_than_png_jpeg_webp_are_refused(setup, name, data):
    server = setup["server"]
    url = data_url(data or _image(name), "image/png")
    _refused_without_work(
        server, lambda: _ask(server, "image_url", url), 415, "not_an_image", "PNG, JPEG or WebP"
    )


def test_webp_images_are_read(setup):
    response = _ask(setup["server"], "image_url", data_url(_image("WEBP"), "image/webp"))
    assert response.status_code == 200, response.text


def test_a_host_the_server_does_not_answer_to_is_refused(setup):
    server = setup["server"]
    _refused_without_work(
        server,
        lambda: httpx.get(f"{server.url}/v1/models", headers={"Host": "rebound.example"}),
        400,
        "untrusted_host",
        "'rebound.example'",
    )
    host, port = server.url.removeprefix("http://").split(":")
    assert httpx.get(f"{server.url}/v1/models", headers={"Host": f"localhost:{port}"}).is_success
    with socket.create_connection((host, int(port)), timeout=30) as raw:  # a WebSocket handshake
        raw.sendall(
            b"GET /v1/stream HTTP/1.1\r\nHost: rebound.example\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\n\r\n"
        )
        assert raw.recv(65536).startswith(b"HTTP/1.1 403")


def test_a_request_with_two_host_headers_is_refused(setup):
    """RFC 9112: a request with more than one Host is a 400, whichever of them is trusted."""
    server = setup["server"]
    host, port = server.url.removeprefix("http://").split(":")
    for second in (f"127.0.0.1:{port}", "rebound.example"):
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            raw.sendall(
                f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: {second}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            reply = b""
            while chunk := raw.recv(65536):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), reply[:200]
        assert "more than one Host" in json.loads(body)["error"]["message"]


def test_browser_requests_from_other_origins_are_refused(setup):
    server = setup["server"]
    _refused_without_work(
        server,
        lambda: _ask(
            server, "video_url", data_url(setup["clip"]), {"Origin": "http://evil.example"}
        ),
        403,
        "origin_not_allowed",
        "'http://evil.example'",
    )
    for origin in (server.url, ALLOWED_ORIGIN):
        assert _ask(server, "video_url", data_url(setup["clip"]), {"Origin": origin}).is_success
    url = server.url.replace("http://", "ws://") + "/v1/stream"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, proxy=None, origin="http://evil.example", open_timeout=30)
    assert refused.value.response.status_code == 403
    with connect(url, proxy=None, origin=server.url, open_timeout=30) as live:
        live.send(json.dumps({"type": "start"}))
        assert json.loads(live.recv(timeout=30))["type"] == "started"
    assert_healthy(server)


def test_media_urls_reach_only_listed_ports_and_public_addresses(setup):
    server, port, other = setup["server"], setup["port"], setup["other"]
    hits = _hits(setup)
    _refused_without_work(  # "127.0.0.2" is listed without a port: port 80 only
        server,
        lambda: _ask(server, "video_url", f"http://127.0.0.2:{port}/clip.mp4"),
        400,
        "url_not_allowed",
        f"port {port} is not in the server's allowed hosts",
    )
    _refused_without_work(  # "localhost:other" is listed by name, not by its address
        server,
        lambda: _ask(server, "video_url", f"http://localhost:{other}/clip.mp4"),
        400,
        "url_not_allowed",
        "resolves to 127.0.0.1, a loopback, link-local or private address",
    )
    assert _hits(setup) == hits  # nothing was fetched
    for path in ("/clip.mp4", "/clip.gz"):  # listed by address; a gzip reply is inflated
        assert _ask(server, "video_url", f"http://127.0.0.1:{port}{path}").is_success
    assert _hits(setup) == hits + 2
    if socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)[0][4][0] == "127.0.0.1":
        # a name whose address is listed: fetched from that address, still named in Host
        assert _ask(server, "video_url", f"http://localhost:{port}/clip.mp4").is_success
        assert setup["hit_lists"][0][-1] == ("/clip.mp4", f"localhost:{port}")


def test_a_compressed_reply_is_inflated_a_bounded_piece_at_a_time(setup):
    """64 MiB of zeros in 64 KiB of gzip: refused at the 1 MiB cap, never held whole."""
    server = setup["server"]
    tracemalloc.start()
    try:
        response = _ask(server, "video_url", f"http://127.0.0.1:{setup['port']}/bomb")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_error(response, 413, "payload_too_large", f"exceeds the limit of {MAX_UPLOAD_BYTES}")
    assert peak < 16 * 2**20, peak
    assert_healthy(server)


def test_live_frames_wait_for_the_encode_worker_like_everything_else(setup):
    """With max_queue=1 and the encode worker busy, a live frame is turned away (queue_full)
    rather than encoded beside it; once the worker is free, frames are encoded again."""
    server = setup["server"]
    encoder = server.app.state.service.encoder
    release = threading.Event()
    busy = threading.Thread(target=lambda: asyncio.run(encoder.run(lambda: release.wait(60))))
    url = server.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url, proxy=None, open_timeout=30) as live:
        live.send(json.dumps({"type": "start"}))
        assert json.loads(live.recv(timeout=30))["type"] == "started"
        busy.start()
        try:
            while encoder.num_pending == 0:
                time.sleep(0.01)
            live.send(random_frame(0.0, seed=1))
            error = json.loads(live.recv(timeout=30))
            assert error["type"] == "error" and error["code"] == "queue_full"
        finally:
            release.set()
            busy.join()
        live.send(random_frame(0.5, seed=2))
        live.send(random_frame(1.0, seed=3))
        assert json.loads(live.recv(timeout=30))["type"] == "frame"
        live.send(json.dumps({"type": "stop"}))
    assert_healthy(server)
