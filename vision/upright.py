"""Convert decoded frames to upright RGB, the way a player shows them.

Three pieces of metadata change what the viewer sees: the pixel format and its colour range
(10-bit, full-range "yuvj", limited range), the sample aspect ratio (non-square pixels are
stretched to the display aspect), and the display matrix (phones store portrait video sideways
and flag a rotation, sometimes a mirror). The colour conversion is swscale's, which reads the
frame's own range and colourspace tags. Rotation and mirroring follow FFmpeg's `autorotate`
rules, so our frames match what `ffmpeg -i clip.mp4 out.png` writes.
"""

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from av.sidedata.sidedata import Type as SideDataType
from av.video.frame import VideoFrame
from av.video.stream import VideoStream

from stillcut.vision.errors import FrameTooLarge

# swscale's filter when it also resizes (`FrameResize.fast`); with no resize it only converts
FAST_SCALER = "BILINEAR"


@dataclass(frozen=True)
class UprightLayout:
    """How to turn every sampled frame of one clip into an upright RGB array.

    Fixed by the first sampled frame, so all outputs share one shape even if the stream
    changes resolution midway (later frames are scaled to the same size).
    """

    width: int  # after the aspect-ratio fix, before turning
    height: int
    quarter_turns: int  # counter-clockwise, np.rot90 convention
    mirror: bool  # flip left-right after turning

    def __post_init__(self) -> None:
        assert self.width >= 1 and self.height >= 1, (self.width, self.height)
        assert 0 <= self.quarter_turns < 4, self.quarter_turns

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of the arrays `to_rgb` returns."""
        if self.quarter_turns % 2:
            return self.width, self.height
        return self.height, self.width

    def to_rgb(self, frame: VideoFrame, size: tuple[int, int] | None = None) -> np.ndarray:
        """[H, W, 3] uint8 upright RGB, at `size` (height, width; upright) when given, scaled
        by FFmpeg as it converts; a view, possibly strided."""
        scale = {"width": self.width, "height": self.height}
        if size is not None:  # the size before turning
            height, width = size if self.quarter_turns % 2 == 0 else size[::-1]
            scale = {"width": width, "height": height, "interpolation": FAST_SCALER}
        rgb = frame.to_ndarray(format="rgb24", **scale)  # [h, w, 3]
        rgb = np.rot90(rgb, self.quarter_turns)
        return rgb[:, ::-1] if self.mirror else rgb


def display_size(width: int, height: int, stream: VideoStream) -> tuple[int, int]:
    """(width, height) a coded `width` x `height` frame displays at, before any rotation:
    non-square pixels stretched to the display aspect."""
    aspect = stream.sample_aspect_ratio or stream.codec_context.sample_aspect_ratio
    if aspect and aspect > 0 and aspect != 1:
        width = max(1, round(width * Fraction(aspect)))
    return width, height


def layout_for(frame: VideoFrame, stream: VideoStream, max_pixels: int) -> UprightLayout:
    """The `UprightLayout` for a clip, from its first sampled frame and its stream."""
    width, height = display_size(frame.width, frame.height, stream)
    if width * height > max_pixels:
        raise FrameTooLarge(
            f"frames display at {width}x{height} = {width * height} pixels, "
            f"over max_pixels={max_pixels}"
        )
    quarter_turns, mirror = display_orientation(frame, stream)
    return UprightLayout(width, height, quarter_turns, mirror)


def display_orientation(frame: VideoFrame, stream: VideoStream) -> tuple[int, bool]:
    """(counter-clockwise quarter turns, mirror left-right) that make `frame` upright."""
    # A frame and its side-data container refer to each other, so reading it off the decoder's
    # own frame keeps that frame, and with it the decoder's threads, alive until the garbage
    # collector runs; a 2x2 copy carries the same side data and pins nothing.
    copy = frame.reformat(width=2, height=2, format="rgb24")
    side_data = copy.side_data.get(SideDataType.DISPLAYMATRIX)
    if side_data is None:
        return _rotate_tag_turns(stream), False
    matrix = np.frombuffer(bytes(side_data), dtype=np.int32)  # 3x3, row-major, 16.16 fixed
    # frame.rotation is counter-clockwise degrees; odd angles snap to the nearest quarter turn.
    clockwise = round(-frame.rotation / 90) % 4
    if clockwise == 1:  # FFmpeg: transpose=cclock_flip if m[3] > 0 else transpose=clock
        return 3, bool(matrix[3] > 0)
    if clockwise == 3:  # FFmpeg: transpose=clock_flip if m[3] < 0 else transpose=cclock
        return 1, bool(matrix[3] < 0)
    flip_h = clockwise == 2 and matrix[0] < 0
    flip_v = matrix[4] < 0
    # A vertical flip is a half turn plus a left-right mirror.
    return (2 if flip_v else 0), flip_h != flip_v


def _rotate_tag_turns(stream: VideoStream) -> int:
    """Counter-clockwise quarter turns from a legacy `rotate` tag (clockwise degrees)."""
    for key, value in stream.metadata.items():
        if key.lower() == "rotate":
            try:
                return round(-float(value) / 90) % 4
            except (ValueError, OverflowError):  # not a number, or an infinite one
                return 0
    return 0
