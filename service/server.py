"""Running the app under uvicorn, in the foreground (`stillcut serve`) or in a thread (tests,
benchmarks), and waiting for one started as a process to serve.

uvicorn enforces the WebSocket message limit itself (`ws_max_size`, closing with 1009 before
a too-big message is buffered), so it gets the server's `max_message_bytes`, and the bound on
open connections (`limit_concurrency`: past `max_connections`, an HTTP request gets its plain
503). Its own access
log is off: the service writes one structured line per request instead.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import httpx
import uvicorn

from stillcut.service.api import VideoLLM
from stillcut.service.app import create_app
from stillcut.service.config import ServerConfig

_STARTUP_POLL_S = 0.02
_SERVING_POLL_S = 0.5


def uvicorn_config(
    llm: VideoLLM, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000
) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(llm, config),
        host=host,
        port=port,
        ws_max_size=config.max_message_bytes,
        limit_concurrency=config.max_connections,
        access_log=False,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=max(1, round(config.shutdown_timeout_s)),
    )


def serve(llm: VideoLLM, config: ServerConfig, *, host: str, port: int) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM: a graceful shutdown)."""
    uvicorn.Server(uvicorn_config(llm, config, host=host, port=port)).run()


class BackgroundServer:
    """A uvicorn server on 127.0.0.1 at a free port, in a daemon thread; `stop()` shuts it
    down gracefully. `url` is its base URL, `app` the FastAPI app it serves."""

    def __init__(self, llm: VideoLLM, config: ServerConfig, *, startup_timeout: float = 60.0):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn_config(llm, config, port=port))
        self.app = self.server.config.app
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(_STARTUP_POLL_S)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join()
        self._socket.close()


def wait_until_serving(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Wait until the `stillcut serve` started as `process` answers `GET url/health` with 200
    (tests, benchmarks); `RuntimeError` if it exits first or takes longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before it served")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(_SERVING_POLL_S)
    raise RuntimeError(f"the server did not serve within {timeout_s:g} s")
