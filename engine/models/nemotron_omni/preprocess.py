"""Nemotron 3 Nano Omni preprocessing, equal to transformers' video and image processors.

Video (`NemotronH_Omni_Reasoning_V3VideoProcessor`): every frame is resized to one tile whose
patch grid sits near `video_target_num_patches`, keeping the aspect ratio with both sides even
(`video_tile_grid`); frames go through torch's antialiased bicubic resize on 0-255 floats,
`(x / 255 - mean) / std`, and are padded to whole 2-frame tubelets by repeating the last one;
a tubelet stacks its frames on the channels, `[6, H, W]`. Images (its image processor): the
patch grid is the image's own, scaled into `[min_num_patches, budget]` and rounded to even
sides (`image_patch_grid`), where the budget is the context `(max_model_len - 4)` in
pre-shuffle patches, capped by `max_num_patches`; the same resize, then `(x - 255 mean) /
(255 std)` as its fused rescale-and-normalise computes it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from stillcut.engine.models.pixels import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    check_frames,
    check_int_fields,
    check_rgb_fields,
    config_key,
)

VIDEO_CONFIG_FILE = "video_preprocessor_config.json"
IMAGE_CONFIG_FILE = "preprocessor_config.json"
_POSITIVE_FIELDS = (
    "patch_size", "merge_size", "temporal_patch_size", "video_target_num_patches",
    "min_num_patches", "max_model_len",
)  # fmt: skip


@dataclass(frozen=True)
class NemotronPreprocessConfig:
    """Every parameter that changes the pixels a video or an image turns into (defaults:
    transformers' processors; `max_num_patches` 0 means no cap)."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    video_target_num_patches: int = 1024
    video_maintain_aspect_ratio: bool = True
    video_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    video_std: tuple[float, float, float] = OPENAI_CLIP_STD
    min_num_patches: int = 1024
    max_num_patches: int = 13312
    max_model_len: int = 16384
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        check_int_fields(self, _POSITIVE_FIELDS)
        check_int_fields(self, ("max_num_patches",), minimum=0)
        check_rgb_fields(self, ("video_mean", "video_std", "image_mean", "image_std"))

    def key(self) -> str:
        """A stable string of every parameter, for cache keys."""
        return config_key(self, "nemotron-preprocess-v1")

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str]) -> NemotronPreprocessConfig:
        """Read a checkpoint folder's video and image processor configs (either may be
        missing: transformers' defaults then apply)."""
        folder = Path(path)
        video, image = (_read(folder / name) for name in (VIDEO_CONFIG_FILE, IMAGE_CONFIG_FILE))
        kwargs: dict[str, Any] = {}
        shared = {**image, **video}
        if "patch_size" in shared:
            kwargs["patch_size"] = int(shared["patch_size"])
        if "downsample_ratio" in shared:
            kwargs["merge_size"] = round(1 / float(shared["downsample_ratio"]))
        for name in ("temporal_patch_size", "video_target_num_patches"):
            if name in video:
                kwargs[name] = int(video[name])
        if "video_maintain_aspect_ratio" in video:
            kwargs["video_maintain_aspect_ratio"] = bool(video["video_maintain_aspect_ratio"])
        for name in ("min_num_patches", "max_num_patches", "max_model_len"):
            if name in image:
                kwargs[name] = int(image[name])
        for prefix, data in (("video", video), ("image", image)):
            for stat in ("mean", "std"):
                value = data.get(f"image_{stat}", data.get(f"norm_{stat}"))
                if value is not None:
                    kwargs[f"{prefix}_{stat}"] = tuple(float(v) for v in value)
        return cls(**kwargs)


@dataclass(frozen=True)
class PreparedMedia:
    """Pixels of one video (tubelets) or image, ready for the RADIO tower."""

    pixel_values: torch.Tensor  # [tubelets, 6, H, W] (video) or [1, 3, H, W] (image), float32
    grid_thw: tuple[int, int, int]  # (tubelets or 1, patch rows, patch columns)
    second_per_grid_ts: float  # seconds a tubelet spans; 0.0 for images
    resized_height: int
    resized_width: int


def video_tile_grid(height: int, width: int, config: NemotronPreprocessConfig) -> tuple[int, int]:
    """(patch rows, patch columns) of a video frame, as the video processor picks them."""
    target, divisor = config.video_target_num_patches, config.merge_size
    if not config.video_maintain_aspect_ratio:
        side = max(divisor, int(math.sqrt(target)) // divisor * divisor)
        return side, side
    aspect = width / max(height, 1)
    rows = max(round(math.sqrt(target / aspect)), 1)
    cols = max(round(math.sqrt(target * aspect)), 1)
    if divisor > 1:
        rows_up, cols_up = -(-rows // divisor) * divisor, -(-cols // divisor) * divisor
        if rows_up * cols_up <= target:
            return rows_up, cols_up
        return max(divisor, rows // divisor * divisor), max(divisor, cols // divisor * divisor)
    return rows, cols


def image_patch_grid(height: int, width: int, config: NemotronPreprocessConfig) -> tuple[int, int]:
    """(patch rows, patch columns) of one image, as the image processor picks them."""
    merge, minimum = config.merge_size, config.min_num_patches
    budget = max((config.max_model_len - 4) * merge**2, minimum)
    if config.max_num_patches:
        budget = min(budget, config.max_num_patches)
    budget = max(budget, minimum)
    # round(x + 0.5): floor(x) + 1 unless x is whole
    rows = round(height / config.patch_size + 0.5)
    cols = round(width / config.patch_size + 0.5)
    factor = min(math.sqrt(budget / (rows * cols)), 1.0)
    rows, cols = math.floor(factor * rows), math.floor(factor * cols)
    if budget > minimum and rows * cols < minimum:
        factor = math.sqrt(minimum / (rows * cols))
        rows, cols = math.ceil(factor * rows), math.ceil(factor * cols)
    if remainder := rows % merge:
        fits = (rows + merge - remainder) * cols <= budget
        rows = rows + merge - remainder if fits else max(merge, rows - remainder)
    if remainder := cols % merge:
        fits = rows * (cols + merge - remainder) <= budget
        cols = cols + merge - remainder if fits else max(merge, cols - remainder)
    return rows, cols


def preprocess_video(
    frames: np.ndarray, sample_fps: float, config: NemotronPreprocessConfig
) -> PreparedMedia:
    """Frames [T, H, W, 3] uint8 RGB sampled at `sample_fps` -> tubelets [T', 6, H', W']."""
    check_frames(frames)
    rows, cols = video_tile_grid(frames.shape[1], frames.shape[2], config)
    pixels = _resized(frames, rows * config.patch_size, cols * config.patch_size)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (config.video_mean, config.video_std))
    pixels = (pixels / 255.0 - mean) / std  # [T, 3, H', W']
    step = config.temporal_patch_size
    if len(pixels) % step:
        pixels = torch.cat([pixels, pixels[-1:].expand(step - len(pixels) % step, -1, -1, -1)])
    tubelets = pixels.reshape(-1, step * 3, *pixels.shape[2:])  # frames stacked on channels
    return PreparedMedia(
        tubelets,
        (tubelets.shape[0], rows, cols),
        step / sample_fps,
        rows * config.patch_size,
        cols * config.patch_size,
    )


def preprocess_image(image: np.ndarray, config: NemotronPreprocessConfig) -> PreparedMedia:
    """One image [H, W, 3] uint8 RGB -> pixels [1, 3, H', W'] on its patch grid."""
    check_frames(image[None])
    rows, cols = image_patch_grid(image.shape[0], image.shape[1], config)
    pixels = _resized(image[None], rows * config.patch_size, cols * config.patch_size)
    mean, std = (
        torch.tensor(v).view(1, 3, 1, 1) * 255.0 for v in (config.image_mean, config.image_std)
    )
    return PreparedMedia(
        (pixels - mean) / std, (1, rows, cols), 0.0, rows * config.patch_size,
        cols * config.patch_size,
    )  # fmt: skip


def _resized(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """[T, H, W, 3] uint8 -> [T, 3, height, width] float32 on the 0-255 scale: torch's
    antialiased bicubic, without clamping the overshoot (as both processors resize)."""
    pixels = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
    if pixels.shape[-2:] == (height, width):
        return pixels
    return F.interpolate(
        pixels, size=(height, width), mode="bicubic", align_corners=False, antialias=True
    )


def _read(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except ValueError as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from error
