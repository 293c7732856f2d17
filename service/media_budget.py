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

    @classmethod
    def of(cls, scheduler: SchedulerConfig, max_tokens: int) -> MediaBudget:
        return cls(scheduler.max_visual_tokens_per_request, scheduler.max_model_len, max_tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens the media may need before one of the two limits is passed."""
        return min(self.max_visual_tokens, self.max_model_len - self.max_tokens)

    def check(self, num_tokens: int) -> None:
        """Raise the engine's admission error when media needing `num_tokens` cannot fit."""
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


def check_media_budget(
    pipeline: VisionPipeline, inputs: Sequence[MediaInput], budget: MediaBudget
) -> None:
    """Refuse `inputs` (repeats included) if their fewest kept tokens cannot fit `budget`."""
    num_tokens = 0
    for spec, count in _counted(inputs):
        left = max(0, budget.num_tokens - num_tokens) // count
        num_tokens += count * min_kept_tokens(pipeline, spec, left)
        budget.check(num_tokens)


def min_kept_tokens(pipeline: VisionPipeline, spec: MediaInput, affordable: int) -> int:
    """The fewest tokens `spec` can keep; a clip's packet scan stops once that passes
    `affordable` (the count returned is then only known to be over it)."""
    media = pipeline.media_for(spec)
    if isinstance(spec, ImageInput):
        size = _image_size(spec.source, pipeline.decode_config.max_image_pixels)
        if size is None:
            return 0  # a file object is read once, by the encoder; the engine still checks it
        grid = media.token_grid("image", 1, size[1], size[0])
        return grid[0] * grid[1] * grid[2]  # images are never pruned

    def cost(num_frames: int, height: int, width: int) -> int:
        return kept_range(media.token_grid("video", num_frames, height, width), spec.evs)[0]

    if isinstance(spec.source, np.ndarray):
        return cost(*spec.source.shape[:3])  # [T, H, W, 3]
    if not isinstance(spec.source, bytes | str | os.PathLike):
        return 0  # a file object is read once, by the encoder; the engine still checks it
    config = pipeline.decode_options(spec)

    def affordable_frames(width: int, height: int) -> int:
        return most_frames(lambda n: cost(n, height, width), config.max_frames, affordable)

    probe = probe_video(
        spec.source, config, start=spec.start, end=spec.end, max_samples=affordable_frames
    )
    return cost(probe.num_samples, probe.height, probe.width)


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
