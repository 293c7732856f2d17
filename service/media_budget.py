"""What a request's media will cost, worked out from their headers before anything is decoded,
and the refusal of a request the engine could never take.

For a video, `probe_video` gives the frames the sampling plan takes and their size; the model
family's resize rule turns them into a token grid, and EVS's rule into the fewest tokens that
can be kept (exact for rate mode and EVS off; for threshold mode the first tubelet whole plus
each later tubelet's floor). An image's size comes from its header. The sum, with every
repeat of a medium counted, must fit the engine's visual-token limit and, with the answer's
`max_tokens`, its context; otherwise the request fails with the same errors the engine's own
admission raises, before a frame is decoded. A packet scan stops as soon as its clip is known
to be over what is left of the budget.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from stillcut.engine.admission import RequestTooLong, TooManyVisualTokens
from stillcut.engine.config import SchedulerConfig
from stillcut.vision.decode import probe_video
from stillcut.vision.image_file import image_size
from stillcut.vision.pipeline import ImageInput, VideoInput, VisionPipeline
from stillcut.vision.video_plan import kept_range, most_frames

MediaInput = VideoInput | ImageInput


@dataclass(frozen=True)
class MediaBudget:
    """The most visual tokens one request's media may need."""

    max_visual_tokens: int  # the engine's max_visual_tokens_per_request
    max_model_len: int
    max_tokens: int  # what the answer may add to the context
    max_video_tokens: int | None = None  # the request's own budget for its videos

    @classmethod
    def of(
        cls, scheduler: SchedulerConfig, max_tokens: int, max_video_tokens: int | None = None
    ) -> MediaBudget:
        limits = (scheduler.max_visual_tokens_per_request, scheduler.max_model_len)
        return cls(*limits, max_tokens, max_video_tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens the media may need before one of the limits is passed."""
        limits = (self.max_visual_tokens, self.max_model_len - self.max_tokens)
        return min(*limits, self.max_video_tokens or self.max_visual_tokens)

    def check(self, num_tokens: int) -> None:
        """Raise the engine's admission error when media needing `num_tokens` cannot fit."""
        if self.max_video_tokens is not None and num_tokens > self.max_video_tokens:
            raise TooManyVisualTokens(
                f"the request's media need at least {num_tokens} visual tokens, over its "
                f"max_video_tokens={self.max_video_tokens} (known before decoding)"
            )
        if num_tokens > self.max_visual_tokens:
            raise TooManyVisualTokens(
                f"the request's media need at least {num_tokens} visual tokens, over "
                f"max_visual_tokens_per_request={self.max_visual_tokens} (known before decoding)"
            )
        if num_tokens + self.max_tokens > self.max_model_len:
            raise RequestTooLong(
                f"the request's media need at least {num_tokens} tokens; with max_tokens "
                f"({self.max_tokens}) that exceeds max_model_len={self.max_model_len} "
                "(known before decoding)"
            )


def check_encoded(items: Sequence, budget: MediaBudget) -> None:
    """Refuse what encoding kept when it is over the request's own video budget (threshold
    mode keeps what the content asks for: known only now)."""
    if budget.max_video_tokens is not None:
        kept = sum(item.num_tokens for item in items if item.kind == "video")
        if kept > budget.max_video_tokens:
            raise TooManyVisualTokens(
                f"the request's videos kept {kept} tokens, over its "
                f"max_video_tokens={budget.max_video_tokens}"
            )


def check_media_budget(
    pipeline: VisionPipeline, inputs: Sequence[MediaInput], budget: MediaBudget
) -> None:
    """Refuse `inputs` (repeats included) if their fewest kept tokens cannot fit `budget`."""
    num_tokens = 0
    for spec, count in _counted(inputs):
        left = max(0, budget.num_tokens - num_tokens) // count
        kept, fitting = min_kept_tokens(pipeline, spec, left)
        num_tokens += count * kept
        try:
            budget.check(num_tokens)
        except (TooManyVisualTokens, RequestTooLong) as error:
            if fitting is None:
                raise
            # the plan that would fit: as many frames as the budget left affords
            hint = f"; at most {fitting} frames of this video fit (num_frames={fitting})"
            raise type(error)(f"{error}{hint}" if fitting else str(error)) from None


def min_kept_tokens(
    pipeline: VisionPipeline, spec: MediaInput, affordable: int
) -> tuple[int, int | None]:
    """The fewest tokens `spec` can keep, and for a video file the most frames of it that
    `affordable` tokens afford; a clip's packet scan stops once the count passes `affordable`
    (it is then only known to be over it)."""
    if isinstance(spec, ImageInput):
        size = _image_size(spec.source, pipeline.decode_config.max_image_pixels)
        if size is None:
            return 0, None  # a file object is read once, by the encoder; the engine checks it
        grid = pipeline.media.token_grid("image", 1, size[1], size[0])
        return grid[0] * grid[1] * grid[2], None  # images are never pruned
    media = pipeline.media_with(spec.pixels)

    def cost(num_frames: int, height: int, width: int) -> int:
        return kept_range(media.token_grid("video", num_frames, height, width), spec.evs)[0]

    if isinstance(spec.source, np.ndarray):
        return cost(*spec.source.shape[:3]), None  # [T, H, W, 3]
    if not isinstance(spec.source, bytes | str | os.PathLike):
        return 0, None  # a file object is read once, by the encoder; the engine checks it
    config = pipeline.decode_options(spec)

    def affordable_frames(width: int, height: int) -> int:
        return most_frames(lambda n: cost(n, height, width), config.max_frames, affordable)

    probe = probe_video(
        spec.source, config, start=spec.start, end=spec.end, max_samples=affordable_frames
    )
    fitting = affordable_frames(probe.width, probe.height)
    return cost(probe.num_samples, probe.height, probe.width), fitting


def _image_size(source, max_pixels: int) -> tuple[int, int] | None:
    """(width, height) of an image input, from its header; None for a file object."""
    if isinstance(source, Image.Image):
        return source.size
    if isinstance(source, np.ndarray):
        return source.shape[1], source.shape[0]
    if isinstance(source, str | os.PathLike):
        with open(source, "rb") as file:
            return image_size(file.read(), max_pixels)
    if isinstance(source, bytes | bytearray | memoryview):
        return image_size(bytes(source), max_pixels)
    return None


def _counted(inputs: Sequence[MediaInput]) -> list[tuple[MediaInput, int]]:
    """Each distinct input once, with how often it occurs."""
    counts: dict[object, list] = {}
    for spec in inputs:
        counts.setdefault(media_identity(spec), [spec, 0])[1] += 1
    return [(spec, count) for spec, count in counts.values()]


def media_identity(spec: MediaInput) -> tuple:
    """Equal for inputs that encode to the same item: the same bytes or path and options.
    Arrays, file objects and images count as the same only when they are the same object."""
    source = spec.source
    if not isinstance(source, bytes | str | os.PathLike):
        source = ("object", id(source))
    options = tuple(value for name, value in vars(spec).items() if name != "source")
    return (type(spec).__name__, source, options)
