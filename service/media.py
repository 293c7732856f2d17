"""Getting request bodies in, within limits, without trusting them.

Bodies are read as they stream and refused (413) the moment they pass their limit, so an
oversized upload is never held whole; a declared `Content-Length` over the limit is refused
before a byte is read. A client that hangs up mid-body is `ClientGone` (499, not an error).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

from stillcut.service.config import ServerConfig
from stillcut.service.errors import APIError, ClientGone, bad_request

MediaKind = Literal["video", "image"]
FORM_OVERHEAD_BYTES = 64 * 1024  # boundaries and text fields around an uploaded file
# an animated GIF is a video (PyAV decodes it), so `image/gif` is a video's type too
_MEDIA_TYPES = {
    "video": ("video/", "image/gif", "application/octet-stream"),
    "image": ("image/",),
}
_GIF_MAGIC = (b"GIF87a", b"GIF89a")


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
    try:
        async for chunk in request.stream():
            num_bytes += len(chunk)
            if num_bytes > limit:
                raise too_large(what, limit)
            yield chunk
    except ClientDisconnect:
        raise ClientGone() from None


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
        if error.message.startswith("Part exceeded maximum size"):
            raise bad_request(
                f"a form field exceeds {FORM_OVERHEAD_BYTES} bytes: the prompt and the other "
                f"text fields may hold at most {FORM_OVERHEAD_BYTES // 1024} KiB each",
                "field_too_large",
            ) from None
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


def refuse_gif_image(source: bytes | Path, where: str) -> None:
    """415 for a GIF sent as an image: images are PNG, JPEG or WebP, and a GIF is taken as a
    video (its frames are the clip)."""
    if isinstance(source, Path):
        with source.open("rb") as file:
            head = file.read(6)
    else:
        head = source[:6]
    if head in _GIF_MAGIC:
        raise APIError(
            415,
            f"{where} is a GIF: images must be PNG, JPEG or WebP; send a GIF as a video "
            "(a video_url part), whose frames it holds",
            type="unsupported_media_type",
            code="not_an_image",
        )
