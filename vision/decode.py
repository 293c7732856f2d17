"""Video ingestion: open a video with PyAV and sample frames by presentation time.

`open_video` rejects what it can before decoding (bytes, header pixels, duration), scans the
packets (timestamps, keyframes) and plans the sample times (`sampling`); its reader then decodes
the stream once (`frame_pass`: front to back where samples are dense, seeking from keyframe to
keyframe where they are sparse), converting only the frames it keeps to upright RGB (`upright`),
resized as the model family will resize them (`frame_resize`), and hands each out as soon as it
is settled, so a long clip streams through in bounded memory. `decode_video` collects them.
`probe_video` stops before decoding: what a clip will cost (frames, their size) is known from
its headers and packet timestamps alone.
Every failure caused by the input is a `VideoError` (`errors`); no raw PyAV exception escapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from av.container import InputContainer
from av.stream import Disposition
from av.video.stream import VideoStream

from stillcut.engine.models.frame_resize import FrameResize
from stillcut.vision.decode_config import DecodeConfig, is_seconds
from stillcut.vision.errors import (
    FrameTooLarge,
    InvalidTimeRange,
    NotAVideo,
    NoVideoStream,
    UnsupportedCodec,
    VideoTooLong,
)
from stillcut.vision.frame_pass import (
    PassMisfire,
    PassPlan,
    SampledFrame,
    SkipPlan,
    iter_pass,
    plan_skips,
)
from stillcut.vision.sampling import TIME_EPS_S, SamplePlan, plan_samples
from stillcut.vision.timeline import declared_clip_end, scan_packets
from stillcut.vision.upright import display_size
from stillcut.vision.video_source import IMAGE_DEMUXERS, Source, VideoSource, open_source
from stillcut.vision.work import VisionWork

__all__ = [
    "DecodeConfig",
    "DecodedVideo",
    "VideoProbe",
    "VideoReader",
    "decode_video",
    "open_video",
    "probe_video",
]


@dataclass(frozen=True)
class DecodedVideo:
    """The sampled frames of one clip and where in the clip they came from."""

    frames: np.ndarray  # [T, H, W, 3] uint8, upright RGB (at the resize target, when given one)
    timestamps: list[float]  # seconds from the stream start: the pts of each sampled frame
    sample_fps: float  # fps, or max_frames / duration when the range was capped
    source_fps: float | None  # the stream's average frame rate, when it declares one
    duration: float  # seconds of the decoded range
    codec: str
    width: int  # as displayed: after rotation and the aspect-ratio fix, before any resize
    height: int

    def __post_init__(self) -> None:
        assert self.frames.dtype == np.uint8 and self.frames.ndim == 4, self.frames.shape
        assert self.frames.shape[3] == 3, self.frames.shape
        assert len(self.timestamps) == len(self.frames) >= 1

    @property
    def source_indices(self) -> tuple[int, ...]:
        """Each sampled frame's index in the stream (see `source_indices`)."""
        return source_indices(self.timestamps, self.source_fps)


def source_indices(timestamps: Sequence[float], source_fps: float | None) -> tuple[int, ...]:
    """Each sampled frame's index in the stream, counted at its average frame rate (exact for
    constant-rate streams); empty when the stream declares no rate."""
    if not source_fps:
        return ()
    return tuple(round(t * source_fps) for t in timestamps)


@dataclass(frozen=True)
class VideoProbe:
    """What decoding a clip would sample, known before any frame is decoded."""

    num_samples: int  # frames the sampling plan takes (a lower bound when not `complete`)
    width: int  # as the header declares frames to display, before any rotation
    height: int
    duration: float  # seconds of the range (so far, when not `complete`)
    complete: bool  # False: the packet scan stopped once `num_samples` passed `max_samples`
    sample_times: tuple[float, ...] = ()  # the plan's times (empty when not `complete`)
    frame_times: tuple[float, ...] | None = None  # the pts time of the frame each one takes
    sample_fps: float = 0.0
    source_fps: float | None = None
    codec: str = ""
    num_seeks: int | None = None  # seeks past unsampled stretches (None: no packet index)
    start: float = 0.0  # seconds from the stream start where the range begins


class VideoReader:
    """An open video whose sample plan is known (`probe`); `frames()` decodes it once,
    handing out each sampled frame as soon as it is settled."""

    def __init__(self, media: VideoSource, container: InputContainer, probe: _Probe) -> None:
        self._media = media
        self._container = container
        self._probe = probe

    @property
    def probe(self) -> VideoProbe:
        return self._probe.public()

    def frames(
        self, *, resize: FrameResize | None = None, work: VisionWork | None = None
    ) -> Iterator[SampledFrame]:
        """The sampled frames in order; a pass whose shortcut misfires goes on plainly on a
        fresh container from the first sample it had not handed out."""
        probe, config = self._probe, self._probe.config
        output = {"resize": resize, "work": work}
        fast = PassPlan(probe.plan.times, seek=True, skip=probe.skip)
        stream = self._container.streams[probe.stream_index]
        try:
            yield from iter_pass(self._container, stream, fast, config, **output)
            return
        except PassMisfire as misfire:
            num_done = misfire.num_emitted
        plain = PassPlan(probe.plan.times, seek=False, skip=None)
        with self._media.open_container() as container:
            stream = container.streams[probe.stream_index]
            yield from iter_pass(container, stream, plain, config, num_done=num_done, **output)

    def decode(
        self, *, resize: FrameResize | None = None, work: VisionWork | None = None
    ) -> DecodedVideo:
        """Every sampled frame at once (`frames()` collected)."""
        probe = self.probe
        frames: np.ndarray | None = None
        timestamps: list[float] = []
        for sampled in self.frames(resize=resize, work=work):
            if frames is None:
                frames = np.empty((probe.num_samples, *sampled.rgb.shape), np.uint8)
                display_height, display_width = sampled.display_size
            frames[len(timestamps) : len(timestamps) + sampled.num_samples] = sampled.rgb
            timestamps.extend([sampled.time] * sampled.num_samples)
        assert frames is not None and len(timestamps) == len(frames)  # a pass yields or raises
        return DecodedVideo(
            frames=frames,
            timestamps=timestamps,
            sample_fps=probe.sample_fps,
            source_fps=probe.source_fps,
            duration=probe.duration,
            codec=probe.codec,
            width=display_width,
            height=display_height,
        )


@contextmanager
def open_video(
    source: Source,
    config: DecodeConfig = DecodeConfig(),
    *,
    start: float | None = None,
    end: float | None = None,
) -> Iterator[VideoReader]:
    """Open `source`, check its headers and plan its samples over [start, end) seconds, without
    decoding a frame; the reader's `frames()` then decodes (see `decode_video`)."""
    _check_time_arguments(start, end)
    with open_source(source, config.max_bytes) as media, media.open_container() as container:
        yield VideoReader(media, container, _probe(container, config, start, end))


def decode_video(
    source: Source,
    config: DecodeConfig = DecodeConfig(),
    *,
    start: float | None = None,
    end: float | None = None,
    resize: FrameResize | None = None,
    work: VisionWork | None = None,
) -> DecodedVideo:
    """Decode `source` and sample frames at `config.fps` over [start, end) seconds.

    `source` is a path, the file's bytes, or a binary file object (read from its start, left
    open). `start` / `end` default to the clip's start and end; an `end` past the clip is
    clamped. With `resize`, frames are held at the size the model family resizes them to
    (never all at display size). Frames out of the decoder count in `work`. Raises a
    `VideoError` subclass for every input-caused failure.
    """
    with open_video(source, config, start=start, end=end) as reader:
        return reader.decode(resize=resize, work=work)


def probe_video(
    source: Source,
    config: DecodeConfig = DecodeConfig(),
    *,
    start: float | None = None,
    end: float | None = None,
    max_samples: Callable[[int, int], int] | None = None,
) -> VideoProbe:
    """How many frames decoding `source` would sample, and their size, without decoding one:
    the header checks, the packet scan and the sample plan of `decode_video`.

    `max_samples(width, height)` is the most frames the caller can afford at the display size
    the header declares; the scan stops as soon as the plan is known to pass it, so a clip
    that declares no duration costs no more to refuse than one that does.
    """
    _check_time_arguments(start, end)
    with open_source(source, config.max_bytes) as media, media.open_container() as container:
        return _probe(container, config, start, end, max_samples).public()


def _check_time_arguments(start: float | None, end: float | None) -> None:
    for name, value in (("start", start), ("end", end)):
        if value is not None and not is_seconds(value):
            raise InvalidTimeRange(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    if end is not None and end <= (start or 0.0):
        raise InvalidTimeRange(f"end={end:g} s must be after start={start or 0.0:g} s")


@dataclass(frozen=True)
class _Probe:
    stream_index: int
    codec: str
    source_fps: float | None
    width: int
    height: int
    range_start: float
    range_end: float
    plan: SamplePlan
    skip: SkipPlan | None
    complete: bool
    config: DecodeConfig

    def public(self) -> VideoProbe:
        return VideoProbe(
            num_samples=len(self.plan.times),
            width=self.width,
            height=self.height,
            duration=self.range_end - self.range_start,
            complete=self.complete,
            sample_times=self.plan.times if self.complete else (),
            frame_times=None if self.skip is None else self.skip.expected_timestamps,
            sample_fps=self.plan.sample_fps,
            source_fps=self.source_fps,
            codec=self.codec,
            num_seeks=None if self.skip is None else self.skip.num_seeks,
            start=self.range_start,
        )


def _probe(
    container: InputContainer,
    config: DecodeConfig,
    start: float | None,
    end: float | None,
    max_samples: Callable[[int, int], int] | None = None,
) -> _Probe:
    """Header checks, a packet scan and the sample plan."""
    stream = _video_stream(container)
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > config.max_pixels:
        raise FrameTooLarge(
            f"the header declares {width}x{height} = {width * height} pixels per frame, "
            f"over max_pixels={config.max_pixels}"
        )
    declared_end = declared_clip_end(container, stream)
    if declared_end is not None and declared_end > config.max_duration_s:  # reject before reading
        raise VideoTooLong(
            f"the video lasts {declared_end:g} s; {declared_end:g} s exceeds "
            f"max_duration_s={config.max_duration_s:g}"
        )
    display_width, display_height = display_size(width, height, stream)
    affordable = None if max_samples is None else max_samples(display_width, display_height)
    # The scan finds the true end (and raises past max_duration_s) and every frame's pts.
    stop_after_s = _affordable_end(config, start, end, affordable)
    scan = scan_packets(
        container, stream, config.max_decoded_frames, config.max_duration_s, stop_after_s
    )
    range_start, range_end = _clip_range(start, end, scan.end)
    plan = plan_samples(
        range_start, range_end - range_start, config.fps, config.max_frames, config.num_frames
    )
    rate = stream.average_rate
    return _Probe(
        stream_index=stream.index,
        codec=stream.codec_context.name,
        source_fps=float(rate) if rate else None,
        width=display_width,
        height=display_height,
        range_start=range_start,
        range_end=range_end,
        plan=plan,
        skip=None if scan.pts is None else plan_skips(stream, scan, plan.times),
        complete=scan.complete,
        config=config,
    )


def _affordable_end(
    config: DecodeConfig, start: float | None, end: float | None, max_samples: int | None
) -> float | None:
    """The stream time past which the plan would take more than `max_samples` frames (None:
    no such time, the frame cap or `end` comes first)."""
    if max_samples is None or max_samples >= config.max_frames or config.num_frames is not None:
        return None
    # plan_samples takes ceil(duration * fps - eps) frames while under the cap
    affordable_end = (start or 0.0) + (max_samples + TIME_EPS_S) / config.fps
    return None if end is not None and end <= affordable_end else affordable_end


def _clip_range(start: float | None, end: float | None, clip_end: float) -> tuple[float, float]:
    """[start, end) in seconds, checked against the clip; `end` is clamped to the clip."""
    range_start = start or 0.0
    if start is not None and range_start >= clip_end:
        raise InvalidTimeRange(
            f"start={range_start:g} s is not inside the clip; allowed: 0 <= start < {clip_end:g}"
        )
    return range_start, clip_end if end is None else min(end, clip_end)


def _video_stream(container: InputContainer) -> VideoStream:
    if container.format.name in IMAGE_DEMUXERS:
        raise NotAVideo(
            f"the input is a still image ({container.format.name.removesuffix('_pipe')}), "
            "not a video; send a video file such as MP4 or WebM"
        )
    streams = [s for s in container.streams.video if not s.disposition & Disposition.attached_pic]
    if not streams:
        found = ", ".join(sorted({s.type for s in container.streams})) or "none"
        raise NoVideoStream(
            f"the input has no video stream (streams found: {found}); a video track is required"
        )
    if streams[0].codec_context is None:
        raise UnsupportedCodec(
            "the video stream's codec cannot be decoded by this build; supported codecs "
            "include H.264, HEVC, VP8, VP9, AV1, MPEG-4, MJPEG and ProRes"
        )
    return streams[0]
