"""Scenes as video files: H.264 in .mp4, the way a camera's clip reaches the service.

`encode_h264` runs libx264 on one thread and muxes bit-exactly (x264's output otherwise
depends on its thread count). Task clips use the fast `veryfast` preset at the scene's own CRF
(20-30), so the model learns through compression artifacts of varying strength, and turn off
x264's macroblock-tree rate control: with it, the same frames encoded twice in one process
came out different for about a third of the clips here, without it they never did, so a
scene's clip is the same bytes every time on one PyAV/FFmpeg build. Training scenes and
held-out scenes come from disjoint seed ranges.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from fractions import Fraction
from typing import BinaryIO

import av
import numpy as np

from stillcut.demo.render import frames
from stillcut.demo.scenes import Scene

HELD_OUT_START = 1_000_000  # training scenes take seeds below it, held-out scenes from it on
NARRATION_TRAINING_START = 500_000  # the narration mix's training scenes take seeds from here
NUM_HELD_OUT = 500
TASK_PRESET = "veryfast"
TASK_X264_PARAMS = "mbtree=0"


def held_out_seeds(count: int = NUM_HELD_OUT) -> range:
    """Seeds of the held-out scenes, never used for training."""
    return range(HELD_OUT_START, HELD_OUT_START + count)


def training_seeds(count: int) -> range:
    """Seeds of `count` training scenes."""
    if not 1 <= count <= NARRATION_TRAINING_START:
        raise ValueError(f"count={count}: allowed 1..{NARRATION_TRAINING_START} training scenes")
    return range(count)


def narration_training_seeds(count: int) -> range:
    """Seeds of `count` training scenes of the narration mix (0 is allowed: none)."""
    limit = HELD_OUT_START - NARRATION_TRAINING_START
    if not 0 <= count <= limit:
        raise ValueError(f"count={count}: allowed 0..{limit} narration training scenes")
    return range(NARRATION_TRAINING_START, NARRATION_TRAINING_START + count)


def encode_h264(
    destination: str | os.PathLike | BinaryIO,
    images: Iterable[np.ndarray],
    fps: int,
    *,
    crf: int,
    preset: str = TASK_PRESET,
    gop: int | None = None,
    x264_params: str | None = None,
) -> None:
    """Write RGB frames [H, W, 3] uint8 as H.264 yuv420p in .mp4 at a constant `fps`
    (frame i at i / fps s). `x264_params` is x264's own option string."""
    options = {"crf": str(crf), "preset": preset, "threads": "1"}
    if gop is not None:
        options["g"] = str(gop)
    if x264_params is not None:
        options["x264-params"] = x264_params
    with av.open(destination, "w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.codec_context.time_base = Fraction(1, fps)
        stream.options = options
        for index, rgb in enumerate(images):
            if index == 0:
                stream.height, stream.width = rgb.shape[:2]
                stream.pix_fmt = "yuv420p"
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def clip_bytes(scene: Scene) -> bytes:
    """The scene rendered and encoded: an .mp4 file's bytes."""
    buffer = io.BytesIO()
    encode_h264(buffer, frames(scene), scene.fps, crf=scene.crf, x264_params=TASK_X264_PARAMS)
    return buffer.getvalue()
