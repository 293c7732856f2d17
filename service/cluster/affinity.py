"""A request's affinity key: what sends requests about the same media to the same replica.

The encoder cache and the prefix cache live inside one replica, so the ingress keys each
request by the content hash of its first media item: the bytes of an uploaded file or of a
`data:` URL (decoded, so an upload and a data URL of one clip share a key), or the URL itself
for `http(s)://` and `file://` media, which the ingress never fetches. A text-only request
is keyed by the first 256 characters of its prompt text, so the later turns of a
conversation follow its first. The ingress holds no tokenizer and reads only the body it was
sent, under the same limits as a replica; a body it cannot parse has no key, and whichever
replica it lands on answers the error.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from stillcut.service.media import FORM_OVERHEAD_BYTES
from stillcut.service.request_limits import loads_json

TEXT_KEY_CHARS = 256
_MEDIA_PARTS = ("video_url", "image_url")


@dataclass
class RouteHint:
    """What the router reads, and writes, about one request (the calls' `route` argument)."""

    key: bytes | None = None  # the affinity key; None: no preference
    pin: str | None = None  # a replica id the request must go to, while that replica is up
    preferred: str | None = None  # set by the router: the replica the key prefers


def chat_key(body: bytes) -> bytes | None:
    """The key of a chat-completions body: its first media part, else its prompt text."""
    try:
        data = loads_json(body)
    except ValueError:
        return None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        return None
    parts = [part for message in messages for part in _parts(message)]
    for part in parts:
        url = _media_url(part)
        if url is not None:
            return _url_key(url)
    texts = [part.get("text") if isinstance(part, dict) else part for part in parts]
    text = "".join(text for text in texts if isinstance(text, str))
    return text_key(text)


def text_key(text: str) -> bytes:
    """The key of a text-only prompt: its first `TEXT_KEY_CHARS` characters."""
    return _digest(b"text", text[:TEXT_KEY_CHARS].encode())


def media_key(data: bytes) -> bytes:
    """The key of a medium's bytes."""
    return _digest(b"media", data)


async def upload_key(body: bytes, headers: Headers) -> bytes | None:
    """The key of a describe form: the bytes of its `file` field."""
    if not headers.get("content-type", "").lower().startswith("multipart/form-data"):
        return None

    async def chunks() -> AsyncIterator[bytes]:
        yield body

    parser = MultiPartParser(
        headers, chunks(), max_files=1, max_fields=32, max_part_size=FORM_OVERHEAD_BYTES
    )
    try:
        form = await parser.parse()
    except MultiPartException:
        return None
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            return None
        return await asyncio.to_thread(media_key, await upload.read())
    finally:
        await form.close()


def _parts(message: Any) -> list:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else [content]


def _media_url(part: Any) -> str | None:
    if not isinstance(part, dict) or part.get("type") not in _MEDIA_PARTS:
        return None
    target = part.get(part["type"])
    url = target.get("url") if isinstance(target, dict) else None
    return url if isinstance(url, str) else None


def _url_key(url: str) -> bytes | None:
    if not url[:5].lower() == "data:":
        return _digest(b"url", url.encode())
    _, comma, payload = url.partition(",")
    try:
        return media_key(base64.b64decode(payload, validate=True)) if comma else None
    except (binascii.Error, ValueError):
        return None


def _digest(kind: bytes, data: bytes) -> bytes:
    return hashlib.sha256(kind + b"\0" + data).digest()
