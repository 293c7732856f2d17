"""Turn a path, bytes or a file object into a bounded byte stream and open FFmpeg on it safely.

FFmpeg opened on a *name* honours protocol prefixes (`http:`, `concat:`) and guesses formats
from extensions (a `.txt` file opens as ANSI art); playlist demuxers (HLS, concat) go on to
read other files. A service fed uploads must do none of that, so FFmpeg only ever sees a Python
file object, and probing is limited to a whitelist of demuxers. Size limits are checked before
FFmpeg reads a byte, and truncated MP4 / Matroska files are named as such (see `sniff`).
"""

import io
import os
import stat
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import BinaryIO

import av
import av.container

from stillcut.vision.errors import (
    EmptyVideo,
    TruncatedVideo,
    UnreadableVideo,
    VideoTooLarge,
)
from stillcut.vision.sniff import truncation_reason

VIDEO_DEMUXERS = (
    "mov", "matroska", "avi", "flv", "mpegts", "mpeg", "ogg", "ivf", "asf", "mxf", "nut", "gif",
    "yuv4mpegpipe", "h264", "hevc",
)  # fmt: skip
# Audio and image demuxers are allowed to *open*, so those inputs get a precise error
# (NoVideoStream, NotAVideo) instead of "unreadable".
AUDIO_DEMUXERS = ("mp3", "wav", "flac")
IMAGE_DEMUXERS = frozenset({"png_pipe", "jpeg_pipe", "webp_pipe", "bmp_pipe", "tiff_pipe"})
SUPPORTED_CONTAINERS = (
    "MP4/MOV, Matroska/WebM, AVI, FLV, MPEG-TS/PS, Ogg, IVF, ASF, MXF, NUT, GIF, Y4M, "
    "raw H.264/HEVC"
)
_FORMAT_WHITELIST = ",".join((*VIDEO_DEMUXERS, *AUDIO_DEMUXERS, *sorted(IMAGE_DEMUXERS)))

Source = str | os.PathLike | bytes | bytearray | memoryview | BinaryIO


class VideoSource:
    """A seekable byte stream of known size that containers can be opened on, one at a time."""

    def __init__(self, file: BinaryIO, num_bytes: int) -> None:
        self.file = file
        self.num_bytes = num_bytes

    @contextmanager
    def open_container(self) -> Iterator[av.container.InputContainer]:
        """Open a fresh demuxer from the first byte; FFmpeg errors become `VideoError`s."""
        self.file.seek(0)
        try:
            container = av.open(
                self.file, mode="r", container_options={"format_whitelist": _FORMAT_WHITELIST}
            )
        except av.error.EOFError as e:
            raise TruncatedVideo(
                "the input ends before its container header and stream parameters are complete"
            ) from e
        except (av.error.FFmpegError, OSError) as e:
            raise UnreadableVideo(
                f"not a readable video container ({reason_of(e)}); "
                f"supported containers: {SUPPORTED_CONTAINERS}"
            ) from e
        with container:
            yield container


def reason_of(error: Exception) -> str:
    """A short human reason for an FFmpeg or OS error, without errno noise."""
    return getattr(error, "strerror", None) or str(error) or type(error).__name__


@contextmanager
def open_source(source: Source, max_bytes: int) -> Iterator[VideoSource]:
    """Wrap `source` as a `VideoSource`, after the size and truncation checks.

    A path is opened here and closed on exit; a caller's file object is read from its start
    and left open; a file object that cannot seek is read into memory, up to `max_bytes`.
    """
    with ExitStack() as stack:
        if isinstance(source, (bytes, bytearray, memoryview)):
            stream: BinaryIO = io.BytesIO(source)
        elif isinstance(source, (str, os.PathLike)):
            stream = stack.enter_context(_open_path(source))
        elif not hasattr(source, "read"):
            raise TypeError(
                f"source must be a path, bytes or a binary file object, got {type(source).__name__}"
            )
        elif _seekable(source):
            stream = source
        else:
            data = _read_at_most(source, max_bytes + 1)
            if len(data) > max_bytes:
                raise VideoTooLarge(f"the input has more than max_bytes={max_bytes} bytes")
            stream = io.BytesIO(data)
        num_bytes = _size(stream)
        if num_bytes == 0:
            raise EmptyVideo("the input is empty (0 bytes); a video file is required")
        if num_bytes > max_bytes:
            raise VideoTooLarge(f"the input has {num_bytes} bytes, over max_bytes={max_bytes}")
        try:
            reason = truncation_reason(stream, num_bytes)
        except OSError as e:
            raise UnreadableVideo(f"cannot read the input: {reason_of(e)}") from e
        if reason is not None:
            raise TruncatedVideo(reason)
        yield VideoSource(stream, num_bytes)


def _open_path(path: str | os.PathLike) -> BinaryIO:
    try:
        stream = open(path, "rb")
    except OSError as e:
        raise UnreadableVideo(f"cannot open {os.fspath(path)!r}: {reason_of(e)}") from e
    if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
        stream.close()
        raise UnreadableVideo(
            f"{os.fspath(path)!r} is not a regular file; a video file is required"
        )
    return stream


def _seekable(stream: BinaryIO) -> bool:
    try:
        return stream.seekable()
    except (AttributeError, OSError, ValueError):
        return False


def _size(stream: BinaryIO) -> int:
    try:
        return stream.seek(0, io.SEEK_END)
    except OSError as e:
        raise UnreadableVideo(f"cannot read the input: {reason_of(e)}") from e


def _read_at_most(stream: BinaryIO, limit: int) -> bytes:
    chunks, num_read = [], 0
    try:
        while num_read < limit:
            chunk = stream.read(min(1 << 20, limit - num_read))
            if not chunk:
                break
            chunks.append(chunk)
            num_read += len(chunk)
    except OSError as e:
        raise UnreadableVideo(f"cannot read the input: {reason_of(e)}") from e
    return b"".join(chunks)
