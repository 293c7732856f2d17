"""Broken and hostile inputs: each must fail fast with the right `VideoError` and a message
that says what is wrong, whether it arrives as a path, as bytes or as a file object, and
without leaking a file descriptor."""

import gc
import io
import os
import struct
import time
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image

from stillcut.vision import errors
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.synthetic import gray_frames, moving_texture, quadrant_frame, write_video

MAX_SECONDS_PER_CASE = 5.0  # generous for a shared machine; every case takes milliseconds


@dataclass(frozen=True)
class Case:
    data: bytes
    error: type[errors.VideoError]
    phrase: str  # part of the message a user would need
    config: DecodeConfig = DecodeConfig()
    suffix: str = ".mp4"  # how the file is named on disk: FFmpeg must not trust it


def _encode(tmp_path, name, frames, **options) -> bytes:
    path = tmp_path / name
    write_video(path, frames, **options)
    return path.read_bytes()


def _image(kind: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(quadrant_frame()).save(buffer, kind)
    return buffer.getvalue()


def _audio_only(path) -> bytes:
    with av.open(path, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        for index in range(8):
            frame = av.AudioFrame.from_ndarray(
                np.zeros((1, 1024), np.float32), format="fltp", layout="mono"
            )
            frame.sample_rate, frame.pts = 16000, index * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path.read_bytes()


def _zero_frames(path) -> bytes:
    """An AVI whose video stream is declared but holds no frame."""
    with av.open(path, mode="w", format="avi") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()
    return path.read_bytes()


def _garbage_in_mdat(mp4: bytes, seed: int) -> bytes:
    """Overwrite the coded frames (the `mdat` payload) with noise, keeping the index intact."""
    at = mp4.index(b"mdat") - 4
    (size,) = struct.unpack(">I", mp4[at : at + 4])
    payload = slice(at + 8 + 40, at + size - 40)  # leave the first frame's headers
    noise = np.random.default_rng(seed).integers(0, 256, payload.stop - payload.start, np.uint8)
    data = bytearray(mp4)
    data[payload] = noise.tobytes()
    return bytes(data)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Case]:
    tmp = tmp_path_factory.mktemp("corpus")
    ten_frames = gray_frames(range(10, 250, 24))
    mp4 = _encode(tmp, "ok.mp4", ten_frames, time_base=Fraction(1, 10))
    mkv = _encode(tmp, "ok.mkv", ten_frames, time_base=Fraction(1, 10), container_format="matroska")
    mkv_unknown_codec = mkv.replace(b"V_MPEG4/ISO/AVC", b"V_MPEG4/ISO/ZZZ")
    assert mkv_unknown_codec != mkv
    rng = np.random.default_rng(0)
    unreadable = "not a readable video container"
    truncated = "looks truncated"
    playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\n{tmp / 'ok.mp4'}\n#EXT-X-ENDLIST\n"
    return {
        "empty": Case(b"", errors.EmptyVideo, "the input is empty (0 bytes)"),
        "random bytes": Case(rng.bytes(4096), errors.UnreadableVideo, unreadable),
        "text": Case(b"not a video\n" * 40, errors.UnreadableVideo, unreadable, suffix=".txt"),
        "mp4 cut in half": Case(mp4[: len(mp4) // 2], errors.TruncatedVideo, truncated),
        "mp4 cut in its header": Case(mp4[:20], errors.TruncatedVideo, truncated),
        "mkv cut in half": Case(
            mkv[: len(mkv) // 2], errors.TruncatedVideo, truncated, suffix=".mkv"
        ),
        "mkv cut in its header": Case(mkv[:24], errors.TruncatedVideo, truncated, suffix=".mkv"),
        "audio only": Case(_audio_only(tmp / "a.m4a"), errors.NoVideoStream, "found: audio"),
        "png": Case(_image("PNG"), errors.NotAVideo, "still image (png)", suffix=".png"),
        "jpeg": Case(_image("JPEG"), errors.NotAVideo, "still image (jpeg)", suffix=".jpg"),
        "absurd dimensions": Case(
            b"YUV4MPEG2 W10000 H10000 F30:1 Ip A1:1 C420jpeg\nFRAME\n" + bytes(4096),
            errors.FrameTooLarge,
            "10000x10000 = 100000000 pixels per frame, over max_pixels=9437184",
            suffix=".y4m",
        ),
        "zero frames": Case(_zero_frames(tmp / "z.avi"), errors.NoFrames, "no decodable frames"),
        "too long": Case(
            mp4,
            errors.VideoTooLong,
            "1 s exceeds max_duration_s=0.5",
            DecodeConfig(max_duration_s=0.5),
        ),
        "too many bytes": Case(
            mp4,
            errors.VideoTooLarge,
            f"has {len(mp4)} bytes, over max_bytes=1000",
            DecodeConfig(max_bytes=1000),
        ),
        "too many decoded frames": Case(
            mp4,
            errors.TooManyFrames,
            "more than max_decoded_frames=3",
            DecodeConfig(fps=30, max_decoded_frames=3),
        ),
        "garbage in the stream": Case(
            _garbage_in_mdat(mp4, seed=1), errors.CorruptVideo, "video data is corrupt"
        ),
        "unknown codec": Case(
            mkv_unknown_codec, errors.UnsupportedCodec, "cannot be decoded", suffix=".mkv"
        ),
        # Playlist and concat demuxers would open the other files named inside the input.
        "hls playlist": Case(playlist.encode(), errors.UnreadableVideo, unreadable, suffix=".m3u8"),
        "concat script": Case(
            f"ffconcat version 1.0\nfile '{tmp / 'ok.mp4'}'\n".encode(),
            errors.UnreadableVideo,
            unreadable,
            suffix=".ffconcat",
        ),
    }


CASE_NAMES = [
    "empty", "random bytes", "text", "mp4 cut in half", "mp4 cut in its header", "mkv cut in half",
    "mkv cut in its header", "audio only", "png", "jpeg", "absurd dimensions", "zero frames",
    "too long", "too many bytes", "too many decoded frames", "garbage in the stream",
    "unknown codec", "hls playlist", "concat script",
]  # fmt: skip
SOURCE_KINDS = ["path", "bytes", "file object"]


def _run(case: Case, kind: str, tmp_path) -> errors.VideoError:
    """Decode the case as `kind`; returns the error, after checking it came fast."""
    path = tmp_path / f"input{case.suffix}"
    path.write_bytes(case.data)
    began = time.monotonic()
    with pytest.raises(errors.VideoError) as caught:
        if kind == "path":
            decode_video(path, case.config)
        elif kind == "bytes":
            decode_video(case.data, case.config)
        else:
            with open(path, "rb") as handle:
                decode_video(handle, case.config)
    assert time.monotonic() - began < MAX_SECONDS_PER_CASE
    return caught.value


@pytest.mark.parametrize("kind", SOURCE_KINDS)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_hostile_input_raises_a_clear_video_error(corpus, tmp_path, name, kind):
    case = corpus[name]
    error = _run(case, kind, tmp_path)
    assert type(error) is case.error, f"{name}: {type(error).__name__}: {error}"
    assert case.phrase in str(error)


def test_corpus_covers_every_case(corpus):
    assert sorted(corpus) == sorted(CASE_NAMES)


def test_corpus_leaks_no_file_descriptors(corpus, tmp_path):
    def num_open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = num_open_files()
    for case in corpus.values():
        for kind in SOURCE_KINDS:
            _run(case, kind, tmp_path)
    assert num_open_files() == before


def test_decoding_leaves_no_decoder_thread_behind(tmp_path):
    """The decoder's threads end with the pass, not whenever the garbage collector runs."""
    clips = [
        _encode(tmp_path, f"{seed}.mp4", moving_texture(6, 96, 64, seed=seed), rotation=90)
        for seed in range(4)
    ]

    def num_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    gc.collect()
    before = num_threads()
    gc.disable()  # a collection would hide threads kept alive by a reference cycle
    try:
        for clip in clips:
            assert decode_video(clip).frames.shape[1:3] == (96, 64)  # rotated: side data read
        assert num_threads() == before
    finally:
        gc.enable()


def test_a_missing_path_or_a_directory_is_unreadable(tmp_path):
    with pytest.raises(errors.UnreadableVideo, match="cannot open"):
        decode_video(tmp_path / "missing.mp4")
    with pytest.raises(errors.UnreadableVideo, match="Is a directory"):
        decode_video(tmp_path)
    with pytest.raises(errors.UnreadableVideo, match="not a regular file"):
        decode_video(os.devnull)


def test_trailing_junk_after_a_complete_file_is_not_called_truncated(tmp_path):
    mp4 = _encode(tmp_path, "ok.mp4", gray_frames(range(10, 250, 24)), time_base=Fraction(1, 10))
    video = decode_video(mp4 + b"\x00\x00\xff\xffjunk" + bytes(100))
    assert len(video.frames) == 2


def test_cover_art_is_not_taken_for_a_video_stream(tmp_path):
    path = tmp_path / "song.mp4"
    with av.open(path, mode="w", format="mp4") as container:
        audio = container.add_stream("aac", rate=16000)
        art = container.add_stream("mjpeg", rate=1)
        art.width, art.height, art.pix_fmt = 64, 48, "yuvj420p"
        art.disposition = av.stream.Disposition.attached_pic
        picture = av.VideoFrame.from_ndarray(quadrant_frame(), format="rgb24")
        container.mux(art.encode(picture.reformat(format="yuvj420p")))
        container.mux(art.encode(None))
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), "fltp", "mono")
        frame.sample_rate, frame.pts = 16000, 0
        container.mux(audio.encode(frame))
        container.mux(audio.encode(None))
    with pytest.raises(errors.NoVideoStream):
        decode_video(path)
