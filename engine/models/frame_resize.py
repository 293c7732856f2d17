"""The size a model family holds a clip's frames at, applied while they are decoded.

Preprocessing resizes every frame to one target size (a size fitted to the first frame, or a
fixed square, as the family says) with a PIL filter. Decoding can do that same resize as each
sampled frame is converted, so a large clip is only ever held at the size the model sees, never
at display size. The result is bit for bit what preprocessing would make: the same PIL call on
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
    # the family's `prepare_video` takes `source_size=`: frames may then be held at the target
    # even where the size rule is not idempotent (a smart resize can land under its min_pixels)
    prepare_knows_source: bool = False

    def target(self, height: int, width: int) -> tuple[int, int]:
        """Where to hold frames of `height` x `width`: the family's size when it is smaller and
        preprocessing keeps it as it is (it is told the source size, or its rule leaves the
        target be); else unchanged (preprocessing then resizes from the full frame, and an
        upscale is not held for the whole clip)."""
        try:
            target = self.size(height, width)
        except ValueError:  # a size the family refuses: preprocessing says why, as before
            return height, width
        smaller = target[0] * target[1] < height * width
        kept = self.prepare_knows_source or self.size(*target) == target
        return target if smaller and kept else (height, width)

    def prepare_options(self, display_size: tuple[int, int]) -> dict:
        """What `prepare_video` is told of frames held by this resize: their source size."""
        return {"source_size": display_size} if self.prepare_knows_source else {}

    def apply(self, frame: np.ndarray, target: tuple[int, int]) -> np.ndarray:
        """`frame` [H, W, 3] uint8 resized to `target` (height, width), as preprocessing does."""
        if frame.shape[:2] == target:
            return frame
        image = Image.fromarray(np.ascontiguousarray(frame))
        return np.asarray(image.resize((target[1], target[0]), resample=self.resample))
