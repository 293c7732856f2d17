"""One decoding pass over a video stream, handing out the sampled frames one by one.

Frames arrive in presentation order and go through `FrameSelector`; only picked frames are
converted to RGB, and each leaves the pass as soon as it is settled, so a caller holds only
what it keeps. Which frames get picked is known before decoding, from the packet scan
(`plan_skips`), and makes the pass cheaper than decoding everything:

- a frame no sample picks is not decoded at all when no other frame references it (FFmpeg's
  `skip_frame = NONREF`, switched per packet): about half the frames of a B-frame stream;
- where the next wanted frame lies past a keyframe that follows every packet decoded so far,
  the pass drains the decoder and seeks to that keyframe instead of decoding what lies
  between (sparse sampling: samples further apart than the keyframe interval). The first
  jump also takes the pass from wherever the packet scan left the container to the range.

Both are exact as long as the container's timestamps are honest. The pass checks that they
were (each seek lands on the keyframe it aimed at; each pick is the predicted one) and raises
`PassMisfire` at the first deviation, saying how many samples it already handed out, so the
caller reruns plainly on a fresh container from there.
"""

import bisect
import math
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
from stillcut.vision.timeline import PacketScan, StreamClock
from stillcut.vision.upright import UprightLayout, layout_for
from stillcut.vision.video_source import reason_of
from stillcut.vision.work import VisionWork

# Picked frames converting on the worker while the decoder goes on: a few full-size frames.
CONVERT_AHEAD = 3

# Without a packet index, seek this far before `start`: keyframe indexes may hold decode
# times, which lead presentation times by the B-frame delay, so a seek straight to `start`
# can land too late.
SEEK_PREROLL_S = 1.0


# Jump only past at least this many packets: a seek drains the decoder and restarts its
# threads, which costs about what decoding a few dozen small inter frames does.
MIN_PACKETS_SKIPPED = 24


class PassMisfire(Exception):
    """A shortcut of the pass did not hold; `num_emitted` samples were already handed out
    (all of them right: each matched the prediction)."""

    def __init__(self, num_emitted: int) -> None:
        super().__init__(f"the pass misfired after {num_emitted} samples")
        self.num_emitted = num_emitted


@dataclass(frozen=True)
class Jump:
    """Once the packet at file position `after` is decoded (-1: before any), drain the decoder
    and seek to the keyframe at file position `to` (pts `keyframe_pts`)."""

    after: int
    to: int
    keyframe_pts: int


@dataclass(frozen=True)
class SkipPlan:
    """The frames worth decoding, predicted from the packet scan, and the expected result."""

    wanted_pts: frozenset[int]
    expected_timestamps: tuple[float, ...]
    jumps: tuple[Jump, ...] = ()

    @property
    def num_seeks(self) -> int:
        """Seeks the pass makes besides the first (which brings it to the range)."""
        return max(0, len(self.jumps) - 1)


@dataclass(frozen=True)
class SampledFrame:
    """One picked frame, as the pass hands it out."""

    rgb: np.ndarray  # [H, W, 3] uint8 upright RGB, at the resize target
    time: float  # its presentation time, seconds from the stream start
    num_samples: int  # consecutive sample slots it fills
    display_size: tuple[int, int]  # (height, width) upright, before any resize


@dataclass(frozen=True)
class PassPlan:
    """What one pass samples, and which shortcuts it may take."""

    sample_times: tuple[float, ...]
    seek: bool  # the container may have been read: seek to the range first
    skip: SkipPlan | None  # None: decode every frame (after a seek by time, if `seek`)


def plan_skips(stream: VideoStream, scan: PacketScan, sample_times: tuple[float, ...]) -> SkipPlan:
    """Which frames the sampling rule will pick, and where to seek, from the packet scan."""
    assert scan.pts is not None
    clock = StreamClock(stream)
    frames = sorted(  # presentation order; an edit list's discarded frames never show
        (clock.seconds(pts), position)
        for position, pts in enumerate(scan.pts)
        if position not in scan.discarded
    )
    picks = predict_picks(frames, sample_times)
    expected = tuple(pick.time for pick in picks for _ in range(pick.num_samples))
    wanted = sorted(pick.item for pick in picks)  # file positions
    jumps = _jumps(scan, wanted)
    return SkipPlan(frozenset(scan.pts[p] for p in wanted), expected, jumps)


def _jumps(scan: PacketScan, wanted: list[int]) -> tuple[Jump, ...]:
    """A seek before each wanted packet whose keyframe lies well past every packet needed
    before (the first always: the packet scan left the container at its end)."""
    assert scan.pts is not None
    jumps, reach = [], -1
    for position in wanted:
        keyframe = _keyframe_before(scan, position)
        if keyframe is None:
            return ()  # no keyframe to start from: decode from the top
        if not jumps or keyframe > reach + MIN_PACKETS_SKIPPED:
            jumps.append(Jump(reach, keyframe, scan.pts[keyframe]))
        reach = max(reach, position)
    return tuple(jumps)


def _keyframe_before(scan: PacketScan, position: int) -> int | None:
    """The last keyframe at or before `position` in file order whose frame is shown no later
    than the wanted one (an open GOP's leading frames need the keyframe before)."""
    assert scan.pts is not None
    index = bisect.bisect_right(scan.keyframes, position) - 1
    while index >= 0 and scan.pts[scan.keyframes[index]] > scan.pts[position]:
        index -= 1
    return scan.keyframes[index] if index >= 0 else None


def iter_pass(
    container: InputContainer,
    stream: VideoStream,
    plan: PassPlan,
    config: DecodeConfig,
    *,
    resize: FrameResize | None = None,
    work: VisionWork | None = None,
    num_done: int = 0,
) -> Iterator[SampledFrame]:
    """The sampled frames (resized by `resize`, if given), in sample order, leaving out the
    first `num_done` sample slots (handed out by a pass that misfired). Every frame out of
    the decoder counts in `work`. Raises `PassMisfire` when a shortcut misfires."""
    converter = _FrameConverter(stream, config.max_pixels, resize)
    with ThreadPoolExecutor(1, thread_name_prefix="convert") as pool:
        emitter = _Emitter(converter, plan.skip, num_done, pool)
        yield from _run_pass(container, stream, plan, config, work, emitter)


def _run_pass(
    container: InputContainer,
    stream: VideoStream,
    plan: PassPlan,
    config: DecodeConfig,
    work: VisionWork | None,
    emitter: "_Emitter",
) -> Iterator[SampledFrame]:
    """`iter_pass`'s loop: decode, settle picks, hand them to `emitter`, check shortcuts."""
    num_done = emitter.num_handed_out
    start = plan.sample_times[0]
    clock = StreamClock(stream)
    jumps = plan.skip.jumps if plan.skip is not None and plan.seek else ()
    seek_by_time = plan.seek and not jumps
    selector: FrameSelector[VideoFrame] = FrameSelector(plan.sample_times)
    if seek_by_time and not _seek_to(container, stream, clock, max(0.0, start - SEEK_PREROLL_S)):
        raise PassMisfire(num_done)
    num_frames = 0
    try:
        for time, frame in _decoded_frames(container, stream, clock, config, plan.skip, jumps):
            num_frames += 1
            if work is not None:
                work.frames_decoded += 1
            late = frame.pts is None or time > start + TIME_EPS_S
            if seek_by_time and num_frames == 1 and late:
                raise PassMisfire(num_done)
            yield from emitter.emit(selector.push(time, frame))
            if selector.done:
                break
    except _SeekMissed:
        yield from emitter.flush()
        raise PassMisfire(emitter.num_handed_out) from None
    if plan.seek and num_frames == 0:
        raise PassMisfire(num_done)
    yield from emitter.finish(selector.finish())
    if emitter.num_slots == 0:
        raise NoFrames("the video stream has no decodable frames; at least one is required")


class _SeekMissed(Exception):
    """A seek landed somewhere other than the keyframe it aimed at (or failed)."""


class _Emitter:
    """Turns picks into `SampledFrame`s: checks each against the prediction, leaves out slots
    handed out before, converts the rest on a worker thread (the RGB conversion and resize
    release the GIL, so they run beside the decoder), `CONVERT_AHEAD` at most in flight."""

    def __init__(
        self,
        converter: "_FrameConverter",
        skip: SkipPlan | None,
        num_done: int,
        pool: ThreadPoolExecutor,
    ) -> None:
        self._converter = converter
        self._expected = skip.expected_timestamps if skip is not None else None
        self._num_done = num_done
        self._pool = pool
        self._pending: deque[tuple[Future, float, int, int]] = deque()
        self.num_slots = 0  # sample slots settled so far
        self._num_yielded = num_done  # slots handed out: what a misfire reports

    @property
    def num_handed_out(self) -> int:
        return self._num_yielded

    def emit(self, pick: Pick[VideoFrame] | None) -> Iterator[SampledFrame]:
        if pick is not None:
            first, self.num_slots = self.num_slots, self.num_slots + pick.num_samples
            if self._expected is not None and any(
                time != pick.time for time in self._expected[first : self.num_slots]
            ):  # the picks before this one were right: hand them out first
                yield from self.flush()
                raise PassMisfire(self._num_yielded)
            if self.num_slots > self._num_done:
                self._converter.start(pick.item)
                future = self._pool.submit(self._converter.convert, pick.item)
                num_new = self.num_slots - max(first, self._num_done)
                self._pending.append((future, pick.time, num_new, self.num_slots))
        yield from self._drain(CONVERT_AHEAD)

    def finish(self, pick: Pick[VideoFrame] | None) -> Iterator[SampledFrame]:
        yield from self.emit(pick)
        yield from self.flush()

    def flush(self) -> Iterator[SampledFrame]:
        """Every frame still converting, in order."""
        yield from self._drain(0)

    def _drain(self, keep: int) -> Iterator[SampledFrame]:
        while len(self._pending) > keep:
            future, time, num_new, slot_end = self._pending.popleft()
            rgb = future.result()
            self._num_yielded = slot_end
            yield SampledFrame(rgb, time, num_new, self._converter.display_size)


def _seek_to(
    container: InputContainer, stream: VideoStream, clock: StreamClock, time: float
) -> bool:
    """Seek to a keyframe before `time` (seconds from the stream start); False if unsupported."""
    target = math.floor((clock.origin + Fraction(time)) / stream.time_base)
    try:
        container.seek(target, stream=stream, backward=True)
    except av.error.FFmpegError:
        return False
    return True


def _packets(
    container: InputContainer, stream: VideoStream, jumps: tuple[Jump, ...]
) -> Iterator[av.Packet | None]:
    """The stream's packets, taking each jump once the packet before it is out; None asks the
    caller to drain the decoder before a jump. Without jumps: from where the container is."""
    packets: Iterator[av.Packet] = iter(()) if jumps else container.demux(stream)
    position, num_jumps = -1, 0  # file position of the last packet out
    while True:
        if num_jumps < len(jumps) and jumps[num_jumps].after == position:
            if position >= 0:
                yield None
            packets = _landed(container, stream, jumps[num_jumps])
            position = jumps[num_jumps].to - 1
            num_jumps += 1
        packet = next(packets, None)
        if packet is None:
            return
        if packet.size:
            position += 1
        yield packet


def _landed(container: InputContainer, stream: VideoStream, jump: Jump) -> Iterator[av.Packet]:
    """Packets from the keyframe `jump` aims at; `_SeekMissed` if the seek lands elsewhere."""
    try:
        container.seek(jump.keyframe_pts, stream=stream, backward=True)
    except av.error.FFmpegError:
        raise _SeekMissed() from None
    packets = container.demux(stream)
    first = next((packet for packet in packets if packet.size), None)
    if first is None or first.pts != jump.keyframe_pts:
        raise _SeekMissed()
    yield first
    yield from packets


def _decoded_frames(
    container: InputContainer,
    stream: VideoStream,
    clock: StreamClock,
    config: DecodeConfig,
    skip: SkipPlan | None,
    jumps: tuple[Jump, ...],
) -> Iterator[tuple[float, VideoFrame]]:
    """Yield (seconds, frame) in presentation order, enforcing the per-frame limits."""
    codec = stream.codec_context
    wanted_pts = skip.wanted_pts if skip is not None else None
    num_decoded = 0
    try:
        for packet in _packets(container, stream, jumps):
            if packet is not None and wanted_pts is not None:
                # Read per packet by the decoder (the default slice threading decodes each
                # packet as it is sent); a frame that others reference is decoded regardless.
                is_wanted = packet.pts is None or packet.pts in wanted_pts
                codec.skip_frame = "DEFAULT" if is_wanted else "NONREF"
            for frame in codec.decode(packet):
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


class _FrameConverter:
    """Converts picked frames to upright RGB at the size `resize` targets (display size
    without one), so only one frame is ever held at display size."""

    def __init__(self, stream: VideoStream, max_pixels: int, resize: FrameResize | None) -> None:
        self._stream = stream
        self._max_pixels = max_pixels
        self._resize = resize
        self._layout: UprightLayout | None = None
        self._target = (0, 0)  # (height, width) frames are handed out at
        self.display_size = (0, 0)  # (height, width) upright, before any resize

    def start(self, frame: VideoFrame) -> None:
        """Fix the layout from the clip's first picked frame (before any `convert`)."""
        if self._layout is None:
            self._layout = layout_for(frame, self._stream, self._max_pixels)
            self.display_size = self._target = self._layout.output_size
            if self._resize is not None:
                self._target = self._resize.target(*self.display_size)

    def convert(self, frame: VideoFrame) -> np.ndarray:
        """[H, W, 3] uint8 upright RGB at the target size (thread-safe once `start`ed)."""
        assert self._layout is not None
        fast = self._resize is not None and self._resize.fast
        try:
            rgb = self._layout.to_rgb(frame, self._target if fast else None)  # [H, W, 3]
        except (av.error.FFmpegError, ValueError) as e:
            raise UnsupportedCodec(
                f"frames in pixel format {frame.format.name} cannot be converted to RGB ({e})"
            ) from e
        if self._resize is not None and not fast:
            rgb = self._resize.apply(rgb, self._target)  # [target H, target W, 3]
        return np.ascontiguousarray(rgb)
