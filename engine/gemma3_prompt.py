"""Gemma 3 prompts: every image, and every frame of a video, as its own image sequence.

Gemma 3's chat template renders an image part as `<start_of_image>`; transformers'
`Gemma3Processor` then replaces each one by `\\n\\n<start_of_image>` + the image's soft tokens +
`<end_of_image>\\n\\n` and tokenizes the whole text, so the newlines may merge with the text
around them. We expand to one soft token per image, tokenize, and only then repeat each soft
token to its item's kept-token count: the soft token is special, BPE never merges it, so the ids
equal those of tokenizing the fully expanded text. A video is its sampled frames: its part
becomes one image part per frame, carrying the frame's `timestamp` (seconds) for a template
that prints it (Gemma 3's own ignores it), and its item splits into one item per frame, each
its own bidirectional block. A frame EVS pruned away entirely keeps its start/end tokens and
becomes a 0-token item, so the positions after it stay those of the unpruned prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from stillcut.engine.model_config import CheckpointError
from stillcut.engine.multimodal import MultiModalItem


@dataclass(frozen=True)
class ImageSequence:
    """The texts of Gemma 3's image markers: begin (`<start_of_image>`), soft token, end."""

    begin: str
    soft_token: str
    end: str

    def __post_init__(self) -> None:
        for name in ("begin", "soft_token", "end"):
            if not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty token text")

    def expand(self, text: str, num_images: int) -> str:
        """Replace each `begin` marker of a rendered prompt by the image's whole sequence, with
        one soft token; the template must have rendered one marker per image."""
        num_markers = text.count(self.begin)
        if num_markers != num_images:
            raise CheckpointError(
                f"the chat template rendered {num_markers} {self.begin} markers for "
                f"{num_images} images and frames; it must render one per image part"
            )
        return text.replace(self.begin, f"\n\n{self.begin}{self.soft_token}{self.end}\n\n")


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
