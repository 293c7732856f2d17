"""Write small synthetic videos with PyAV, for tests, benchmarks and demos.

Everything a decoder has to get right can be dialled in: irregular timestamps (variable frame
rate), pixel format and colour range, display rotation and mirroring, non-square pixels. With
`lossless_h264()` options every frame survives the round trip to within a code value or two, so
a test can recognise each frame by its content.
"""

import os
from collections.abc import Iterable, Iterator, Sequence
from fractions import Fraction
from typing import BinaryIO

import av
import numpy as np


def near_lossless_h264() -> dict[str, str]:
    """libx264 options for a near-lossless stream that keeps B-frames, as cameras write them.

    (Quantiser 0, true lossless, makes x264 drop B-frames, and with them the reordering a
    decoder must get right.)
    """
    return {"crf": "1", "preset": "veryfast"}


def write_video(
    destination: str | os.PathLike | BinaryIO,
    frames: Iterable[np.ndarray],
    *,
    pts: Sequence[int] | None = None,
    time_base: Fraction = Fraction(1, 30),
    codec: str = "libx264",
    container_format: str = "mp4",
    pix_fmt: str = "yuv420p",
    options: dict[str, str] | None = None,
    rotation: int = 0,
    hflip: bool = False,
    vflip: bool = False,
    sample_aspect_ratio: Fraction | None = None,
    stream_metadata: dict[str, str] | None = None,
) -> None:
    """Encode RGB frames ([H, W, 3] uint8, all one size) into a video file.

    `pts` gives each frame's timestamp in `time_base` units (default 0, 1, 2, ...: constant
    rate 1 / time_base). `rotation` is counter-clockwise degrees stored in the display matrix,
    with `hflip` / `vflip` mirroring after it, as PyAV defines them. `stream_metadata` is
    written as the video stream's tags (for example a legacy `rotate` tag).
    """
    with av.open(destination, mode="w", format=container_format) as container:
        stream = None
        for index, rgb in enumerate(frames):
            if stream is None:
                stream = container.add_stream(
                    codec, rate=round(1 / time_base), options=options or {}
                )
                stream.height, stream.width = rgb.shape[:2]
                stream.pix_fmt = pix_fmt
                stream.time_base = time_base
                stream.codec_context.time_base = time_base
                if sample_aspect_ratio is not None:
                    stream.codec_context.sample_aspect_ratio = sample_aspect_ratio
                stream.metadata.update(stream_metadata or {})
                if rotation or hflip or vflip:
                    stream.set_display_rotation(rotation, hflip=hflip, vflip=vflip)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format=pix_fmt)
            frame.pts = index if pts is None else pts[index]
            frame.time_base = time_base
            container.mux(stream.encode(frame))
        assert stream is not None, "write_video needs at least one frame"
        container.mux(stream.encode(None))


def gray_frames(levels: Iterable[int], width: int = 64, height: int = 48) -> list[np.ndarray]:
    """Flat gray RGB frames, one per level: frame identity survives lossy colour conversion."""
    return [np.full((height, width, 3), level, np.uint8) for level in levels]


def quadrant_frame(width: int = 64, height: int = 48) -> np.ndarray:
    """[H, W, 3] uint8: red top-left, green top-right, blue bottom-left, white bottom-right.

    Every rotation and mirror of it is distinct, so orientation bugs cannot hide.
    """
    frame = np.zeros((height, width, 3), np.uint8)
    half_h, half_w = height // 2, width // 2
    frame[:half_h, :half_w] = (255, 0, 0)
    frame[:half_h, half_w:] = (0, 255, 0)
    frame[half_h:, :half_w] = (0, 0, 255)
    frame[half_h:, half_w:] = (255, 255, 255)
    return frame


def moving_texture(num_frames: int, width: int, height: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Frames of a noise texture over a colour gradient, panning diagonally, with fresh grain.

    Motion, fine detail and sensor-like grain make the encoder do real work (motion vectors
    and residuals in every frame), the way camera footage does, unlike flat or static patterns.
    """
    rng = np.random.default_rng(seed)
    pan = 2 * num_frames + 1
    # Noise at 1/8 resolution blown up, plus fine noise: structure at several scales.
    coarse = rng.integers(0, 256, ((height + pan) // 8 + 2, (width + pan) // 8 + 2, 3), np.uint8)
    texture = np.repeat(np.repeat(coarse, 8, axis=0), 8, axis=1)[: height + pan, : width + pan]
    fine = rng.integers(0, 48, (height + pan, width + pan, 1), np.uint8)
    ramp = np.linspace(0, 80, width + pan, dtype=np.float32)[None, :, None]
    texture = (texture * 0.45 + fine + ramp).astype(np.uint8)  # [H + pan, W + pan, 3], <= 242
    for index in range(num_frames):
        grain = rng.integers(0, 12, (height, width, 1), np.uint8)  # [H, W, 1]
        yield texture[2 * index : 2 * index + height, index : index + width] + grain
