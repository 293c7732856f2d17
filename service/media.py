"""Getting request bodies and media in, within limits, without trusting them.

Bodies are read as they stream and refused (413) the moment they pass their limit, so an
oversized upload is never held whole; a declared `Content-Length` over the limit is refused
before a byte is read. Media URLs in chat requests resolve to bytes or a local path:
`data:` URLs (base64), `file://` only inside the configured media folder (after resolving
symlinks), `http(s)://` only for allowed hosts, fetched with a size cap, a total time limit and
no redirects.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

import httpx
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from stillcut.service.config import ServerConfig
from stillcut.service.errors import APIError, bad_request

MediaKind = Literal["video", "image"]
FORM_OVERHEAD_BYTES = 64 * 1024  # boundaries and text fields around an uploaded file
_MEDIA_TYPES = {"video": ("video/", "application/octet-stream"), "image": ("image/",)}


def too_large(what: str, limit: int) -> APIError:
    return APIError(
        413,
        f"{what} exceeds the limit of {limit} bytes",
        type="request_too_large",
        code="payload_too_large",
    )


def unsupported_type(message: str) -> APIError:
    return APIError(415, message, type="unsupported_media_type", code="unsupported_content_type")


async def limited_stream(request: Request, limit: int, what: str) -> AsyncIterator[bytes]:
    """The request body chunk by chunk; 413 as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(what, limit)
    num_bytes = 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > limit:
            raise too_large(what, limit)
        yield chunk


async def read_body(request: Request, limit: int, what: str = "the request body") -> bytes:
    """The whole body, at most `limit` bytes."""
    return b"".join([chunk async for chunk in limited_stream(request, limit, what)])


async def read_upload_form(request: Request, config: ServerConfig) -> FormData:
    """A multipart form with at most one file, parsed as it streams in. The caller closes it."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise unsupported_type(
            f"Content-Type {content_type or '(none)'!r} is not supported here; "
            "send multipart/form-data with the video in a 'file' field"
        )
    limit = config.max_upload_bytes + FORM_OVERHEAD_BYTES
    parser = MultiPartParser(
        request.headers,
        limited_stream(request, limit, "the upload"),
        max_files=1,
        max_fields=32,
        max_part_size=FORM_OVERHEAD_BYTES,
    )
    try:
        return await parser.parse()
    except MultiPartException as error:
        raise bad_request(f"malformed multipart form: {error.message}", "invalid_form") from None


def check_content_type(content_type: str | None, kind: MediaKind, where: str) -> None:
    """415 unless `content_type` (when given) fits the media kind."""
    if not content_type:
        return
    base = content_type.split(";")[0].strip().lower()
    allowed = _MEDIA_TYPES[kind]
    if not any(base.startswith(prefix) for prefix in allowed):
        raise unsupported_type(
            f"{where} has content type {base!r}; a {kind} needs one of "
            + ", ".join(f"{prefix}*" if prefix.endswith("/") else prefix for prefix in allowed)
        )


async def resolve_media_url(
    url: str, kind: MediaKind, where: str, config: ServerConfig, client: httpx.AsyncClient
) -> bytes | Path:
    """The media behind a chat request's URL: bytes, or a path inside the media folder."""
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where} must be a non-empty string URL", "invalid_url")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, kind, where, config.max_upload_bytes)
    if scheme == "file":
        return _media_file(url, where, config)
    if scheme in ("http", "https"):
        return await _fetch(url, kind, where, config, client)
    raise bad_request(
        f"{where} has scheme {scheme or '(none)'!r}; use a data:, file:// or http(s):// URL",
        "invalid_url",
    )


def _data_url(url: str, kind: MediaKind, where: str, limit: int) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma or not header.endswith(";base64"):
        raise bad_request(
            f"{where} is not a base64 data URL; expected data:<media type>;base64,<data>",
            "invalid_data_url",
        )
    check_content_type(header.removesuffix(";base64"), kind, where)
    if len(payload) * 3 // 4 > limit:
        raise too_large(f"{where}'s data", limit)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where} holds invalid base64 data", "invalid_data_url") from None


def _media_file(url: str, where: str, config: ServerConfig) -> Path:
    if config.media_dir is None:
        raise bad_request(
            f"{where}: file:// URLs are disabled; the server has no media folder",
            "url_not_allowed",
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise bad_request(f"{where}: a file:// URL must name a local path", "url_not_allowed")
    root = config.media_dir.resolve()
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(root):
        raise bad_request(
            f"{where}: {url!r} is outside the server's media folder", "url_not_allowed"
        )
    if not path.is_file():
        raise bad_request(f"{where}: no such file in the media folder: {url!r}", "file_not_found")
    return path


async def _fetch(
    url: str, kind: MediaKind, where: str, config: ServerConfig, client: httpx.AsyncClient
) -> bytes:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if host not in config.allowed_hosts and f"{host}:{parts.port}" not in config.allowed_hosts:
        raise bad_request(
            f"{where}: host {host!r} is not in the server's allowed hosts", "url_not_allowed"
        )
    limit = config.max_upload_bytes
    try:
        async with asyncio.timeout(config.fetch_timeout_s):
            async with client.stream("GET", url, follow_redirects=False) as response:
                if response.status_code != 200:
                    raise bad_request(
                        f"{where}: fetching it returned HTTP {response.status_code}",
                        "media_fetch_failed",
                    )
                check_content_type(response.headers.get("content-type"), kind, where)
                chunks, num_bytes = [], 0
                async for chunk in response.aiter_bytes():
                    num_bytes += len(chunk)
                    if num_bytes > limit:
                        raise too_large(f"{where}'s content", limit)
                    chunks.append(chunk)
                return b"".join(chunks)
    except TimeoutError:
        raise bad_request(
            f"{where}: fetching it took longer than {config.fetch_timeout_s:g} s",
            "media_fetch_failed",
        ) from None
    except httpx.HTTPError as error:
        raise bad_request(f"{where}: fetching it failed ({error})", "media_fetch_failed") from None
