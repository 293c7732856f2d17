"""How a family writes media into a rendered prompt, and videos written as image items.

The chat template renders one marker per media part. A `PromptFormat` then turns each marker
into the family's placeholder text with exactly one placeholder token per item; the processor
tokenizes that and repeats each placeholder token to its item's kept-token count. Placeholder
tokens are special, so BPE never merges across them and expanding after tokenizing gives the
ids that tokenizing the fully expanded text would.

- `PromptFormat` itself leaves the text as rendered: the template already writes one
  placeholder token per part (Qwen's `<|vision_start|><|video_pad|><|vision_end|>`).
- `ImageSequenceFormat` replaces each begin marker the template renders by
  `before + begin + placeholder + end + after` (Gemma 3's `\n\n<start_of_image>` + soft
  tokens + `<end_of_image>\n\n`, as transformers' processor expands it; the newlines may merge
  with the text around them, which tokenizing after expanding honours).

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
from typing import Any

import torch

from stillcut.engine.model_config import CheckpointError
from stillcut.engine.multimodal import MultiModalItem


@dataclass(frozen=True)
class MarkerTexts:
    """The token texts of a checkpoint's vision markers: begin, image placeholder, end."""

    begin: str
    placeholder: str
    end: str

    def __post_init__(self) -> None:
        for name in ("begin", "placeholder", "end"):
            if not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty token text")


@dataclass(frozen=True)
class PromptFormat:
    """The template writes one placeholder token per media part; nothing to expand."""

    def expand(self, text: str, num_images: int, markers: MarkerTexts) -> str:
        """`text` as rendered, with each image written around one placeholder token."""
        return text


@dataclass(frozen=True)
class ImageSequenceFormat(PromptFormat):
    """Each rendered begin marker becomes `before + begin + placeholder + end + after`."""

    before: str = ""
    after: str = ""

    def expand(self, text: str, num_images: int, markers: MarkerTexts) -> str:
        """The template must have rendered one begin marker per image."""
        num_markers = text.count(markers.begin)
        if num_markers != num_images:
            raise CheckpointError(
                f"the chat template rendered {num_markers} {markers.begin} markers for "
                f"{num_images} images and frames; it must render one per image part"
            )
        sequence = f"{self.before}{markers.begin}{markers.placeholder}{markers.end}{self.after}"
        return text.replace(markers.begin, sequence)


def frame_items(video: MultiModalItem) -> list[MultiModalItem]:
    """A video item split into one item per frame, each with the frame's kept tokens.

    Coordinates restart at t = 0 in each frame's `(1, h, w)` grid; identifiers add the frame
    index to the video's, so the prefix cache tells frames apart. Frames keep kind "video", so
    the engine's metrics count their tokens as video tokens.
    """
    num_frames, _, _ = video.grid_thw
    counts = torch.bincount(video.coords[:, 0].cpu(), minlength=num_frames)  # [num_frames]
    assert counts.numel() == num_frames, "coords outside the video's frames"
    bounds = [0, *counts.cumsum(0).tolist()]
    frames = []
    for frame in range(num_frames):
        rows = slice(bounds[frame], bounds[frame + 1])
        coords = video.coords[rows].clone()  # [kept in frame, 3]
        coords[:, 0] = 0
        frames.append(
            replace(
                video,
                embeds=video.embeds[rows],
                coords=coords,
                grid_thw=(1, *video.grid_thw[1:]),
                timestamps=video.timestamps[frame : frame + 1],
                identifier=f"{video.identifier}#{frame}",
                kept_per_tubelet=(rows.stop - rows.start,),
                stats={},
            )
        )
    return frames


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
