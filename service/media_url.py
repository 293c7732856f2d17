"""A chat request's media URLs, resolved to bytes or a local path.

`data:` URLs (base64) always; `file://` only inside the configured media folder (after
resolving symlinks); `http(s)://` only for allowed hosts, fetched by `media_fetch`. A URL that
cannot be parsed is a 400 like any other bad URL.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from stillcut.service.config import ServerConfig
from stillcut.service.errors import bad_request
from stillcut.service.media import MediaKind, check_content_type, too_large
from stillcut.service.media_fetch import fetch_media


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
        return await fetch_media(url, kind, where, config, client)
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
    try:
        parts = urlsplit(url)
    except ValueError as error:
        raise bad_request(f"{where} is not a valid URL ({error})", "invalid_url") from None
    if parts.netloc not in ("", "localhost"):
        raise bad_request(f"{where}: a file:// URL must name a local path", "url_not_allowed")
    local = unquote(parts.path)
    if "\0" in local:
        raise bad_request(f"{where}: a file:// URL may not hold a NUL byte (%00)", "invalid_url")
    try:
        path = Path(local).resolve()
        inside = path.is_relative_to(config.media_dir.resolve())
        found = inside and path.is_file()
    except OSError as error:  # a name too long, a loop of symlinks
        raise bad_request(
            f"{where}: {error.strerror or 'not a usable path'}", "invalid_url"
        ) from None
    if not inside:
        raise bad_request(
            f"{where}: {url!r} is outside the server's media folder", "url_not_allowed"
        )
    if not found:
        raise bad_request(f"{where}: no such file in the media folder: {url!r}", "file_not_found")
    return path
