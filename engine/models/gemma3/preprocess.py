"""Gemma 3 image preprocessing, equal to transformers' `Gemma3ImageProcessorPil`.

Every image, and every frame of a video, becomes one `image_size` square: resized with PIL
(bilinear unless the checkpoint names another filter; the aspect ratio is not kept), rescaled
by 1/255 and normalised with mean = std = 0.5 per channel. Pan-and-scan crops (off by default
in transformers) are not supported. Rescale and normalise go through the per-channel lookup
table the Qwen preprocessing uses, which repeats transformers' float64-then-float32 arithmetic,
so the values agree bit for bit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from stillcut.engine.models.pixels import (
    check_frames,
    check_image,
    check_int_fields,
    check_rgb_fields,
    check_steps_on,
    config_key,
    normalization_lut,
)

CONFIG_FILE = "preprocessor_config.json"
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
_RESAMPLE_FILTERS = {int(f): f for f in Image.Resampling}


@dataclass(frozen=True)
class Gemma3PreprocessConfig:
    """Every parameter that changes the pixels an image turns into.

    Defaults are transformers' `Gemma3ImageProcessorPil` defaults; real checkpoints set
    `image_size` to the tower's (896).
    """

    image_size: int = 224
    resample: int = int(Image.Resampling.BILINEAR)
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STANDARD_STD

    def __post_init__(self) -> None:
        check_int_fields(self, ("image_size",))
        if self.resample not in _RESAMPLE_FILTERS:
            raise ValueError(
                f"resample={self.resample!r}; allowed: PIL filters {sorted(_RESAMPLE_FILTERS)}"
            )
        if not (isinstance(self.rescale_factor, float | int) and 0 < self.rescale_factor < 1):
            raise ValueError(f"rescale_factor must lie in (0, 1), got {self.rescale_factor!r}")
        check_rgb_fields(self, ("image_mean", "image_std"))

    def key(self) -> str:
        """A stable string of every parameter, for cache keys."""
        return config_key(self, "gemma3-preprocess-v1")

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str]) -> Gemma3PreprocessConfig:
        """Read a checkpoint folder's preprocessor_config.json.

        Raises FileNotFoundError without one, ValueError for settings transformers would apply
        and this module does not: a non-square size, pan-and-scan, or a skipped step.
        """
        file = Path(path) / CONFIG_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist; Gemma 3 checkpoints carry one")
        return cls.from_dict(json.loads(file.read_text()), str(file))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = CONFIG_FILE) -> Gemma3PreprocessConfig:
        """The config of a parsed preprocessor_config.json (`source` names it in errors)."""
        check_steps_on(data, source)
        if data.get("do_pan_and_scan"):
            raise ValueError(f"{source}: do_pan_and_scan=true is not supported (only false)")
        size = data.get("size") or {"height": cls.image_size, "width": cls.image_size}
        if size.get("height") != size.get("width") or size.get("height") is None:
            raise ValueError(f"{source}: size={size!r}; expected a square {{height, width}}")
        kwargs: dict[str, Any] = {"image_size": size["height"]}
        for name in ("resample", "rescale_factor"):
            if data.get(name) is not None:
                kwargs[name] = data[name]
        for name in ("image_mean", "image_std"):
            if data.get(name) is not None:
                kwargs[name] = tuple(data[name])
        return cls(**kwargs)


def preprocess_frames(
    frames: np.ndarray, config: Gemma3PreprocessConfig = Gemma3PreprocessConfig()
) -> torch.Tensor:
    """Frames (or images) [T, H, W, 3] uint8 RGB -> pixel values [T, 3, S, S] float32."""
    check_frames(frames)
    size = config.image_size
    resample = _RESAMPLE_FILTERS[config.resample]
    lut = normalization_lut(config)  # [3, 256]
    channels = np.arange(3)[:, None, None]  # [3, 1, 1]
    out = np.empty((frames.shape[0], 3, size, size), np.float32)
    for index, frame in enumerate(frames):
        # PIL returns a copy when the size already matches, as transformers gets.
        image = Image.fromarray(np.ascontiguousarray(frame)).resize((size, size), resample)
        out[index] = lut[channels, np.asarray(image).transpose(2, 0, 1)]  # [3, S, S]
    return torch.from_numpy(out)


def preprocess_image(
    image: np.ndarray, config: Gemma3PreprocessConfig = Gemma3PreprocessConfig()
) -> torch.Tensor:
    """One image [H, W, 3] uint8 RGB -> pixel values [3, S, S] float32."""
    check_image(image)
    return preprocess_frames(image[None], config)[0]
