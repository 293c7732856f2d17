"""decode_video on real files written with PyAV: the sampling rule, ranges, sources, and
every piece of metadata that changes what an upright RGB frame looks like."""

import io
from fractions import Fraction

import numpy as np
import pytest

from stillcut.vision.decode import DecodeConfig, DecodedVideo, decode_video
from stillcut.vision.errors import InvalidTimeRange
from stillcut.vision.synthetic import gray_frames, quadrant_frame, write_video
from stillcut.vision.synthetic import near_lossless_h264 as h264_options

LEVEL_STEP = 6  # gray levels of consecutive frames; colour round trips move a level by <= 2


def _levels(num_frames):
    return [10 + LEVEL_STEP * i for i in range(num_frames)]


def _frame_indices(video: DecodedVideo) -> list[int]:
    """Which source frame each output frame is, read back from its gray level."""
    means = video.frames.reshape(len(video.frames), -1).mean(axis=1)
    return [round((m - 10) / LEVEL_STEP) for m in means]


@pytest.fixture(scope="module")
def clip_4s(tmp_path_factory):
    """40 frames at 10 fps, a keyframe every 8 frames, with B-frames; frame i has level i."""
    path = tmp_path_factory.mktemp("clips") / "clip_4s.mp4"
    options = {**h264_options(), "g": "8"}
    write_video(path, gray_frames(_levels(40)), time_base=Fraction(1, 10), options=options)
    return path


VFR_PTS_MS = [0, 40, 90, 300, 310, 320, 900, 1000, 1500, 1990]


@pytest.fixture(scope="module")
def vfr_clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("clips") / "vfr.mp4"
    frames = gray_frames(_levels(len(VFR_PTS_MS)))
    write_video(path, frames, pts=VFR_PTS_MS, time_base=Fraction(1, 1000), options=h264_options())
    return path


def test_variable_frame_rate_picks_the_last_frame_at_or_before_each_time(vfr_clip):
    video = decode_video(vfr_clip, DecodeConfig(fps=10))
    # Times 0.0, 0.1, ..., 1.9: the last frame lasts one tick (1 ms), so the clip ends at 1.991 s
    # (the MP4 header says 1.091 s: with B-frames the muxer counts decode timestamps).
    expected = [0, 2, 2, 3, 5, 5, 5, 5, 5, 6, 7, 7, 7, 7, 7, 8, 8, 8, 8, 8]
    assert _frame_indices(video) == expected
    assert video.timestamps == pytest.approx([VFR_PTS_MS[i] / 1000 for i in expected])
    assert video.sample_fps == 10.0


def test_default_rate_on_variable_frame_rate_clip(vfr_clip):
    video = decode_video(vfr_clip)
    assert _frame_indices(video) == [0, 5, 7, 8]  # times 0, 0.5, 1.0, 1.5
    assert video.frames.shape == (4, 48, 64, 3) and video.frames.dtype == np.uint8
    assert video.duration == pytest.approx(1.991)


def test_clip_shorter_than_one_interval_gives_its_first_frame(tmp_path):
    path = tmp_path / "short.mp4"
    write_video(path, gray_frames(_levels(3)), time_base=Fraction(1, 30), options=h264_options())
    video = decode_video(path, DecodeConfig(fps=2))
    assert _frame_indices(video) == [0] and video.timestamps == [0.0]
    assert video.sample_fps == 2.0 and video.duration == pytest.approx(0.1)


def test_long_clip_is_sampled_evenly_at_max_frames(clip_4s):
    video = decode_video(clip_4s, DecodeConfig(fps=4, max_frames=6))
    # 4 s > 6 / 4 fps: six times 4 / 6 s apart.
    assert _frame_indices(video) == [0, 6, 13, 20, 26, 33]
    assert video.timestamps == pytest.approx([0.0, 0.6, 1.3, 2.0, 2.6, 3.3])
    assert video.sample_fps == pytest.approx(1.5)
    assert (video.duration, video.codec, video.source_fps) == (pytest.approx(4.0), "h264", 10.0)


def test_start_and_end_sample_only_the_range(clip_4s):
    # start lies past two keyframes, so this decodes after a seek.
    video = decode_video(clip_4s, DecodeConfig(fps=2), start=2.65, end=3.7)
    assert _frame_indices(video) == [26, 31, 36]  # times 2.65, 3.15, 3.65
    assert video.timestamps == pytest.approx([2.6, 3.1, 3.6])
    assert video.duration == pytest.approx(1.05)


def test_range_with_a_seek_matches_decoding_from_the_top(clip_4s):
    config = DecodeConfig(fps=10)
    whole = decode_video(clip_4s, config)
    ranged = decode_video(clip_4s, config, start=1.7)
    np.testing.assert_array_equal(ranged.frames, whole.frames[17:])
    assert ranged.timestamps == whole.timestamps[17:]


def test_end_past_the_clip_is_clamped(clip_4s):
    video = decode_video(clip_4s, DecodeConfig(fps=1), start=1.0, end=99.0)
    assert _frame_indices(video) == [10, 20, 30] and video.duration == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("start", "end", "phrase"),
    [
        (-1.0, None, "start must be a finite number of seconds >= 0"),
        (float("nan"), None, "start must be a finite number"),
        (None, float("inf"), "end must be a finite number"),
        (2.0, 2.0, "end=2 s must be after start=2 s"),
        (None, 0.0, "end=0 s must be after start=0 s"),
        (4.0, None, "start=4 s is not inside the clip; allowed: 0 <= start < 4"),
    ],
)
def test_invalid_time_ranges_are_rejected(clip_4s, start, end, phrase):
    with pytest.raises(InvalidTimeRange, match=phrase):
        decode_video(clip_4s, start=start, end=end)


class _NonSeekable(io.RawIOBase):
    """A pipe-like stream: it reads (or writes) forward only."""

    def __init__(self, data: bytes = b"") -> None:
        self._source = io.BytesIO(data)
        self.written = bytearray()

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._source.readinto(buffer)

    def write(self, data) -> int:
        self.written += bytes(data)
        return len(data)


def test_every_source_kind_gives_the_same_result(clip_4s):
    data = clip_4s.read_bytes()
    expected = decode_video(clip_4s)
    with open(clip_4s, "rb") as handle:
        sources = [str(clip_4s), data, bytearray(data), io.BytesIO(data), handle]
        sources.append(_NonSeekable(data))
        for source in sources:
            video = decode_video(source)
            np.testing.assert_array_equal(video.frames, expected.frames)
            assert video.timestamps == expected.timestamps
        assert not handle.closed  # the caller's file object stays the caller's


def test_a_source_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match="source must be a path, bytes or a binary file object"):
        decode_video(12345)


def test_stream_without_a_declared_duration_is_scanned(tmp_path):
    # A live-muxed WebM (written to a pipe) has neither a duration nor a segment size.
    sink = _NonSeekable()
    write_video(sink, gray_frames(_levels(20)), container_format="webm", codec="libvpx-vp9",
                time_base=Fraction(1, 10), options={"lossless": "1"})  # fmt: skip
    video = decode_video(bytes(sink.written), DecodeConfig(fps=4))
    assert _frame_indices(video) == [0, 2, 5, 7, 10, 12, 15, 17]  # times 0, 0.25, ... 1.75
    assert video.duration == pytest.approx(2.0)


def test_raw_h264_without_timestamps_is_timed_by_frame_durations(tmp_path):
    path = tmp_path / "raw.h264"
    write_video(path, gray_frames(_levels(20)), container_format="h264",
                time_base=Fraction(1, 10), options=h264_options())  # fmt: skip
    video = decode_video(path, DecodeConfig(fps=2))
    assert _frame_indices(video) == [0, 5, 10, 15]
    assert video.timestamps == pytest.approx([0.0, 0.5, 1.0, 1.5])


def _assert_same_off_edges(frame, expected, margin=4):
    """Colours match away from the quadrant borders, where 4:2:0 chroma and scaling blur."""
    assert frame.shape == expected.shape
    height, width = expected.shape[:2]
    inside = np.ones((height, width), bool)
    inside[height // 2 - margin : height // 2 + margin] = False
    inside[:, width // 2 - margin : width // 2 + margin] = False
    assert np.abs(frame - expected)[inside].max() <= 6


def _decode_quadrants(tmp_path, **write_options):
    path = tmp_path / f"clip.{write_options.get('container_format', 'mp4')}"
    write_video(path, [quadrant_frame()] * 3, options=h264_options(), **write_options)
    return decode_video(path).frames[0].astype(int)


@pytest.mark.parametrize(
    ("rotation", "hflip", "vflip"),
    [(90, False, False), (-90, False, False), (180, False, False), (0, True, False),
     (0, False, True), (90, True, False), (-90, False, True)],
)  # fmt: skip
def test_display_matrix_is_applied(tmp_path, rotation, hflip, vflip):
    frame = _decode_quadrants(tmp_path, rotation=rotation, hflip=hflip, vflip=vflip)
    # PyAV's meaning: turn counter-clockwise by `rotation`, then mirror.
    expected = np.rot90(quadrant_frame(), rotation // 90)
    expected = expected[:, ::-1] if hflip else expected
    expected = expected[::-1] if vflip else expected
    _assert_same_off_edges(frame, expected)


def test_legacy_rotate_tag_is_applied(tmp_path):
    frame = _decode_quadrants(tmp_path, container_format="matroska",
                              stream_metadata={"rotate": "90"})  # fmt: skip
    _assert_same_off_edges(frame, np.rot90(quadrant_frame(), -1))  # the tag turns clockwise


@pytest.mark.parametrize("aspect", [Fraction(2, 1), Fraction(1, 2)])
def test_non_square_pixels_are_stretched_to_the_display_aspect(tmp_path, aspect):
    frame = _decode_quadrants(tmp_path, sample_aspect_ratio=aspect)
    _assert_same_off_edges(frame, quadrant_frame(width=int(64 * aspect)))


@pytest.mark.parametrize(
    ("codec", "container_format", "pix_fmt", "options"),
    [
        ("libx264", "mp4", "yuv420p", h264_options()),
        ("libx264", "mp4", "yuvj420p", h264_options()),  # full range
        ("libx264", "mp4", "yuv420p10le", h264_options()),
        ("libx264", "matroska", "yuv444p", h264_options()),
        ("libvpx-vp9", "webm", "yuv420p", {"lossless": "1"}),
        ("mpeg4", "avi", "yuv420p", {"qscale": "1"}),
    ],
)
def test_pixel_formats_and_ranges_decode_to_the_same_rgb(
    tmp_path, codec, container_format, pix_fmt, options
):
    # A dark gray reads back 12 levels off when a full-range frame is taken as limited range.
    source = quadrant_frame()
    source[:12] = 40
    path = tmp_path / "clip"
    write_video(path, [source] * 3, codec=codec, container_format=container_format,
                pix_fmt=pix_fmt, options=options)  # fmt: skip
    frame = decode_video(path).frames[0].astype(int)
    assert np.abs(frame[:6] - 40).max() <= 3
    for rows in (slice(16, 20), slice(28, 44)):  # inside the four quadrants
        for cols in (slice(4, 28), slice(36, 60)):
            assert np.abs(frame[rows, cols] - source[rows, cols]).max() <= 6


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("fps", 0, "a finite number > 0"),
        ("fps", float("nan"), "a finite number > 0"),
        ("max_duration_s", -5.0, "a finite number > 0"),
        ("max_duration_s", float("inf"), "a finite number > 0"),
        ("max_frames", 0, "an integer >= 1"),
        ("max_frames", 2.5, "an integer >= 1"),
        ("max_bytes", True, "an integer >= 1"),
        ("max_pixels", -1, "an integer >= 1"),
        ("max_decoded_frames", "10", "an integer >= 1"),
    ],
)
def test_config_validation_names_the_field_and_allowed_range(field, value, allowed):
    with pytest.raises(ValueError, match=f"DecodeConfig.{field} must be {allowed}, got"):
        DecodeConfig(**{field: value})
