"""Qwen3-VL's media path in the pipeline: frames to tubelet patches to tokens and DeepStack.

A video is resized once for the whole clip (`preprocess.clip_size`), normalised and cut into
2-frame tubelets of 16-pixel patches; an image is a tubelet of one frame under its own budget.
The tower encodes every input of a batch in one pass and gives, per input, the merged tokens
and their DeepStack feature sets. Frames are not resized while decoding (`frame_resize` None):
a clip's size depends on how many frames it has. A request may set its own pixel budget
(`pixel_budget`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from stillcut.engine.model_config import ModelConfig
from stillcut.engine.models.qwen2_vl.media import QwenMedia
from stillcut.engine.models.qwen2_vl.preprocess import PreprocessedVideo, smart_resize
from stillcut.engine.models.qwen3_vl.pixel_budget import budget_in_force, with_budget
from stillcut.engine.models.qwen3_vl.preprocess import clip_size, preprocess_clip, read_configs


class Qwen3Media(QwenMedia):
    """Preprocessing and batched encoding for a Qwen3-VL checkpoint."""

    frame_resize = None

    def __init__(self, path: Path, model_config: ModelConfig) -> None:
        self.image_preprocess, self.video_preprocess, self.budget = read_configs(Path(path))
        self.merge_size = model_config.vision.spatial_merge_size

    def pixel_budget(self) -> dict[str, int]:
        """The video pixel budget in force, under every name the family entry takes."""
        return budget_in_force(self.video_preprocess, self.budget)

    def with_pixel_budget(self, **values: int) -> Qwen3Media:
        """This media with a request's video pixel budget (`pixel_budget.with_budget`)."""
        media = copy.copy(self)
        media.video_preprocess, media.budget = with_budget(
            self.video_preprocess, self.budget, values
        )
        return media

    def token_grid(
        self, kind: str, num_frames: int, height: int, width: int
    ) -> tuple[int, int, int]:
        """The merged token grid (t, h, w) of `num_frames` frames of `height` x `width`
        ("video" or "image"), worked out from the sizes alone."""
        if kind == "video":
            config = self.video_preprocess
            resized = clip_size(num_frames, height, width, config, self.budget)
        else:
            config = self.image_preprocess
            resized = smart_resize(
                height, width, config.factor, config.min_pixels, config.max_pixels
            )
        num_tubelets = -(-num_frames // config.temporal_patch_size)
        return num_tubelets, resized[0] // config.factor, resized[1] // config.factor

    def prepare_video(self, frames: np.ndarray, sample_fps: float) -> PreprocessedVideo:
        """Frames [T, H, W, 3] uint8 sampled at `sample_fps` -> tubelet patches."""
        return preprocess_clip(frames, sample_fps, self.video_preprocess, self.budget)

    def check_video_frame(self, height: int, width: int) -> None:
        """Raise ValueError when frames of this size cannot be preprocessed as a video."""
        clip_size(1, height, width, self.video_preprocess, self.budget)
