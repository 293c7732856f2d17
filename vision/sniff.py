"""Spot uploads that were cut short, from the container's own size fields.

FFmpeg reports a truncated MP4 as "invalid data" (its index sits at the end and is gone), and a
truncated Matroska file decodes silently up to the cut. Both formats declare their sizes up
front: MP4 as a chain of top-level boxes, Matroska as the size of its Segment element. When a
declared size runs past the end of the input, the input is truncated. Only well-known box
types are followed, so trailing junk after a complete file is never mistaken for a cut.
"""

import struct
from typing import BinaryIO

_MP4_FIRST_BOXES = frozenset({b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"})
_MP4_TOP_LEVEL_BOXES = _MP4_FIRST_BOXES | frozenset(
    {b"uuid", b"moof", b"mfra", b"styp", b"sidx", b"ssix", b"prft", b"emsg", b"meta", b"pdin"}
)
# A hostile file could chain millions of tiny boxes; real files have a handful at top level.
_MAX_MP4_BOXES = 1024
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"
_MATROSKA_SEGMENT_ID = b"\x18\x53\x80\x67"


def truncation_reason(stream: BinaryIO, num_bytes: int) -> str | None:
    """Why `stream` (of `num_bytes` bytes) looks truncated, or None when it does not.

    Leaves the stream position undefined; callers rewind before reading again.
    """
    head = _read_at(stream, 0, 64)
    if head[4:8] in _MP4_FIRST_BOXES:
        return _mp4_truncation(stream, num_bytes)
    if head.startswith(_EBML_MAGIC):
        return _matroska_truncation(head, num_bytes)
    return None


def _read_at(stream: BinaryIO, offset: int, size: int) -> bytes:
    stream.seek(offset)
    return stream.read(size)


def _cut_message(what: str, offset: int, declared_end: int, num_bytes: int) -> str:
    return (
        f"the input looks truncated: {what} at byte {offset} needs the file to be at least "
        f"{declared_end} bytes, but it has {num_bytes}; upload the complete file"
    )


def _mp4_truncation(stream: BinaryIO, num_bytes: int) -> str | None:
    offset = 0
    for _ in range(_MAX_MP4_BOXES):
        if offset >= num_bytes:
            return None
        header = _read_at(stream, offset, 16)
        if len(header) < 8:
            return _cut_message("a box header", offset, offset + 8, num_bytes)
        size, box_type = struct.unpack(">I4s", header[:8])
        if box_type not in _MP4_TOP_LEVEL_BOXES:
            return None
        header_size = 8
        if size == 1:  # 64-bit size follows the type
            if len(header) < 16:
                return _cut_message("a box header", offset, offset + 16, num_bytes)
            (size,) = struct.unpack(">Q", header[8:16])
            header_size = 16
        if size == 0:  # the box runs to the end of the file by definition
            return None
        if size < header_size:
            return None  # malformed rather than truncated: FFmpeg will say so
        if offset + size > num_bytes:
            name = box_type.decode("latin-1")
            return _cut_message(f"the '{name}' box", offset, offset + size, num_bytes)
        offset += size
    return None


def _read_vint(data: bytes, pos: int) -> tuple[int | None, int]:
    """Matroska variable-size integer at `pos`: (value or None for "unknown", next pos).

    Raises IndexError when `data` ends inside the field, ValueError when it is not one.
    """
    first = data[pos]
    length = 9 - first.bit_length()  # leading zero bits + 1
    if first == 0:
        raise ValueError("not a Matroska size field")
    if pos + length > len(data):
        raise IndexError("data ends inside a Matroska size field")
    value = first & ((1 << (8 - length)) - 1)
    for byte in data[pos + 1 : pos + length]:
        value = (value << 8) | byte
    is_unknown = value == (1 << (7 * length)) - 1  # live muxers leave the size open
    return (None if is_unknown else value), pos + length


def _matroska_truncation(head: bytes, num_bytes: int) -> str | None:
    try:
        header_size, pos = _read_vint(head, len(_EBML_MAGIC))
        if header_size is None:
            return None
        segment_at = pos + header_size
        if head[segment_at : segment_at + 4] != _MATROSKA_SEGMENT_ID:
            if segment_at + 4 <= len(head):
                return None  # some other layout: leave it to FFmpeg
            raise IndexError("data ends before the Segment element")
        segment_size, data_at = _read_vint(head, segment_at + 4)
    except ValueError:
        return None
    except IndexError:
        if len(head) < num_bytes:
            return None  # an unusually long header, not a short file: leave it to FFmpeg
        return (
            f"the input looks truncated: it ends inside the Matroska header after {num_bytes} "
            "bytes; upload the complete file"
        )
    if segment_size is not None and data_at + segment_size > num_bytes:
        return _cut_message("the Matroska segment", segment_at, data_at + segment_size, num_bytes)
    return None
