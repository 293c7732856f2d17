"""Where a stream's frames sit in time, and where the stream ends.

Times are seconds from the stream's own start_time (pts times the time base, minus the start),
so the first frame is at 0 whatever offset the container adds. Variable frame rates need no
special case: every frame carries its own pts. Streams without pts (raw H.264, some AVI) are
timed by adding up frame durations.
"""

from dataclasses import dataclass
from fractions import Fraction

import av
from av.container import InputContainer
from av.video.stream import VideoStream

from stillcut.vision.errors import CorruptVideo, TooManyFrames, VideoTooLong
from stillcut.vision.video_source import reason_of

_FALLBACK_FRAME_S = 1 / 25  # FFmpeg's default rate, for streams that give no timing at all


class StreamClock:
    """Seconds from the stream start for each frame or packet, in arrival order."""

    def __init__(self, stream: VideoStream) -> None:
        time_base = Fraction(stream.time_base)
        self.origin = Fraction(stream.start_time or 0) * time_base  # seconds
        # Integer arithmetic (an hour of packets is timed per plan): int / int rounds exactly
        # as float(Fraction) does. seconds = (pts * tb - origin) = (pts * a - b) / c.
        self._tb_num, self._tb_den = time_base.numerator, time_base.denominator
        self._a = time_base.numerator * self.origin.denominator
        self._b = self.origin.numerator * time_base.denominator
        self._c = time_base.denominator * self.origin.denominator
        rate = stream.average_rate or stream.guessed_rate
        self._default_step = 1 / float(rate) if rate else _FALLBACK_FRAME_S
        self._filled_time = 0.0  # where an item without pts starts: right after the previous one
        self.end = 0.0  # the latest end time seen so far

    def seconds(self, pts: int) -> float:
        """Seconds from the stream start at `pts`."""
        return (pts * self._a - self._b) / self._c

    def time_of(self, pts: int | None, duration: int | None) -> float:
        """Seconds from the stream start for the next item, with this pts and duration."""
        time = self._filled_time if pts is None else self.seconds(pts)
        step = duration * self._tb_num / self._tb_den if duration else self._default_step
        self._filled_time = time + step
        self.end = max(self.end, time + step)
        return time


def declared_clip_end(container: InputContainer, stream: VideoStream) -> float | None:
    """The stream's end in seconds from its start, as the headers declare it (None: unknown)."""
    if stream.duration and stream.duration > 0:
        return float(stream.duration * stream.time_base)
    if container.duration and container.duration > 0:
        container_end = Fraction((container.start_time or 0) + container.duration, av.time_base)
        return float(container_end - StreamClock(stream).origin)
    return None


@dataclass(frozen=True)
class PacketScan:
    """What demuxing a stream (without decoding it) tells: where it ends, every packet's pts in
    file order, which packets are keyframes and which an edit list discards."""

    end: float  # seconds from the stream start to the end of the last frame
    pts: tuple[int, ...] | None  # per packet, in file order; None when some packet has none
    complete: bool = True  # False: the scan stopped at `stop_after_s`, `end` is a lower bound
    keyframes: tuple[int, ...] = ()  # file positions (indices into `pts`) of keyframe packets
    discarded: frozenset[int] = frozenset()  # file positions of packets the decoder drops


def scan_packets(
    container: InputContainer,
    stream: VideoStream,
    max_packets: int,
    max_duration_s: float,
    stop_after_s: float | None = None,
) -> PacketScan:
    """Demux `stream` to its end: cheap next to decoding; raises as soon as a limit is crossed.

    The end it finds is the last packet's pts plus duration, which, unlike the headers, stays
    right for variable frame rate files with B-frames (MP4 muxers derive the declared duration
    from decode timestamps, which then fall short). Packets an edit list discards (their
    frames never leave the decoder) do not extend the end. With `stop_after_s`, the scan ends
    early (`complete=False`) once the stream is known to run past it.
    """
    clock = StreamClock(stream)
    all_pts: list[int] = []
    keyframes: list[int] = []
    discarded: set[int] = set()
    has_every_pts = True
    try:
        for packet in container.demux(stream):
            if packet.size == 0:  # the demuxer's end-of-stream marker
                continue
            position = len(all_pts)
            if position >= max_packets:
                raise TooManyFrames(
                    f"the stream has more than max_decoded_frames={max_packets} frames"
                )
            if packet.is_discard:
                discarded.add(position)
            else:
                clock.time_of(packet.pts, packet.duration)
            if clock.end > max_duration_s:
                raise VideoTooLong(
                    f"the video runs past {clock.end:g} s, over max_duration_s={max_duration_s:g}"
                )
            if stop_after_s is not None and clock.end > stop_after_s:
                return PacketScan(clock.end, None, complete=False)
            if packet.is_keyframe:
                keyframes.append(position)
            if packet.pts is None:
                has_every_pts = False
            all_pts.append(packet.pts)
    except av.error.FFmpegError as e:
        raise CorruptVideo(
            f"the container is corrupt near {clock.end:.2f} s ({reason_of(e)})"
        ) from e
    if not has_every_pts:
        return PacketScan(clock.end, None)
    return PacketScan(clock.end, tuple(all_pts), True, tuple(keyframes), frozenset(discarded))
