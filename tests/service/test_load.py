"""Under hostile load the server stays bounded: 50 clients trickling request bodies, 20
WebSockets that never send a key, 8 more sending an 8 MB start without one, a 40 MB JSON bomb
and a prompt near the context length, while 16 clients ask about videos and 4 send short chats.
Every normal request is answered, every slow one gets 408, the bomb a 400 and the big starts a
1009 before any of them is parsed, no key-less socket takes a session slot (all of them are
open while every slot is taken by keyed sessions), the event loop never lags 2 s behind a timer,
and afterwards every KV block, session slot and queue place is back, no temporary file or
descriptor is left open and the thread count returns to where it was."""

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from stillcut.service.config import ServerConfig
from stillcut.vision.synthetic import moving_texture, write_video

from .conftest import ENGINE_CONFIG, MAX_MODEL_LEN, running_server, settled_pool_state

KEY = "sk-load"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_SLOW, NUM_KEYLESS, NUM_NORMAL = 50, 20, 16
BODY_TIMEOUT_S = 1.5
MAX_SESSIONS = 4
SETTLE_S = 5.0  # threads and descriptors must be back within this
TIMEOUT_S = 120.0  # the whole load, bounded
PROC_SELF = Path("/proc/self")
POOL_LIMIT = 40  # the handlers' thread pool: its limiter's default size
NUM_BIG_STARTS, BIG_START_BYTES = 8, 8_000_000  # under max_message_bytes (8 MiB)
BOMB_VALUES = 20_000_000  # 40 MB of numbers: under the body limit, over the bound on values
NUM_SHORT = 4
MAX_LAG_S = 2.0
PREFILL_CAP = 256
LOAD_ENGINE = dataclasses.replace(
    ENGINE_CONFIG,
    scheduler=dataclasses.replace(
        ENGINE_CONFIG.scheduler, max_prefill_tokens_per_request=PREFILL_CAP
    ),
)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[bytes]:
    folder = tmp_path_factory.mktemp("load")
    for seed in range(NUM_NORMAL + 1):  # distinct, so each one is decoded and encoded
        path = folder / f"{seed}.mp4"
        write_video(path, moving_texture(4, 112, 84, seed=100 + seed), time_base=Fraction(1, 4))
    return [(folder / f"{seed}.mp4").read_bytes() for seed in range(NUM_NORMAL + 1)]


def _threads() -> int:
    """Threads of this process, native ones included (the server runs in it), less the idle
    workers of the thread pool request handlers borrow: that pool grows with how many uploads
    happened to overlap and lets an idle worker go only when it is next used, so its size is
    bounded by its limiter, not by this load (`_pool_workers`)."""
    return len(os.listdir(PROC_SELF / "task")) - _pool_workers()


def _pool_workers() -> int:
    return sum(thread.name == "AnyIO worker thread" for thread in threading.enumerate())


def _open_files(folder: Path) -> tuple[int, int]:
    """(descriptors open, of which files under `folder`, deleted temporary files included)."""
    links = []
    for fd in os.listdir(PROC_SELF / "fd"):
        try:
            links.append(os.readlink(PROC_SELF / "fd" / fd))
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)
    return len(links), sum(link.startswith(str(folder)) for link in links)


def _no_connections(server) -> None:
    """Wait (at most `SETTLE_S`) until uvicorn holds no client connection: the baseline is
    counted between requests, not while a closed client's socket is still being let go."""
    deadline = time.monotonic() + SETTLE_S
    while server.server.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.02)


def _settle(measure, baseline) -> object:
    """`measure()` once it is back to `baseline`, or its value after `SETTLE_S` (measured with
    no event loop of this thread running, as the baseline was: a loop has descriptors of its
    own)."""
    deadline = time.monotonic() + SETTLE_S
    while (value := measure()) != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


async def _slow_body(host: str, port: int) -> bytes:
    """Headers, then a body trickling in a byte at a time: the server's 408, read to the end.

    The server closes with the trickled bytes unread, so the kernel may end the connection with
    a reset after the answer: what arrived before it is the reply (a stream reader would drop
    it)."""
    loop = asyncio.get_running_loop()
    part = 'Content-Disposition: form-data; name="file"; filename="v.mp4"\r\n\r\n'
    with socket.create_connection((host, port)) as conn:
        conn.setblocking(False)
        await loop.sock_sendall(
            conn,
            f"POST /v1/videos/describe HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            f"Content-Length: 100000\r\n\r\n--b\r\n{part}".encode(),
        )
        reply = bytearray()
        while True:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(conn, 65536), 0.3)
            except TimeoutError:
                with contextlib.suppress(ConnectionError):  # closed: its answer is still to read
                    await loop.sock_sendall(conn, b"\0")  # nothing yet: one more byte of body
                continue
            except ConnectionResetError:
                return bytes(reply)
            if not chunk:
                return bytes(reply)
            reply += chunk


async def _normal(client: httpx.AsyncClient, clip: bytes) -> httpx.Response:
    files = {"file": ("clip.mp4", clip, "video/mp4")}
    return await client.post("/v1/videos/describe", files=files, data={"max_tokens": "2"})


async def _keyless_closes(url: str, opened: asyncio.Event, sockets: list) -> tuple[int, dict]:
    """A WebSocket that never sends anything: the close code and error the server ends it with."""
    async with connect(url, proxy=None, open_timeout=30) as ws:
        sockets.append(ws)
        if len(sockets) == NUM_KEYLESS:
            opened.set()
        error = json.loads(await ws.recv())
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        return ws.close_code, error


async def _big_keyless_start(url: str) -> tuple[int, dict]:
    """An 8 MB start message without the key: the close code and the error."""
    async with connect(url, proxy=None, open_timeout=30, max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", "pad": "x" * BIG_START_BYTES}))
        error = json.loads(await ws.recv())
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        return ws.close_code, error


async def _bomb(client: httpx.AsyncClient) -> httpx.Response:
    body = b'{"messages": [{"role": "user", "content": "x"}], "junk": [' + b"0," * BOMB_VALUES
    headers = {"content-type": "application/json"}
    return await client.post("/v1/chat/completions", content=body + b"0]}", headers=headers)


async def _chat(client: httpx.AsyncClient, text: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return await client.post("/v1/chat/completions", json=body)


def _lag_probe(server, stop: threading.Event):
    """The worst delay of a 20 ms timer on the server's event loop until `stop` is set."""
    loop = server.server.servers[0].get_loop()

    async def probe() -> float:
        worst = 0.0
        while not stop.is_set():
            started = loop.time()
            await asyncio.sleep(0.02)
            worst = max(worst, loop.time() - started - 0.02)
        return worst

    return asyncio.run_coroutine_threadsafe(probe(), loop)


async def _every_slot_for_keyed_sessions(url: str) -> list[str]:
    sessions = [
        await connect(url, proxy=None, additional_headers=AUTH) for _ in range(MAX_SESSIONS)
    ]
    try:
        replies = []
        for ws in sessions:
            await ws.send(json.dumps({"type": "start"}))
            replies.append(json.loads(await ws.recv())["type"])
        for ws in sessions:
            await ws.send(json.dumps({"type": "stop"}))
        return replies
    finally:
        for ws in sessions:
            await ws.close()


async def _load(server, clips: list[bytes]) -> dict:
    host, port = server.url.removeprefix("http://").split(":")
    ws_url = server.url.replace("http://", "ws://") + "/v1/stream"
    opened, sockets = asyncio.Event(), []
    keyless = [
        asyncio.ensure_future(_keyless_closes(ws_url, opened, sockets)) for _ in range(NUM_KEYLESS)
    ]
    slow = [asyncio.ensure_future(_slow_body(host, int(port))) for _ in range(NUM_SLOW)]
    big = [asyncio.ensure_future(_big_keyless_start(ws_url)) for _ in range(NUM_BIG_STARTS)]
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
        long_prompt = asyncio.ensure_future(_chat(client, "hello " * (MAX_MODEL_LEN - 100)))
        bomb = asyncio.ensure_future(_bomb(client))
        short = [asyncio.ensure_future(_chat(client, f"Hi {k}?")) for k in range(NUM_SHORT)]
        normal = [asyncio.ensure_future(_normal(client, clip)) for clip in clips]
        await opened.wait()  # every key-less socket is open (and silent) from here on
        live_before = (await client.get("/health")).json()["live_sessions"]
        keyed = await _every_slot_for_keyed_sessions(ws_url)
        results = {
            "live_before": live_before,
            "keyed": keyed,
            "keyless_open": sum(ws.state is State.OPEN for ws in sockets),
            "normal": await asyncio.gather(*normal),
            "slow": await asyncio.gather(*slow),
            "keyless": await asyncio.gather(*keyless),
            "big": await asyncio.gather(*big),
            "bomb": await bomb,
            "long": await long_prompt,
            "short": await asyncio.gather(*short),
        }
    return results


def test_slow_bodies_and_keyless_sockets_beside_normal_clients(tiny_checkpoint, clips, tmp_path):
    if not (PROC_SELF / "task").is_dir():
        pytest.skip("counting threads and descriptors needs /proc")
    config = ServerConfig(api_key=KEY, body_timeout_s=BODY_TIMEOUT_S, max_sessions=MAX_SESSIONS)
    stop_probe = threading.Event()
    spool = tmp_path / "spool"
    spool.mkdir()
    saved_tempdir, tempfile.tempdir = tempfile.tempdir, str(spool)  # where uploads would spool
    try:
        with running_server(tiny_checkpoint, config, LOAD_ENGINE) as server:
            with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
                warm = client.post(  # pools and workers start on first use: count after that
                    "/v1/videos/describe",
                    files={"file": ("clip.mp4", clips[-1], "video/mp4")},
                    data={"max_tokens": "2"},
                )
                assert warm.status_code == 200, warm.text
            _no_connections(server)
            threads, files, spooled = _threads(), _open_files(spool), set(spool.rglob("*"))
            lag = _lag_probe(server, stop_probe)
            results = asyncio.run(asyncio.wait_for(_load(server, clips[:-1]), TIMEOUT_S))
            stop_probe.set()
            worst_lag_s = lag.result(timeout=10)
            threads_after = _settle(_threads, threads)
            files_after = _settle(lambda: _open_files(spool), files)
            health = httpx.get(f"{server.url}/health").json()
            pool = settled_pool_state(server)
    finally:
        tempfile.tempdir = saved_tempdir
    assert [r.status_code for r in results["normal"]] == [200] * NUM_NORMAL
    assert all(r.json()["usage"]["completion_tokens"] == 2 for r in results["normal"])
    for reply in results["slow"]:
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(body)["error"]["code"] == "body_timeout"
    assert results["live_before"] == 0
    # every slot went to a keyed session while all the key-less sockets were open
    assert results["keyed"] == ["started"] * MAX_SESSIONS
    assert results["keyless_open"] == NUM_KEYLESS
    assert [code for code, _ in results["keyless"]] == [1008] * NUM_KEYLESS
    assert {error["code"] for _, error in results["keyless"]} == {"start_timeout"}
    assert [code for code, _ in results["big"]] == [1009] * NUM_BIG_STARTS
    assert all("before the API key" in error["message"] for _, error in results["big"])
    assert results["bomb"].status_code == 400
    assert results["bomb"].json()["error"]["code"] == "json_too_large"
    assert [r.status_code for r in [results["long"], *results["short"]]] == [200] * (NUM_SHORT + 1)
    assert worst_lag_s < MAX_LAG_S
    assert pool == (True, 0)
    assert (health["live_sessions"], health["requests_waiting"], health["requests_running"]) == (
        0,
        0,
        0,
    )
    assert files_after == files and set(spool.rglob("*")) == spooled
    assert threads_after <= threads  # none left behind (one the process had before may end)
    assert _pool_workers() <= POOL_LIMIT
