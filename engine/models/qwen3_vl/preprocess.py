"""Qwen3-VL preprocessing, as transformers' `Qwen3VLVideoProcessor` and (for images) the
Qwen2-VL image processor do it with Qwen3-VL's settings.

Both resize to multiples of 32 px (16-pixel patches merged 2x2) and normalise with mean and std
0.5 (the checkpoint's preprocessor configs say so; these are also the defaults). An image's
pixel budget bounds its one frame (`size` `{shortest_edge, longest_edge}`), as for Qwen2-VL. A
video's budget bounds the whole clip: frames x height x width, the frame count rounded to whole
tubelets, against `longest_edge` (`clip_size`); with `cap_pixels_per_frame` each frame's share
is also capped at `max_video_tokens` merged tokens and floored at 1.05 x `shortest_edge`, as
qwen-vl-utils does. An odd frame count is padded with the last frame. Frames are resized with
PIL bicubic (transformers' video processor resizes with torchvision, which rounds a little
differently).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from stillcut.engine.models.pixels import AspectRatioError, check_int_fields
from stillcut.engine.models.qwen2_vl.preprocess import (
    MAX_ASPECT_RATIO,
    PreprocessedVideo,
    VideoPreprocessConfig,
    patchify_frames,
)

HALF = (0.5, 0.5, 0.5)
# transformers' Qwen3-VL defaults where a checkpoint's config files say nothing
IMAGE_DEFAULTS = VideoPreprocessConfig(
    patch_size=16, min_pixels=65536, max_pixels=16777216, image_mean=HALF, image_std=HALF
)
VIDEO_DEFAULTS = replace(IMAGE_DEFAULTS, min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32)


@dataclass(frozen=True)
class ClipBudget:
    """How a video's pixel budget is shared over its frames (see the module docstring)."""

    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    def __post_init__(self) -> None:
        check_int_fields(self, ("max_video_tokens",))


def read_configs(folder: Path) -> tuple[VideoPreprocessConfig, VideoPreprocessConfig, ClipBudget]:
    """The image and video preprocessing and the clip budget of a checkpoint folder: the
    video reads `video_preprocessor_config.json`, the image `preprocessor_config.json`."""
    image, video, budget = IMAGE_DEFAULTS, VIDEO_DEFAULTS, ClipBudget()
    if (folder / "preprocessor_config.json").is_file():
        image = _with_file(IMAGE_DEFAULTS, folder / "preprocessor_config.json")
    if (folder / "video_preprocessor_config.json").is_file():
        path = folder / "video_preprocessor_config.json"
        video = _with_file(VIDEO_DEFAULTS, path)
        data = json.loads(path.read_text())
        budget = ClipBudget(
            bool(data.get("cap_pixels_per_frame") or False),
            int(data.get("max_video_tokens", 768)),
        )
    return image, video, budget


def _with_file(defaults: VideoPreprocessConfig, path: Path) -> VideoPreprocessConfig:
    data = json.loads(path.read_text())
    return VideoPreprocessConfig._from_dict({**_as_dict(defaults), **data}, path.name)


def _as_dict(config: VideoPreprocessConfig) -> dict:
    return {
        "patch_size": config.patch_size,
        "temporal_patch_size": config.temporal_patch_size,
        "merge_size": config.merge_size,
        "size": {"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
        "image_mean": list(config.image_mean),
        "image_std": list(config.image_std),
        "rescale_factor": config.rescale_factor,
    }


def clip_size(
    num_frames: int, height: int, width: int, config: VideoPreprocessConfig, budget: ClipBudget
) -> tuple[int, int]:
    """(height, width) every frame of a `num_frames` clip is resized to: transformers'
    Qwen3-VL `smart_resize` over the clip (a one-frame clip counts as one tubelet)."""
    factor, temporal = config.factor, config.temporal_patch_size
    num_frames = max(num_frames, temporal)
    max_pixels = config.max_pixels
    if budget.cap_pixels_per_frame:
        frame_cap = budget.max_video_tokens * factor * factor
        per_frame = max(min(frame_cap, max_pixels // num_frames), int(config.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be >= 1, got {height}x{width}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise AspectRatioError(
            f"aspect ratio of a {height}x{width} frame exceeds the allowed {MAX_ASPECT_RATIO}"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess_clip(
    frames: np.ndarray, sample_fps: float, config: VideoPreprocessConfig, budget: ClipBudget
) -> PreprocessedVideo:
    """Frames [T, H, W, 3] uint8 sampled at `sample_fps` -> tubelet patches."""
    if not (isinstance(sample_fps, float | int) and 0 < sample_fps < math.inf):
        raise ValueError(f"sample_fps must be a positive finite number, got {sample_fps!r}")
    num_frames, height, width = frames.shape[:3] if frames.ndim == 4 else (0, 0, 0)
    resized = clip_size(num_frames, height, width, config, budget) if num_frames else None
    return patchify_frames(frames, config, config.temporal_patch_size / sample_fps, resized)
