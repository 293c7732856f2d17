"""The size a model family holds a clip's frames at, applied while they are decoded.

Preprocessing resizes every frame to one target size (Qwen: smart resize of the first frame;
Gemma 3: a fixed square) with a PIL filter. Decoding can do that same resize as each sampled
frame is converted, so a large clip is only ever held at the size the model sees, never at
display size. The result is bit for bit what preprocessing would make: the same PIL call on
the same pixels, and preprocessing then finds each frame at its target size and leaves it be.

`fast` (opt-in, `DecodeConfig.resize="fast"`) lets FFmpeg's scaler make the target size in the
same step that converts the decoded frame to RGB, skipping the full-size RGB frame and PIL:
faster, and close to the exact path but not bit-exact (bench/long_video.py reports how close).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class FrameResize:
    """`size(height, width)` is the family's target (height, width); `resample` its filter."""

    size: Callable[[int, int], tuple[int, int]]
    resample: Image.Resampling
    fast: bool = False  # FFmpeg's scaler at conversion instead of PIL afterwards

    def target(self, height: int, width: int) -> tuple[int, int]:
        """Where to hold frames of `height` x `width`: the family's size when it is smaller and
        preprocessing would keep it as it is; else unchanged (preprocessing then resizes from
        the full frame, and an upscale is not held for the whole clip)."""
        try:
            target = self.size(height, width)
        except ValueError:  # a size the family refuses: preprocessing says why, as before
            return height, width
        smaller = target[0] * target[1] < height * width
        return target if smaller and self.size(*target) == target else (height, width)

    def apply(self, frame: np.ndarray, target: tuple[int, int]) -> np.ndarray:
        """`frame` [H, W, 3] uint8 resized to `target` (height, width), as preprocessing does."""
        if frame.shape[:2] == target:
            return frame
        image = Image.fromarray(np.ascontiguousarray(frame))
        return np.asarray(image.resize((target[1], target[0]), resample=self.resample))
