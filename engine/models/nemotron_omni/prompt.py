"""How Nemotron 3 Nano Omni writes media into a prompt, as transformers' processor does.

The chat template renders `<image>` for an image part and `<video>` for a video part. An image
becomes `<img><image></img>`; a video becomes one chunk per tubelet, joined by newlines, each
labelled with the frames it packs: `Frame 1 sampled at 0.00 seconds and frame 2 sampled at
0.50 seconds: <img><image></img>`. A frame's time is its index in the source video times
`int(1000 / source fps)` milliseconds (so 30 fps counts 33 ms a frame), two decimals; without
a source frame rate the labels carry the frame numbers only. Videos use the image placeholder:
each tubelet is placed as its own item, holding its kept tokens (a tubelet EVS pruned away
entirely keeps its label and `<img></img>`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from stillcut.engine.model_config import CheckpointError
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.prompt_formats import MarkerTexts, PromptFormat, frame_items


@dataclass(frozen=True)
class TubeletChunkFormat(PromptFormat):
    """Images as `begin + placeholder + end`; videos as labelled chunks, one per tubelet."""

    begin: str = "<img>"
    end: str = "</img>"
    frames_per_tubelet: int = 2

    def expand(
        self, text: str, items: Sequence[MultiModalItem], markers: MarkerTexts | None
    ) -> tuple[str, list[MultiModalItem]]:
        """Each rendered `<image>` / `<video>`, in order, written out for the next item."""
        if markers is None or markers.video is None:
            raise CheckpointError("the tokenizer lacks the image or video placeholder token")
        kinds = {markers.placeholder: "image", markers.video: "video"}
        pattern = re.compile("|".join(re.escape(marker) for marker in kinds))
        chunk = f"{self.begin}{markers.placeholder}{self.end}"
        pieces, placed, remaining, last = [], [], list(items), 0
        for match in pattern.finditer(text):
            kind = kinds[match.group()]
            if not remaining or remaining[0].kind != kind:
                raise CheckpointError(
                    f"the chat template rendered a {kind} marker where the media parts hold "
                    f"{remaining[0].kind if remaining else 'nothing'}; it must render one "
                    f"{markers.placeholder} per image and one {markers.video} per video"
                )
            item = remaining.pop(0)
            pieces.append(text[last : match.start()])
            if kind == "image":
                pieces.append(chunk)
                placed.append(item)
            else:
                tubelets = frame_items(item, self.frames_per_tubelet)
                labels = [self.tubelet_label(item, index) for index in range(len(tubelets))]
                pieces.append("\n".join(label + chunk for label in labels))
                placed.extend(tubelets)
            last = match.end()
        if remaining:
            raise CheckpointError(
                f"the chat template rendered markers for {len(items) - len(remaining)} of "
                f"{len(items)} media parts"
            )
        return "".join(pieces) + text[last:], placed

    def tubelet_label(self, video: MultiModalItem, tubelet: int) -> str:
        """`Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.50 seconds: `."""
        num_frames = len(video.timestamps)
        parts = []
        for offset in range(self.frames_per_tubelet):
            frame = tubelet * self.frames_per_tubelet + offset
            if frame >= num_frames:
                break  # the last tubelet repeats its last frame: no label for the copy
            prefix = "Frame" if offset == 0 else "frame"
            parts.append(f"{prefix} {frame + 1}{_sampled_at(video, frame)}")
        return " and ".join(parts) + ": "


def _sampled_at(video: MultiModalItem, frame: int) -> str:
    if not video.source_fps:
        return ""
    if frame < len(video.source_indices):
        seconds = video.source_indices[frame] * int(1000.0 / video.source_fps) / 1000.0
    else:
        seconds = frame / video.source_fps
    return f" sampled at {seconds:.2f} seconds"
