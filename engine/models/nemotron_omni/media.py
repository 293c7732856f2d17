"""Nemotron 3 Nano Omni's media path in the pipeline: frames to tubelets to RADIO tokens.

A video's frames are resized to one tile near the checkpoint's target patch count and packed
into 2-frame tubelets; an image gets its own patch grid (`nemotron_preprocess`). The tower
encodes each video's tubelets in one pass (they share a size) and each image on its own, then
pixel-shuffles 2x2 patches into one token: a video's grid is `(tubelets, rows, cols)` in
patches, merged 2x2, so EVS sees `rows/2 x cols/2` tokens per tubelet, as transformers'
`compute_retention_mask` does. Frames are not resized while decoding (`frame_resize` None):
the processors resize 0-255 floats and keep the bicubic overshoot, which a uint8 frame held at
the target size would round away.
"""

from __future__ import annotations

from os import PathLike

import numpy as np
import torch

from stillcut.engine.model_config import ModelConfig
from stillcut.engine.models.nemotron_omni.preprocess import (
    NemotronPreprocessConfig,
    PreparedMedia,
    image_patch_grid,
    preprocess_image,
    preprocess_video,
    video_tile_grid,
)
from stillcut.engine.models.nemotron_omni.tower import RadioVisionTower


class NemotronMedia:
    """Preprocessing and encoding for a Nemotron 3 Nano Omni checkpoint."""

    frame_resize = None  # decoding keeps frames at their own size (see the module docstring)

    def __init__(self, path: str | PathLike[str], model_config: ModelConfig) -> None:
        self.preprocess = NemotronPreprocessConfig.from_checkpoint(path)
        self.video_preprocess = self.image_preprocess = self.preprocess  # one for both
        self.merge_size = model_config.vision.merge_size
        if self.preprocess.merge_size != self.merge_size:
            raise ValueError(
                f"the processor's downsample ratio gives merge size {self.preprocess.merge_size}"
                f", the model's {self.merge_size}"
            )

    def token_grid(
        self, kind: str, num_frames: int, height: int, width: int
    ) -> tuple[int, int, int]:
        """The merged token grid (t, h, w) of `num_frames` frames of `height` x `width`
        ("video" or "image"), worked out from the sizes alone."""
        config, merge = self.preprocess, self.merge_size
        if kind == "image":
            rows, cols = image_patch_grid(height, width, config)
            return 1, rows // merge, cols // merge
        rows, cols = video_tile_grid(height, width, config)
        return -(-num_frames // config.temporal_patch_size), rows // merge, cols // merge

    def prepare_video(self, frames: np.ndarray, sample_fps: float) -> PreparedMedia:
        """Frames [T, H, W, 3] uint8 sampled at `sample_fps` -> tubelets."""
        return preprocess_video(frames, sample_fps, self.preprocess)

    def prepare_image(self, image: np.ndarray) -> PreparedMedia:
        """One image [H, W, 3] uint8 -> pixels on its own patch grid."""
        return preprocess_image(image, self.preprocess)

    def check_video_frame(self, height: int, width: int) -> None:
        """Any frame size works: every frame is resized to the checkpoint's tile."""
        if height < 1 or width < 1:
            raise ValueError(f"height and width must be >= 1, got {height}x{width}")

    def encode(
        self, tower: RadioVisionTower, prepared: list[PreparedMedia], device: torch.device
    ) -> list[torch.Tensor]:
        """[tokens, hidden] per input: one tower pass per video (all its tubelets) or image."""
        return [tower.encode(p.pixel_values.to(device)) for p in prepared]
