"""Qwen2-VL / Qwen2.5-VL video preprocessing, matching transformers' PIL image processor.

One target size per video (smart resize of the first frame, factor patch_size * merge_size);
every frame resized with PIL bicubic; rescale then normalize through a per-channel lookup table
that repeats transformers' float64-then-float32 arithmetic, so values agree bit for bit; frames
padded to whole tubelets by repeating the last one; patches laid out as
(t, h/merge, w/merge, merge, merge) x (channel, temporal, patch, patch), as the vision tower
expects. Work is done one tubelet at a time so peak memory is the output plus one tubelet.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image

from stillcut.engine.models.pixels import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    AspectRatioError,
    check_frames,
    check_image,
    check_int_fields,
    check_rgb_fields,
    check_steps_on,
    config_key,
    normalization_lut,
)

MAX_ASPECT_RATIO = 200
# Read first: a checkpoint's video settings win over its image settings.
CONFIG_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 128 * 28 * 28,
    max_pixels: int = 768 * 28 * 28,
) -> tuple[int, int]:
    """Return (height, width) rounded to multiples of ``factor`` with a pixel count in
    [min_pixels, max_pixels], keeping the aspect ratio as closely as possible.

    Same result as transformers' Qwen2-VL ``smart_resize`` for every valid input.
    """
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be >= 1, got {height}x{width}")
    aspect_ratio = max(height, width) / min(height, width)
    if aspect_ratio > MAX_ASPECT_RATIO:
        raise AspectRatioError(
            f"aspect ratio {aspect_ratio:.1f} of a {height}x{width} frame exceeds "
            f"the allowed maximum of {MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class VideoPreprocessConfig:
    """Every parameter that changes the patches a video turns into."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        check_int_fields(
            self, ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels")
        )
        if self.max_pixels < self.min_pixels:
            raise ValueError(
                f"max_pixels must be >= min_pixels={self.min_pixels}, got {self.max_pixels}"
            )
        check_rgb_fields(self, ("image_mean", "image_std"))
        factor = self.rescale_factor
        if not isinstance(factor, float | int) or not (0 < factor < math.inf):
            raise ValueError(f"rescale_factor must be a positive finite float, got {factor!r}")

    @property
    def factor(self) -> int:
        """Side length in pixels of one merged token: resized sizes are multiples of it."""
        return self.patch_size * self.merge_size

    def key(self) -> str:
        """A stable string of every parameter, for cache keys."""
        return config_key(self, "qwen2vl-preprocess-v1")

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, kind: Literal["video", "image"] = "video"
    ) -> VideoPreprocessConfig:
        """Read a checkpoint directory's video_preprocessor_config.json if present, else its
        preprocessor_config.json, else use the defaults. Images (`kind="image"`) read only
        preprocessor_config.json, as transformers' image processor does.

        Both spellings of the pixel bounds are understood: top-level min_pixels / max_pixels
        (which win, as in transformers) and size={"shortest_edge": ..., "longest_edge": ...}.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
        for name in CONFIG_FILES if kind == "video" else CONFIG_FILES[1:]:
            if (directory / name).is_file():
                return cls._from_dict(json.loads((directory / name).read_text()), name)
        return cls()

    @classmethod
    def _from_dict(cls, data: dict, source: str) -> VideoPreprocessConfig:
        check_steps_on(data, source)
        if data.get("resample", Image.Resampling.BICUBIC) != Image.Resampling.BICUBIC:
            raise ValueError(f"{source}: resample={data['resample']!r} is not supported (only 3)")
        size = data.get("size") or {}
        bounds = {
            "min_pixels": data.get("min_pixels", size.get("shortest_edge", size.get("min_pixels"))),
            "max_pixels": data.get("max_pixels", size.get("longest_edge", size.get("max_pixels"))),
        }
        kwargs = {k: v for k, v in bounds.items() if v is not None}
        for name in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor"):
            if name in data:
                kwargs[name] = data[name]
        for name in ("image_mean", "image_std"):
            if name in data:
                kwargs[name] = tuple(data[name])
        return cls(**kwargs)


DEFAULT_CONFIG = VideoPreprocessConfig()


@dataclass(frozen=True)
class PreprocessedVideo:
    """Patches of one video (or image) ready for the vision tower."""

    patches: torch.Tensor  # [t*h*w, 3*temporal_patch_size*patch_size*patch_size] float32
    grid_thw: tuple[int, int, int]  # pre-merge patch grid; t = ceil(T / temporal_patch_size)
    second_per_grid_ts: float  # seconds one tubelet spans; 0.0 for images
    resized_height: int
    resized_width: int


def preprocess_video(
    frames: np.ndarray,
    sample_fps: float,
    config: VideoPreprocessConfig = DEFAULT_CONFIG,
    source_size: tuple[int, int] | None = None,
) -> PreprocessedVideo:
    """Turn frames [T, H, W, 3] uint8 RGB, sampled at ``sample_fps``, into tubelet patches.
    `source_size` (height, width): the frames were resized at decode from that size, and the
    target is smart resize's of it (frames already there are left as they are)."""
    if not (isinstance(sample_fps, float | int) and 0 < sample_fps < math.inf):
        raise ValueError(f"sample_fps must be a positive finite number, got {sample_fps!r}")
    return patchify_frames(
        frames, config, config.temporal_patch_size / sample_fps, source_size=source_size
    )


def preprocess_image(
    image: np.ndarray,
    config: VideoPreprocessConfig = DEFAULT_CONFIG,
) -> PreprocessedVideo:
    """Turn one image [H, W, 3] uint8 RGB into patches: the image repeated to one tubelet
    (grid t = 1), as transformers does. second_per_grid_ts is 0.0: a still image spans no
    time, and M-RoPE never scales the temporal index of an image.
    """
    check_image(image)
    return patchify_frames(image[None], config, 0.0)


def patchify_frames(
    frames: np.ndarray,
    config: VideoPreprocessConfig,
    second_per_grid_ts: float,
    resized: tuple[int, int] | None = None,
    source_size: tuple[int, int] | None = None,
) -> PreprocessedVideo:
    """Frames [T, H, W, 3] uint8 resized to `resized` (height, width; by default the smart
    resize of one frame, or of `source_size` when the frames were resized at decode from that
    size), normalised and cut into tubelet patches."""
    check_frames(frames)
    num_frames = frames.shape[0]
    height, width = source_size or frames.shape[1:3]
    resized_height, resized_width = resized or smart_resize(
        height, width, config.factor, config.min_pixels, config.max_pixels
    )
    tp, ps, ms = config.temporal_patch_size, config.patch_size, config.merge_size
    grid_t = -(-num_frames // tp)
    grid_h, grid_w = resized_height // ps, resized_width // ps
    lut = normalization_lut(config)  # [3, 256]
    out = np.empty((grid_t, grid_h // ms, grid_w // ms, ms, ms, 3, tp, ps, ps), np.float32)

    def prepare(t: int) -> None:
        tubelet = np.empty((tp, resized_height, resized_width, 3), np.uint8)
        for k in range(tp):
            index = t * tp + k
            if index < num_frames:
                tubelet[k] = _resize(frames[index], resized_height, resized_width)
            else:  # pad to a whole tubelet with the last frame, as transformers does
                tubelet[k] = tubelet[k - 1]
        _patchify_tubelet(tubelet, lut, out[t])

    # PIL's resize and numpy's lookups release the GIL: tubelets run on every core.
    num_workers = min(_usable_cpus(), grid_t)
    if num_workers > 1:
        with ThreadPoolExecutor(num_workers, thread_name_prefix="preprocess") as pool:
            list(pool.map(prepare, range(grid_t)))
    else:
        for t in range(grid_t):
            prepare(t)
    patches = torch.from_numpy(out.reshape(grid_t * grid_h * grid_w, 3 * tp * ps * ps))
    return PreprocessedVideo(
        patches=patches,
        grid_thw=(grid_t, grid_h, grid_w),
        second_per_grid_ts=second_per_grid_ts,
        resized_height=resized_height,
        resized_width=resized_width,
    )


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _patchify_tubelet(tubelet: np.ndarray, lut: np.ndarray, out: np.ndarray) -> None:
    """Normalize one tubelet [tp, h, w, 3] uint8 into out [h/ms, w/ms, ms, ms, 3, tp, ps, ps]."""
    blocks_h, blocks_w, ms, _, _, tp, ps, _ = out.shape
    blocks = tubelet.reshape(tp, blocks_h, ms, ps, blocks_w, ms, ps, 3)
    blocks = np.ascontiguousarray(blocks.transpose(1, 4, 2, 5, 7, 0, 3, 6))  # out's shape, uint8
    # Looking up in the final layout writes the float32 data once; the transpose moves bytes.
    for c in range(3):
        out[:, :, :, :, c] = lut[c][blocks[:, :, :, :, c]]


def _resize(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bicubic resize of one [H, W, 3] uint8 frame to [height, width, 3]."""
    if frame.shape[:2] == (height, width):
        return frame  # PIL returns an unchanged copy at the same size
    image = Image.fromarray(np.ascontiguousarray(frame))
    return np.asarray(image.resize((width, height), resample=Image.Resampling.BICUBIC))
