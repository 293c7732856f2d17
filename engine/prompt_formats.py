"""How a family writes media into a rendered prompt, and videos written as image items.

The chat template renders one marker per media part. A `PromptFormat` then turns each marker
into the family's placeholder text with exactly one placeholder token per item it places (it
sees the items, and may place one as several: a video as its tubelets); the processor
tokenizes that and repeats each placeholder token to its item's kept-token count. Placeholder
tokens are special, so BPE never merges across them and expanding after tokenizing gives the
ids that tokenizing the fully expanded text would.

- `PromptFormat` itself leaves the text as rendered: the template already writes one
  placeholder token per part (e.g. `<|vision_start|><|video_pad|><|vision_end|>`).

A format also says how a live stream writes its tubelets after the video's begin marker
(`stream_tubelet`): by default their placeholders follow each other in one logical video; a
format with `separate_tubelets` writes each as its own one-tubelet video with text around it.
`tubelet_time` is the time a narration writes before a tubelet.
- `ImageSequenceFormat` replaces each begin marker the template renders by
  `before + begin + placeholder + end + after` (e.g. `\n\n<start_of_image>` + soft tokens +
  `<end_of_image>\n\n`, as a transformers processor expands it; the newlines may merge with
  the text around them, which tokenizing after expanding honours).

A family without a video placeholder writes a video as its frames: `videos_as_frames` turns
each video part into one image part per grid step (carrying the frame's `timestamp`, seconds,
for a template that prints it) and each video item into one item per grid step
(`frame_items`), each its own block for bidirectional attention. A frame EVS pruned away
entirely keeps its markers and becomes a 0-token item, so the positions after it stay those of
the unpruned prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from stillcut.engine.model_config import CheckpointError
from stillcut.engine.multimodal import MultiModalItem, select_rows


@dataclass(frozen=True)
class MarkerTexts:
    """The token texts of a checkpoint's media tokens: the image placeholder, the vision
    begin and end markers (None for a family whose format writes its own delimiters) and the
    video placeholder (None for a family without one)."""

    placeholder: str
    begin: str | None = None
    end: str | None = None
    video: str | None = None

    def __post_init__(self) -> None:
        for name in ("placeholder", "begin", "end", "video"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must be a non-empty token text or None")


@dataclass(frozen=True)
class PromptFormat:
    """The template writes one placeholder token per media part; nothing to expand."""

    # whether a live stream's tubelet is its own one-tubelet video item (coordinates from
    # t = 0 in a (1, h, w) grid) rather than the next step of the stream's one logical video
    separate_tubelets: ClassVar[bool] = False

    def stream_tubelet(
        self, tubelet: MultiModalItem, markers: MarkerTexts | None
    ) -> tuple[str, str]:
        """The text before and after a live stream tubelet's placeholders: none, its tokens
        join the stream's one video."""
        return "", ""

    def tubelet_time(self, tubelet: MultiModalItem) -> float:
        """The time, in seconds, a narration writes before a one-tubelet video item: its
        first frame's (0.0 without timestamps)."""
        return tubelet.timestamps[0] if tubelet.timestamps else 0.0

    def expand(
        self, text: str, items: Sequence[MultiModalItem], markers: MarkerTexts | None
    ) -> tuple[str, list[MultiModalItem]]:
        """`text` as rendered with each item written around one placeholder token, and the
        items in the order their placeholders now appear (`items` follow the media parts)."""
        return text, list(items)


@dataclass(frozen=True)
class ImageSequenceFormat(PromptFormat):
    """Each rendered begin marker becomes `before + begin + placeholder + end + after`."""

    before: str = ""
    after: str = ""

    def expand(
        self, text: str, items: Sequence[MultiModalItem], markers: MarkerTexts | None
    ) -> tuple[str, list[MultiModalItem]]:
        """The template must have rendered one begin marker per image."""
        if markers is None or markers.begin is None or markers.end is None:
            raise CheckpointError("the tokenizer lacks the vision begin/end/placeholder tokens")
        num_markers = text.count(markers.begin)
        if num_markers != len(items):
            raise CheckpointError(
                f"the chat template rendered {num_markers} {markers.begin} markers for "
                f"{len(items)} images and frames; it must render one per image part"
            )
        sequence = f"{self.before}{markers.begin}{markers.placeholder}{markers.end}{self.after}"
        return text.replace(markers.begin, sequence), list(items)


def frame_items(video: MultiModalItem, frames_per_step: int = 1) -> list[MultiModalItem]:
    """A video item split into one item per grid step (a frame, or a tubelet of
    `frames_per_step` frames), each with that step's kept tokens and sampled frames.

    Coordinates restart at t = 0 in each step's `(1, h, w)` grid; identifiers add the step
    index to the video's, so the prefix cache tells steps apart. Steps keep kind "video", so
    the engine's metrics count their tokens as video tokens.
    """
    num_steps, _, _ = video.grid_thw
    counts = torch.bincount(video.coords[:, 0].cpu(), minlength=num_steps)  # [num_steps]
    assert counts.numel() == num_steps, "coords outside the video's grid"
    bounds = [0, *counts.cumsum(0).tolist()]
    steps = []
    for step in range(num_steps):
        rows = slice(bounds[step], bounds[step + 1])
        frames = slice(step * frames_per_step, (step + 1) * frames_per_step)
        coords = video.coords[rows].clone()  # [kept in step, 3]
        coords[:, 0] = 0
        steps.append(
            replace(
                video,
                embeds=video.embeds[rows],
                features=select_rows(video.features, rows),
                coords=coords,
                grid_thw=(1, *video.grid_thw[1:]),
                timestamps=video.timestamps[frames],
                source_indices=video.source_indices[frames],
                identifier=f"{video.identifier}#{step}",
                kept_per_tubelet=(rows.stop - rows.start,),
                stats={},
            )
        )
    return steps


def videos_as_frames(
    messages: Sequence[Mapping[str, Any]], items: Sequence[MultiModalItem]
) -> tuple[list[dict[str, Any]], list[MultiModalItem]]:
    """Messages whose video parts are replaced by one image part per frame, and the items in
    prompt order with each video replaced by its frames. `items` follow the media parts."""
    remaining = iter(items)
    placed: list[MultiModalItem] = []
    rewritten = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            rewritten.append(dict(message))
            continue
        parts = []
        for part in content:
            if part["type"] == "text":
                parts.append(dict(part))
                continue
            item = next(remaining)
            frames = frame_items(item) if part["type"] == "video" else [item]
            placed.extend(frames)
            parts.extend(_image_part(frame) for frame in frames)
        rewritten.append({**message, "content": parts})
    return rewritten, placed


def _image_part(frame: MultiModalItem) -> dict[str, Any]:
    if frame.kind == "video" and frame.timestamps:
        return {"type": "image", "timestamp": frame.timestamps[0]}
    return {"type": "image"}
