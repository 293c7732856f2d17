"""Servers for the service tests: real uvicorn on 127.0.0.1 at free ports, tiny checkpoint.

`main_server` is shared by the test files (its media folder holds a tiny clip; a local static
file server is its one allowed http host); tests that need other settings start their own.
`reference_llm` computes, offline, what the server should answer.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import io
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.service.api import VideoLLM
from stillcut.service.config import ServerConfig
from stillcut.service.server import BackgroundServer
from stillcut.vision.decode import DecodeConfig
from stillcut.vision.synthetic import moving_texture, write_video

MAX_MODEL_LEN = 2048
MAX_VISUAL_TOKENS = 512
MAX_UPLOAD_BYTES = 256 * 1024
MAX_DURATION_S = 30.0
ENGINE_CONFIG = EngineConfig(
    scheduler=SchedulerConfig(
        max_num_batched_tokens=2048,
        max_model_len=MAX_MODEL_LEN,
        max_visual_tokens_per_request=MAX_VISUAL_TOKENS,
    ),
    cache=CacheConfig(num_blocks=512, block_size=16),
)
DECODE_CONFIG = DecodeConfig(max_duration_s=MAX_DURATION_S)


def make_llm(checkpoint: Path, engine_config: EngineConfig = ENGINE_CONFIG) -> VideoLLM:
    return VideoLLM(checkpoint, engine_config=engine_config, decode_config=DECODE_CONFIG)


@contextmanager
def running_server(
    checkpoint: Path, config: ServerConfig, engine_config: EngineConfig = ENGINE_CONFIG
) -> Iterator[BackgroundServer]:
    """A server for a fresh tiny model, stopped (gracefully) on exit."""
    server = BackgroundServer(make_llm(checkpoint, engine_config), config)
    try:
        yield server
    finally:
        server.stop()


def data_url(data: bytes, media_type: str = "video/mp4") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


# a narration's start message: every tubelet in order, EVS off, short segments
NARRATE_START = {
    "type": "start",
    "mode": "narrate",
    "prompt": "Say what you see.",
    "lag": "queue",
    "threshold": None,
    "max_tokens_per_segment": 3,
}


def png_frame(timestamp: float, pixels: np.ndarray) -> bytes:
    """A live-stream frame: the timestamp, then `pixels` [H, W, 3] uint8 as PNG."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return struct.pack("<d", timestamp) + buffer.getvalue()


def random_frame(timestamp: float, seed: int) -> bytes:
    """A live-stream frame: the timestamp, then a random 84x56 PNG."""
    pixels = np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    return png_frame(timestamp, pixels)


def engine_call(server: BackgroundServer, fn):
    """Run `fn(llm_engine)` on the server's engine thread, from the test's thread."""
    engine = server.app.state.service.engine
    return asyncio.run(engine.call(fn))


def plant_step_failure(llm_engine, error: type[BaseException] = RuntimeError) -> None:
    """Make the engine's next step that runs requests raise `error` once, after its forward, as
    a request the sampler cannot take would (its rows, blocks and K/V are then in use). Call it
    on the engine thread when the engine is served (`engine_call`)."""
    runner = llm_engine.runner
    execute = runner.execute

    def fails_once(output):
        if not output.num_scheduled_tokens:
            return execute(output)
        del runner.execute
        execute(output)
        raise error("planted: Overflow when unpacking long long")

    runner.execute = fails_once


def pool_state(server: BackgroundServer) -> tuple[bool, int]:
    """(engine idle, KV blocks referenced), after checking the pool's invariants."""

    def check(llm_engine):
        kv = llm_engine.scheduler.kv_cache
        kv.check_consistency()
        return not llm_engine.scheduler.requests, sum(b.ref_cnt > 0 for b in kv.block_pool.blocks)

    return engine_call(server, check)


def work_done(url: str, headers: dict | None = None) -> tuple[int, int]:
    """(frames decoded, vision tower passes) so far, as the server's /metrics reports them."""
    text = httpx.get(f"{url}/metrics", headers=headers).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return (
        int(float(values["stillcut_frames_decoded_total"])),
        int(float(values["stillcut_vision_tower_passes_total"])),
    )


def assert_error(response: httpx.Response, status: int, code: str, phrase: str) -> dict:
    """The documented error shape, with this status, code and a message holding `phrase`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "request_id"}, error
    assert error["code"] == code and phrase in error["message"], error
    assert error["request_id"] == response.headers["x-request-id"]
    assert "object at 0x" not in error["message"]
    return error


def assert_healthy(server: BackgroundServer, headers: dict | None = None) -> None:
    """/health answers 200 with what the weights and the KV pool are stored in and take, the
    arithmetic of prefill and the tower (and why), and, once the engine settles, every KV
    block is back."""
    response = httpx.get(f"{server.url}/health", headers=headers)
    assert response.status_code == 200
    body = response.json()
    assert body["weight_format"] and body["kv_cache_dtype"] in ("float32", "bfloat16")
    assert body["arithmetic"]["dtype"] in ("float32", "bfloat16") and body["arithmetic"]["reason"]
    assert min(body["weight_bytes"], body["vision_weight_bytes"], body["kv_cache_bytes"]) > 0
    assert settled_pool_state(server) == (True, 0)


def settled_pool_state(server: BackgroundServer, timeout_s: float = 10.0) -> tuple[bool, int]:
    """`pool_state` once the engine is idle and every block is back, or when `timeout_s`
    passes: a client that closed its socket has its session released a moment later."""
    deadline = time.monotonic() + timeout_s
    while (state := pool_state(server)) != (True, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    return state


@dataclass(frozen=True)
class MainServer:
    server: BackgroundServer
    llm: VideoLLM
    media_dir: Path
    clip: bytes  # a tiny video, also at media_dir / "clip.mp4"
    http_url: str  # the static file server (an allowed host) serving media_dir

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> bytes:
    """A 3 s, 12-frame 112x84 H.264 clip: 6 frames sampled at 2 fps, 3 tubelets."""
    path = tmp_path_factory.mktemp("clip") / "clip.mp4"
    write_video(path, moving_texture(12, 112, 84, seed=3), time_base=Fraction(1, 4))
    return path.read_bytes()


@pytest.fixture(scope="session")
def reference_llm(tiny_checkpoint) -> VideoLLM:
    return make_llm(tiny_checkpoint)


@pytest.fixture(scope="session")
def main_server(tiny_checkpoint, tiny_clip, tmp_path_factory):
    media_dir = tmp_path_factory.mktemp("media")
    (media_dir / "clip.mp4").write_bytes(tiny_clip)
    with _StaticServer(media_dir) as http_url:
        host = http_url.removeprefix("http://")
        config = ServerConfig(
            media_dir=media_dir,
            allowed_hosts=(host,),
            max_upload_bytes=MAX_UPLOAD_BYTES,
            max_message_bytes=MAX_UPLOAD_BYTES,
            fetch_timeout_s=10.0,
        )
        with running_server(tiny_checkpoint, config) as server:
            llm = server.app.state.service.llm
            yield MainServer(server, llm, media_dir, tiny_clip, http_url)


class _StaticServer:
    def __init__(self, folder: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(folder))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:
        pass
