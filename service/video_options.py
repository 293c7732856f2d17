"""A request's video options, the same on every route (chat body, describe form, plan query).

`fps`, `max_frames`, `num_frames` (exactly that many, evenly), `start`, `end`, the pixel budget
the model family's processor takes (its entry's `pixel_budget` names, such as
`min_pixels`, `max_pixels`: integers, a switch among them also a JSON boolean),
`max_video_tokens` (a total for the request's videos) and `resize` ("exact", as the model's
processor resizes; "fast", FFmpeg's scaler at decode). Values
arrive typed (JSON) or as text (forms, query strings); each is checked where it is parsed,
with a 400 that names it, and the sampling ones under the server's ceilings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stillcut.engine.models.families import FAMILIES
from stillcut.service.config import ServerConfig
from stillcut.service.errors import bad_request, shown
from stillcut.service.request_limits import checked_sampling
from stillcut.vision.decode import DecodeConfig
from stillcut.vision.decode_config import RESIZE_MODES

SAMPLING_OPTIONS: dict[str, type] = {
    "fps": float,
    "max_frames": int,
    "num_frames": int,
    "start": float,
    "end": float,
    "max_video_tokens": int,
}


def pixel_option_names() -> tuple[str, ...]:
    """Every pixel budget name a registered family takes (each model checks its own)."""
    names = {name for kind in FAMILIES.model_types for name in FAMILIES.get(kind).pixel_budget}
    return tuple(sorted(names))


def video_option_names() -> tuple[str, ...]:
    return (*SAMPLING_OPTIONS, *pixel_option_names(), "resize")


@dataclass(frozen=True)
class VideoOptions:
    """A request's checked video options (None / empty: the server's defaults)."""

    fps: float | None = None
    max_frames: int | None = None
    num_frames: int | None = None
    start: float | None = None
    end: float | None = None
    max_video_tokens: int | None = None
    pixels: tuple[tuple[str, int], ...] = ()
    resize: str | None = None

    def input_options(self, config: ServerConfig, defaults: DecodeConfig) -> dict[str, Any]:
        """`VideoInput`'s keyword arguments, under the server's fps and frame ceilings."""
        if self.num_frames is not None and self.num_frames > config.limit_frames:
            raise bad_request(
                f"num_frames={self.num_frames} exceeds the server's "
                f"limit_frames={config.limit_frames}",
                "over_limit",
            )
        sampling = checked_sampling(self.fps, self.max_frames, config, defaults)
        if self.num_frames is not None:
            sampling["max_frames"] = max(sampling["max_frames"] or 0, self.num_frames)
        return {
            **sampling,
            "num_frames": self.num_frames,
            "start": self.start,
            "end": self.end,
            "pixels": self.pixels,
            "resize": self.resize,
        }

    def check_pixels(self, pipeline) -> None:
        """400 unless the model's family takes this pixel budget."""
        try:
            pipeline.media_with(self.pixels)
        except ValueError as error:
            raise bad_request(str(error), "invalid_parameter") from None


def parse_video_options(values: Mapping[str, Any], where: str = "") -> VideoOptions:
    """The video options among `values` (other keys are left alone), typed and checked."""
    typed = {
        name: _typed(values[name], kind, f"{where}{name}")
        for name, kind in SAMPLING_OPTIONS.items()
        if values.get(name) not in (None, "")
    }
    for name in pixel_option_names():
        value = values.get(name)
        if isinstance(value, bool):  # a budget's switch (e.g. cap_pixels_per_frame) as JSON
            typed[name] = int(value)
        elif value not in (None, ""):
            typed[name] = _typed(value, int, f"{where}{name}")
    for name in ("start", "end"):
        if name in typed and typed[name] < 0:
            raise bad_request(f"{where}{name}={typed[name]:g} must be >= 0", "invalid_parameter")
    if typed.get("end") is not None and typed["end"] <= typed.get("start", 0.0):
        raise bad_request(f"{where}end must be after start", "invalid_parameter")
    for name in ("max_frames", "num_frames", "max_video_tokens"):
        if name in typed and typed[name] < 1:
            raise bad_request(f"{where}{name} must be >= 1", "invalid_parameter")
    if "fps" in typed and typed["fps"] <= 0:
        raise bad_request(f"{where}fps must be > 0", "invalid_parameter")
    pixels = tuple((name, typed.pop(name)) for name in pixel_option_names() if name in typed)
    return VideoOptions(**typed, pixels=pixels, resize=_resize(values.get("resize"), where))


def _resize(value: Any, where: str) -> str | None:
    if value in (None, ""):
        return None
    if value not in RESIZE_MODES:
        allowed = " or ".join(repr(mode) for mode in RESIZE_MODES)
        raise bad_request(f"{where}resize={shown(value)} must be {allowed}", "invalid_parameter")
    return value


def _typed(value: Any, kind: type, name: str) -> int | float:
    """`value` as `kind`: text is parsed, a JSON number checked; bools and NaN refused."""
    if isinstance(value, str):
        try:
            value = kind(value)
        except ValueError:
            raise bad_request(f"{name}={value!r} must be {kind.__name__}", "invalid_type") from None
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        ok = ok and isinstance(value, int)
    if not ok or not math.isfinite(value):
        raise bad_request(f"{name} must be a finite {kind.__name__}", "invalid_type")
    return kind(value)
