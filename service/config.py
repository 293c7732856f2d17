"""Settings of the HTTP service: access, where media may come from, and every limit.

One frozen dataclass, checked on construction, so `stillcut serve` fails at start with the
field's name and allowed range rather than on the first request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from stillcut.service.reasoning import REASONING_PARSERS

MIB = 2**20


@dataclass(frozen=True)
class ServerConfig:
    """What the server accepts and how much of it.

    Media URLs: `file://` only under `media_dir` (none: never); `http(s)://` only for a host in
    `allowed_hosts` (exact host names, or `host:port`). `max_upload_bytes` bounds an upload, a
    JSON body and a fetched URL alike. `max_queue` bounds the requests waiting for the encoder
    and those waiting for the scheduler (each); past it, 503 with `Retry-After`.
    `reasoning_parser` ("think" or None) splits chat answers' thinking into
    `reasoning_content`.
    """

    api_key: str | None = None
    media_dir: Path | None = None
    allowed_hosts: tuple[str, ...] = ()
    max_upload_bytes: int = 64 * MIB
    max_queue: int = 64
    request_timeout_s: float = 600.0  # deadline of a request that names none
    fetch_timeout_s: float = 30.0
    retry_after_s: int = 1
    shutdown_timeout_s: float = 10.0
    max_sessions: int = 4  # live WebSocket sessions at once
    max_session_frames: int = 7200
    max_session_s: float = 3600.0
    session_idle_s: float = 60.0
    max_message_bytes: int = 8 * MIB  # one WebSocket message
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be None or a non-empty string")
        if self.media_dir is not None:
            object.__setattr__(self, "media_dir", Path(self.media_dir))
            if not self.media_dir.is_dir():
                raise ValueError(f"media_dir={str(self.media_dir)!r} must be an existing folder")
        hosts = tuple(host.strip().lower() for host in self.allowed_hosts)
        if not all(hosts):
            raise ValueError(f"allowed_hosts={self.allowed_hosts!r} must hold non-empty names")
        object.__setattr__(self, "allowed_hosts", hosts)
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser={self.reasoning_parser!r}: allowed {REASONING_PARSERS} or None"
            )
        for name in (
            "max_upload_bytes",
            "max_queue",
            "retry_after_s",
            "max_sessions",
            "max_session_frames",
            "max_message_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name in (
            "request_timeout_s",
            "fetch_timeout_s",
            "shutdown_timeout_s",
            "max_session_s",
            "session_idle_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")
