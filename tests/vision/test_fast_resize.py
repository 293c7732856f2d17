"""`resize="fast"` (FFmpeg's scaler at decode) gives frames of the exact path's size, close to
its pixels, also for rotated video; the exact path is untouched by it."""

from fractions import Fraction

import numpy as np
import pytest

from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.pipeline import VisionPipeline
from stillcut.vision.synthetic import moving_texture, write_video


@pytest.mark.parametrize("rotation", [0, 90])
def test_fast_resize_is_close_to_exact(tmp_path, tiny_checkpoint, rotation):
    path = tmp_path / "clip.mp4"
    frames = [np.repeat(np.repeat(f, 2, 0), 2, 1) for f in moving_texture(8, 320, 180, seed=1)]
    write_video(path, frames, time_base=Fraction(1, 4), rotation=rotation)
    resize = VisionPipeline(tiny_checkpoint).media.frame_resize
    fast_resize = type(resize)(resize.size, resize.resample, fast=True)
    exact = decode_video(path, DecodeConfig(fps=4), resize=resize)
    fast = decode_video(path, DecodeConfig(fps=4), resize=fast_resize)
    assert exact.frames.shape == fast.frames.shape
    assert exact.frames.shape[1:3] != (exact.height, exact.width)  # it did resize
    difference = np.abs(exact.frames.astype(int) - fast.frames.astype(int))
    assert difference.mean() < 4 and not np.array_equal(exact.frames, fast.frames)


def test_resize_mode_is_checked():
    with pytest.raises(ValueError, match=r"resize must be one of \('exact', 'fast'\)"):
        DecodeConfig(resize="quick")
