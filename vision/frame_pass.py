"""One decoding pass over a video stream, keeping only the frames the sample times pick.

Frames arrive in presentation order and go through `FrameSelector`; only picked frames are
converted to RGB. Two shortcuts make the pass cheaper than decoding everything:

- the pass reuses the container the packet scan read, seeking back to a keyframe shortly
  before the range (rather than opening the file again, which decodes a few frames);
- a frame no sample picks is not decoded at all when no other frame references it (FFmpeg's
  `skip_frame = NONREF`, switched per packet): about half the frames of a B-frame stream.
  Which frames get picked is known before decoding, from the packet timestamps.

Both are exact as long as the container's timestamps are honest. The pass checks that they
were (the first frame after the seek is at or before `start`; the picks match the
prediction) and returns None otherwise, so the caller reruns it plainly on a fresh container.
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from av.container import InputContainer
from av.video.frame import VideoFrame
from av.video.stream import VideoStream

from stillcut.engine.models.frame_resize import FrameResize
from stillcut.vision.decode_config import DecodeConfig
from stillcut.vision.errors import (
    CorruptVideo,
    FrameTooLarge,
    NoFrames,
    TooManyFrames,
    UnsupportedCodec,
    VideoTooLong,
)
from stillcut.vision.sampling import TIME_EPS_S, FrameSelector, Pick, predict_picks
from stillcut.vision.timeline import StreamClock
from stillcut.vision.upright import UprightLayout, layout_for
from stillcut.vision.video_source import reason_of
from stillcut.vision.work import VisionWork

# Seek this far before `start`: keyframe indexes may hold decode times, which lead
# presentation times by the B-frame delay, so a seek straight to `start` can land too late.
SEEK_PREROLL_S = 1.0


@dataclass(frozen=True)
class SkipPlan:
    """The frames worth decoding, predicted from packet timestamps, and the expected result."""

    wanted_pts: frozenset[int]
    expected_timestamps: tuple[float, ...]


@dataclass(frozen=True)
class SampledFrames:
    """What a pass returns."""

    frames: np.ndarray  # [T, H, W, 3] uint8 upright RGB, at the resize target
    display_size: tuple[int, int]  # (height, width) upright, before any resize
    timestamps: list[float]


@dataclass(frozen=True)
class PassPlan:
    """What one pass samples, and which shortcuts it may take."""

    sample_times: tuple[float, ...]
    seek: bool  # seek to the range first (the container may have been read); else decode it all
    skip: SkipPlan | None  # None: decode every frame


def plan_skips(
    stream: VideoStream, packet_pts: tuple[int, ...], sample_times: tuple[float, ...]
) -> SkipPlan:
    """Which frames the sampling rule will pick, from every packet's pts."""
    clock = StreamClock(stream)
    frames = sorted((clock.seconds(pts), pts) for pts in packet_pts)  # presentation order
    picks = predict_picks(frames, sample_times)
    expected = tuple(pick.time for pick in picks for _ in range(pick.num_samples))
    return SkipPlan(frozenset(pick.item for pick in picks), expected)


def run_pass(
    container: InputContainer,
    stream: VideoStream,
    plan: PassPlan,
    config: DecodeConfig,
    *,
    resize: FrameResize | None = None,
    work: VisionWork | None = None,
) -> SampledFrames | None:
    """The sampled frames (resized by `resize`, if given); None when a shortcut misfired.
    Every frame out of the decoder counts in `work`."""
    start = plan.sample_times[0]
    clock = StreamClock(stream)
    if plan.seek and not _seek_before(container, stream, clock, max(0.0, start - SEEK_PREROLL_S)):
        return None
    wanted = plan.skip.wanted_pts if plan.skip is not None else None
    selector: FrameSelector[VideoFrame] = FrameSelector(plan.sample_times)
    sink = _FrameSink(stream, len(plan.sample_times), config.max_pixels, resize)
    num_frames = 0
    for time, frame in _decoded_frames(container, stream, clock, config, wanted):
        num_frames += 1
        if work is not None:
            work.frames_decoded += 1
        if plan.seek and num_frames == 1 and (frame.pts is None or time > start + TIME_EPS_S):
            return None
        sink.add(selector.push(time, frame))
        if selector.done:
            break
    if plan.seek and num_frames == 0:
        return None
    sink.add(selector.finish())
    if plan.skip is not None and tuple(sink.timestamps) != plan.skip.expected_timestamps:
        return None
    if not sink.timestamps:
        raise NoFrames("the video stream has no decodable frames; at least one is required")
    return SampledFrames(sink.frames, sink.display_size, sink.timestamps)


def _seek_before(
    container: InputContainer, stream: VideoStream, clock: StreamClock, time: float
) -> bool:
    """Seek to a keyframe before `time` (seconds from the stream start); False if unsupported."""
    target = math.floor((clock.origin + Fraction(time)) / stream.time_base)
    try:
        container.seek(target, stream=stream, backward=True)
    except av.error.FFmpegError:
        return False
    return True


def _decoded_frames(
    container: InputContainer,
    stream: VideoStream,
    clock: StreamClock,
    config: DecodeConfig,
    wanted_pts: frozenset[int] | None,
) -> Iterator[tuple[float, VideoFrame]]:
    """Yield (seconds, frame) in presentation order, enforcing the per-frame limits."""
    codec = stream.codec_context
    num_decoded = 0
    try:
        for packet in container.demux(stream):
            if wanted_pts is not None:
                # Read per packet by the decoder (the default slice threading decodes each
                # packet as it is sent); a frame that others reference is decoded regardless.
                is_wanted = packet.pts is None or packet.pts in wanted_pts
                codec.skip_frame = "DEFAULT" if is_wanted else "NONREF"
            for frame in packet.decode():
                num_decoded += 1
                if num_decoded > config.max_decoded_frames:
                    raise TooManyFrames(
                        "decoding needs more than "
                        f"max_decoded_frames={config.max_decoded_frames} frames"
                    )
                if frame.width * frame.height > config.max_pixels:
                    raise FrameTooLarge(
                        f"a frame of {frame.width}x{frame.height} = {frame.width * frame.height}"
                        f" pixels exceeds max_pixels={config.max_pixels}"
                    )
                time = clock.time_of(frame.pts, frame.duration)
                if time > config.max_duration_s:
                    raise VideoTooLong(
                        f"the video runs past {time:g} s, over "
                        f"max_duration_s={config.max_duration_s:g}"
                    )
                yield time, frame
    except av.error.FFmpegError as e:
        raise CorruptVideo(
            f"the video data is corrupt near {clock.end:.2f} s ({reason_of(e)}); "
            "re-encode or re-upload the file"
        ) from e


class _FrameSink:
    """Converts picked frames to upright RGB into one preallocated [T, H, W, 3] array, at the
    size `resize` targets (display size without one), so only one frame is ever held at
    display size."""

    def __init__(
        self, stream: VideoStream, num_samples: int, max_pixels: int, resize: FrameResize | None
    ) -> None:
        self._stream = stream
        self._num_samples = num_samples
        self._max_pixels = max_pixels
        self._resize = resize
        self._layout: UprightLayout | None = None
        self._target = (0, 0)  # (height, width) frames are stored at
        self.display_size = (0, 0)  # (height, width) upright, before any resize
        self.frames = np.empty((0, 0, 0, 3), np.uint8)
        self.timestamps: list[float] = []

    def add(self, pick: Pick[VideoFrame] | None) -> None:
        if pick is None:
            return
        if self._layout is None:
            self._layout = layout_for(pick.item, self._stream, self._max_pixels)
            self.display_size = self._layout.output_size
            self._target = self.display_size
            if self._resize is not None:
                self._target = self._resize.target(*self.display_size)
            self.frames = np.empty((self._num_samples, *self._target, 3), np.uint8)
        try:
            rgb = self._layout.to_rgb(pick.item)  # [H, W, 3]
        except (av.error.FFmpegError, ValueError) as e:
            raise UnsupportedCodec(
                f"frames in pixel format {pick.item.format.name} cannot be converted to RGB ({e})"
            ) from e
        if self._resize is not None:
            rgb = self._resize.apply(rgb, self._target)  # [target H, target W, 3]
        first = len(self.timestamps)
        self.frames[first : first + pick.num_samples] = rgb
        self.timestamps.extend([pick.time] * pick.num_samples)
