"""What every family's media preprocessing shares: frame checks, config validation, and the
normalisation lookup table.

Families preprocess differently (a size fitted to a pixel budget, a fixed square, a patch-budget
tile), but each checks its input frames the same way, validates its
frozen preprocess config with the same rules and messages, keys its cache entries by every
field, and rescales and normalises uint8 pixels through one per-channel lookup table that
repeats transformers' float64-then-float32 arithmetic, so values agree bit for bit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESS_STEPS = ("do_resize", "do_rescale", "do_normalize")


class AspectRatioError(ValueError):
    """An image or video whose aspect ratio is too extreme to be split into patches."""


def check_int_fields(config: Any, names: Iterable[str], minimum: int = 1) -> None:
    """Raise ValueError unless every field in `names` of `config` is an int >= `minimum`."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_budget_values(values: Mapping[str, Any], ranges: Mapping[str, tuple[int, int]]) -> None:
    """Raise ValueError unless each value in `values` is an integer in its name's range
    `ranges[name]` (both ends allowed)."""
    for name, value in values.items():
        low, high = ranges[name]
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def pixel_bounds(
    low: int | None, high: int | None, current: tuple[int, int], names: tuple[str, str]
) -> tuple[int, int]:
    """A request's (low, high) pixel bounds over the `current` ones, as processors take them:
    a bound given alone (the other None) moves the current other where it would cross it;
    two given must not cross (ValueError with their `names`)."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"{names[0]}={low} must be <= {names[1]}={high}")
    if low is not None:
        return low, max(current[1], low) if high is None else high
    return (current[0], current[1]) if high is None else (min(current[0], high), high)


def check_rgb_fields(config: Any, names: Iterable[str]) -> None:
    """Raise ValueError unless every field in `names` is a tuple of 3 finite floats, positive
    for a field whose name ends in `std` (it divides)."""
    for name in names:
        value, positive = getattr(config, name), name.endswith("std")
        ok = isinstance(value, tuple) and len(value) == 3
        ok = ok and all(isinstance(v, float | int) and math.isfinite(v) for v in value)
        if not ok or (positive and min(value) <= 0):
            allowed = "positive finite floats" if positive else "finite floats"
            raise ValueError(f"{name} must be a tuple of 3 {allowed}, got {value!r}")


def check_steps_on(data: Mapping[str, Any], source: str) -> None:
    """Raise ValueError when a preprocessor config switches off resizing, rescaling or
    normalising: every family here always does all three, as the checkpoints ask."""
    for step in PREPROCESS_STEPS:
        if data.get(step, True) is not True:
            raise ValueError(
                f"{source}: {step}={json.dumps(data[step])} is not supported (only true)"
            )


def config_key(config: Any, name: str) -> str:
    """A stable string of every field of the dataclass `config`, for cache keys."""
    values = ",".join(f"{f.name}={getattr(config, f.name)!r}" for f in fields(config))
    return f"{name}({values})"


def check_frames(frames: object) -> None:
    """Raise a ValueError unless `frames` is a uint8 RGB array [T >= 1, H, W, 3]."""
    if not (
        isinstance(frames, np.ndarray)
        and frames.dtype == np.uint8
        and frames.ndim == 4
        and frames.shape[0] >= 1
        and frames.shape[3] == 3
    ):
        raise ValueError(f"frames must be uint8 RGB [T>=1, H, W, 3], got {describe_array(frames)}")


def check_image(image: object) -> None:
    """Raise a ValueError unless `image` is a numpy array [H, W, 3]."""
    if not isinstance(image, np.ndarray) or image.ndim != 3:
        raise ValueError(f"image must be a numpy array [H, W, 3], got {describe_array(image)}")


def describe_array(array: object) -> str:
    """Shape and dtype of an array, or the type of anything else, for error messages."""
    if isinstance(array, np.ndarray):
        return f"shape {list(array.shape)} dtype {array.dtype}"
    return type(array).__name__


def normalization_lut(config: Any) -> np.ndarray:
    """[3, 256] float32: normalized value of every uint8 level per channel, computed in
    transformers' order (uint8 -> float64 * scale -> float32, then float32 (x - mean) / std),
    so the lookup is bit-identical to its arithmetic. `config` has `rescale_factor`,
    `image_mean` and `image_std`.
    """
    levels = (np.arange(256, dtype=np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None]  # [3, 1]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None]  # [3, 1]
    return (levels[None, :] - mean) / std
