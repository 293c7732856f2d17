"""The settings of video decoding: the sampling rate and the limits on what an input may cost.

Import it from `stillcut.vision.decode`; it lives apart so the decoding modules can share it.
"""

import dataclasses
import math
from dataclasses import dataclass


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


RESIZE_MODES = ("exact", "fast")


@dataclass(frozen=True)
class DecodeConfig:
    """Sampling rate and the limits that keep hostile inputs cheap to reject."""

    fps: float = 2.0  # sample times per second of video
    max_frames: int = 64  # cap on sampled frames; longer ranges are sampled evenly instead
    max_bytes: int = 512 * 2**20
    # Safety caps on what a packet scan may read (4 hours; a million packets: 4.6 hours at
    # 60 fps). What a clip may *cost* is bounded by tokens (duration x fps x tokens per
    # frame, see `video_plan`), not by these: sampling is streamed, so duration costs no memory.
    max_duration_s: float = 4 * 3600.0
    max_pixels: int = 4096 * 2304  # width * height, checked from the header before decoding
    max_decoded_frames: int = 1_000_000  # safety cap on frames decoded (or packets scanned)
    num_frames: int | None = None  # exactly this many, evenly over the range (fps ignored)
    resize: str = "exact"  # "fast": FFmpeg's scaler at decode (see `frame_resize`)
    max_image_pixels: int = 4096 * 4096  # of a still image, checked from its header

    def __post_init__(self) -> None:
        for name in ("fps", "max_duration_s"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value > 0):
                raise ValueError(f"DecodeConfig.{name} must be a finite number > 0, got {value!r}")
        for name in (
            "max_frames",
            "max_bytes",
            "max_pixels",
            "max_decoded_frames",
            "max_image_pixels",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"DecodeConfig.{name} must be an integer >= 1, got {value!r}")
        if self.resize not in RESIZE_MODES:
            raise ValueError(
                f"DecodeConfig.resize must be one of {RESIZE_MODES}, got {self.resize!r}"
            )
        count = self.num_frames
        if count is not None and not (isinstance(count, int) and 1 <= count <= self.max_frames):
            raise ValueError(
                f"DecodeConfig.num_frames must be an integer in [1, max_frames={self.max_frames}]"
                f", got {count!r}"
            )

    def with_sampling(
        self, fps: float | None, max_frames: int | None, num_frames: int | None = None
    ) -> "DecodeConfig":
        """This config with a request's own `fps` / `max_frames` / `num_frames` (None: keep
        this one's); `num_frames` raises `max_frames` to itself where it is lower."""
        if num_frames is not None and max_frames is None:
            max_frames = max(self.max_frames, num_frames) if isinstance(num_frames, int) else None
        changes = {"fps": fps, "max_frames": max_frames, "num_frames": num_frames}
        changes = {name: value for name, value in changes.items() if value is not None}
        return dataclasses.replace(self, **changes) if changes else self


def is_seconds(value: object) -> bool:
    """True for a finite, non-negative int or float (not a bool)."""
    return _is_number(value) and math.isfinite(value) and value >= 0
