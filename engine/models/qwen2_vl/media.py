"""Qwen2-VL / Qwen2.5-VL's media path in the pipeline: frames to tubelet patches to tokens.

A video's frames are resized once (smart resize of the first frame), normalised and cut into
2-frame tubelets of 14-pixel patches (`preprocess`); an image is a tubelet of one frame. The
tower encodes every input of a batch in one pass and merges 2x2 patches into one token. For EVS
before the tower, a token's pixel feature is its 2x2 group of normalised patches
(`pixel_features`), and the tower encodes only the tokens a `kept` mask keeps.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from stillcut.engine.model_config import ModelConfig
from stillcut.engine.models.frame_resize import FrameResize
from stillcut.engine.models.pixels import check_budget_values, pixel_bounds
from stillcut.engine.models.qwen2_vl.preprocess import (
    PreprocessedVideo,
    VideoPreprocessConfig,
    preprocess_image,
    preprocess_video,
    smart_resize,
)
from stillcut.engine.models.qwen2_vl.tower import Qwen2VLVisionTower
from stillcut.kernels.evs.pixels import PIXEL_FLOOR, group_features

# The bounds a request may set: one merged token (28 x 28) to Qwen's own largest image.
MIN_PIXELS = 28 * 28
MAX_PIXELS = 16384 * 28 * 28


def _frame_resize(config: VideoPreprocessConfig) -> FrameResize:
    return FrameResize(
        lambda h, w: smart_resize(h, w, config.factor, config.min_pixels, config.max_pixels),
        Image.Resampling.BICUBIC,
        prepare_knows_source=True,
    )


class QwenMedia:
    """Preprocessing and batched encoding for a Qwen2-VL / Qwen2.5-VL checkpoint."""

    def __init__(self, path: Path, model_config: ModelConfig) -> None:
        self.video_preprocess = VideoPreprocessConfig.from_checkpoint(path, "video")
        self.image_preprocess = VideoPreprocessConfig.from_checkpoint(path, "image")
        self.merge_size = model_config.vision.spatial_merge_size
        self.frame_resize = _frame_resize(self.video_preprocess)

    def pixel_budget(self) -> dict[str, int]:
        """The video pixel budget in force (the family entry's `pixel_budget` names)."""
        config = self.video_preprocess
        return {"min_pixels": config.min_pixels, "max_pixels": config.max_pixels}

    def with_pixel_budget(self, **budget: int) -> QwenMedia:
        """This media with a request's `min_pixels` / `max_pixels` for videos, as the
        processor takes them: a bound given alone moves the other where it would cross it."""
        config = self.video_preprocess
        check_budget_values(budget, dict.fromkeys(budget, (MIN_PIXELS, MAX_PIXELS)))
        low, high = pixel_bounds(
            budget.get("min_pixels"),
            budget.get("max_pixels"),
            (config.min_pixels, config.max_pixels),
            ("min_pixels", "max_pixels"),
        )
        media = copy.copy(self)
        media.video_preprocess = dataclasses.replace(config, min_pixels=low, max_pixels=high)
        media.frame_resize = _frame_resize(media.video_preprocess)
        return media

    def token_grid(
        self, kind: str, num_frames: int, height: int, width: int
    ) -> tuple[int, int, int]:
        """The merged token grid (t, h, w) of `num_frames` frames of `height` x `width`
        ("video" or "image"), worked out from the sizes alone."""
        config = self.video_preprocess if kind == "video" else self.image_preprocess
        resized = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
        num_tubelets = -(-num_frames // config.temporal_patch_size)
        return num_tubelets, resized[0] // config.factor, resized[1] // config.factor

    def prepare_video(
        self, frames: np.ndarray, sample_fps: float, source_size: tuple[int, int] | None = None
    ) -> PreprocessedVideo:
        """Frames [T, H, W, 3] uint8 sampled at `sample_fps` -> tubelet patches (`source_size`:
        the frames were resized at decode from that (height, width))."""
        return preprocess_video(frames, sample_fps, self.video_preprocess, source_size)

    def prepare_image(self, image: np.ndarray) -> PreprocessedVideo:
        """One image [H, W, 3] uint8 -> the patches of a one-frame tubelet."""
        return preprocess_image(image, self.image_preprocess)

    def check_video_frame(self, height: int, width: int) -> None:
        """Raise ValueError when frames of this size cannot be preprocessed as a video."""
        config = self.video_preprocess
        smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)

    def pixel_features(
        self, prepared: PreprocessedVideo, floor: float = PIXEL_FLOOR
    ) -> torch.Tensor:
        """What EVS before the tower compares, one row per token in flat (t, h, w) order:
        [tokens, 4 * patch_dim + 1] (`kernels.evs.pixels`; `floor` for benches)."""
        config = self.video_preprocess
        frames = config.temporal_patch_size
        channels = prepared.patches.shape[1] // (frames * config.patch_size**2)
        tubelets = prepared.grid_thw[0]
        return group_features(
            prepared.patches, self.merge_size**2, tubelets, channels, frames, floor
        )

    def encode(
        self,
        tower: Qwen2VLVisionTower,
        prepared: list[PreprocessedVideo],
        device: torch.device,
        kept: list[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """Every input in one tower pass: [tokens, hidden] each, or with `kept` (per input a
        [tokens] bool mask, or None: all) the kept tokens' [num_kept, hidden]. A tower is
        given masks only when there are some (a family refusing the stage takes none)."""
        masks = () if kept is None else (kept,)
        return tower.encode(
            [p.patches.to(device) for p in prepared], [p.grid_thw for p in prepared], *masks
        )
