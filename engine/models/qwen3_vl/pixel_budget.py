"""A request's video pixel budget on Qwen3-VL: the video processor's own options, and
qwen-vl-utils' per-video ones mapped onto them.

The processor bounds the whole clip, `shortest_edge` <= frames x height x width <=
`longest_edge` (its `size`), and with `cap_pixels_per_frame` (0 or 1) each frame's share of
`longest_edge` is also capped at `max_video_tokens` merged tokens (`preprocess.clip_size`).
qwen-vl-utils, which the model cards' examples use, takes per video `min_pixels` and
`max_pixels` (each frame's floor and ceiling) and `total_pixels` (the clip's, counting each
2-frame tubelet once), and always caps each frame. They map onto the processor's options as
transformers pairs them (its `shortest_edge` default, 128 x 32 x 32, is qwen-vl-utils' per-frame
floor; its `max_video_tokens`, 768, qwen-vl-utils' per-frame token ceiling): `min_pixels` is
`shortest_edge`, `max_pixels` the frame cap, `total_pixels` half of `longest_edge`, and any of
them turns the cap on unless the request sets `cap_pixels_per_frame` itself. Both spellings of
one bound in one request is an error. Every name reads back the value in force
(`budget_in_force`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from stillcut.engine.models.pixels import check_budget_values, pixel_bounds
from stillcut.engine.models.qwen2_vl.preprocess import VideoPreprocessConfig
from stillcut.engine.models.qwen3_vl.preprocess import ClipBudget

PIXEL_BUDGET = (
    "shortest_edge",
    "longest_edge",
    "cap_pixels_per_frame",
    "min_pixels",
    "max_pixels",
    "total_pixels",
)
_TOKEN_PIXELS = 32 * 32  # one merged token of 16-pixel patches
_MAX_FRAME_PIXELS = 16384 * _TOKEN_PIXELS  # Qwen's largest image
_MAX_CLIP_PIXELS = 768 * _MAX_FRAME_PIXELS  # transformers' most frames, each the largest
RANGES = MappingProxyType(
    {
        "shortest_edge": (_TOKEN_PIXELS, _MAX_CLIP_PIXELS),
        "longest_edge": (_TOKEN_PIXELS, _MAX_CLIP_PIXELS),
        "cap_pixels_per_frame": (0, 1),
        "min_pixels": (_TOKEN_PIXELS, _MAX_FRAME_PIXELS),
        "max_pixels": (_TOKEN_PIXELS, _MAX_FRAME_PIXELS),
        "total_pixels": (_TOKEN_PIXELS, _MAX_CLIP_PIXELS // 2),
    }
)
# qwen-vl-utils' name -> the processor's name of the same bound
_SAME_BOUND = MappingProxyType({"min_pixels": "shortest_edge", "total_pixels": "longest_edge"})


def budget_in_force(config: VideoPreprocessConfig, budget: ClipBudget) -> dict[str, int]:
    """Every budget name's value in force for a video (`config`'s min / max pixels are the
    clip's `size`)."""
    return {
        "shortest_edge": config.min_pixels,
        "longest_edge": config.max_pixels,
        "cap_pixels_per_frame": int(budget.cap_pixels_per_frame),
        "min_pixels": config.min_pixels,
        "max_pixels": budget.max_video_tokens * config.factor**2,
        "total_pixels": config.max_pixels // 2,
    }


def with_budget(
    config: VideoPreprocessConfig, budget: ClipBudget, values: Mapping[str, int]
) -> tuple[VideoPreprocessConfig, ClipBudget]:
    """`config` and `budget` with a request's `values` (see the module docstring); ValueError
    names a value out of its range or two spellings of one bound."""
    check_budget_values(values, {name: RANGES[name] for name in values})
    for utils_name, processor_name in _SAME_BOUND.items():
        if utils_name in values and processor_name in values:
            raise ValueError(
                f"{utils_name} and {processor_name} set the same bound (qwen-vl-utils' and the "
                "processor's name for it): give one"
            )
    low_name = "min_pixels" if "min_pixels" in values else "shortest_edge"
    high, high_name = values.get("longest_edge"), "longest_edge"
    if "total_pixels" in values:
        high, high_name = 2 * values["total_pixels"], "2 x total_pixels"
    low, high = pixel_bounds(
        values.get(low_name), high, (config.min_pixels, config.max_pixels), (low_name, high_name)
    )
    frame_cap = values.get("max_pixels", budget.max_video_tokens * config.factor**2)
    utils_style = any(name in values for name in ("min_pixels", "max_pixels", "total_pixels"))
    cap = values.get("cap_pixels_per_frame", budget.cap_pixels_per_frame or utils_style)
    return (
        dataclasses.replace(config, min_pixels=low, max_pixels=high),
        ClipBudget(bool(cap), max(frame_cap // config.factor**2, 1)),
    )
