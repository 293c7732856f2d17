"""Gemma 3's media path in the pipeline: frames to pixel squares to image tokens.

Each image, and each sampled frame of a video, is preprocessed on its own (`gemma3_preprocess`)
and encoded by the SigLIP encoder to `mm_tokens_per_image` tokens, a `sqrt x sqrt` grid in
row-major order. A video's frames stack into one `(frames, side, side)` token grid, so EVS runs
across frames with t = the frame count and keeps the first frame whole; the prompt processor
later splits the video into one image item per frame (the family has no video token).
"""

from __future__ import annotations

from dataclasses import dataclass
from os import PathLike

import numpy as np
import torch
from PIL import Image

from stillcut.engine.model_config import ModelConfig
from stillcut.engine.models.frame_resize import FrameResize
from stillcut.engine.models.gemma3.preprocess import Gemma3PreprocessConfig, preprocess_frames
from stillcut.engine.models.gemma3.tower import Gemma3VisionEncoder


@dataclass(frozen=True)
class PreprocessedFrames:
    """Pixel squares of one video's frames (or one image) ready for the encoder."""

    pixel_values: torch.Tensor  # [num_frames, 3, S, S] float32
    grid_thw: tuple[int, int, int]  # (num_frames, side, side): the image tokens of each frame
    second_per_grid_ts: float  # seconds between sampled frames; 0.0 for images
    resized_height: int
    resized_width: int


class Gemma3Media:
    """Preprocessing and batched encoding for a Gemma 3 checkpoint."""

    merge_size = 1  # the projector's pooling already made one token per grid cell

    def __init__(self, path: str | PathLike[str], model_config: ModelConfig) -> None:
        self.preprocess = Gemma3PreprocessConfig.from_checkpoint(path)
        self.video_preprocess = self.image_preprocess = self.preprocess  # one for both
        self.tokens_per_side = model_config.vision.tokens_per_side
        size = self.preprocess.image_size
        self.frame_resize = FrameResize(
            lambda h, w: (size, size), Image.Resampling(self.preprocess.resample)
        )

    def token_grid(
        self, kind: str, num_frames: int, height: int, width: int
    ) -> tuple[int, int, int]:
        """The token grid (t, h, w) of `num_frames` frames (or one image): a square per frame,
        whatever the frame's size."""
        return num_frames, self.tokens_per_side, self.tokens_per_side

    def prepare_video(self, frames: np.ndarray, sample_fps: float) -> PreprocessedFrames:
        """Frames [T, H, W, 3] uint8 sampled at `sample_fps` -> one square per frame."""
        return self._prepare(frames, 1.0 / sample_fps)

    def prepare_image(self, image: np.ndarray) -> PreprocessedFrames:
        """One image [H, W, 3] uint8 -> one square."""
        return self._prepare(image[None], 0.0)

    def check_video_frame(self, height: int, width: int) -> None:
        """Any frame size works: every frame is resized to the one square."""
        if height < 1 or width < 1:
            raise ValueError(f"height and width must be >= 1, got {height}x{width}")

    def encode(
        self,
        encoder: Gemma3VisionEncoder,
        prepared: list[PreprocessedFrames],
        device: torch.device,
    ) -> list[torch.Tensor]:
        """Every frame of every input in one encoder pass: [frames * tokens, hidden] each."""
        pixels = torch.cat([p.pixel_values for p in prepared]).to(device)  # [B, 3, S, S]
        tokens = encoder.encode(pixels).flatten(0, 1)  # [B * mm_tokens, hidden]
        tokens_per_frame = self.tokens_per_side**2
        return list(tokens.split([p.grid_thw[0] * tokens_per_frame for p in prepared]))

    def _prepare(self, frames: np.ndarray, seconds_per_frame: float) -> PreprocessedFrames:
        size = self.preprocess.image_size
        side = self.tokens_per_side
        pixel_values = preprocess_frames(frames, self.preprocess)  # [T, 3, S, S]
        grid = (pixel_values.shape[0], side, side)
        return PreprocessedFrames(pixel_values, grid, seconds_per_frame, size, size)
