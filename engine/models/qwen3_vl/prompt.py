"""How Qwen3-VL writes media into a prompt, as transformers' `Qwen3VLProcessor` does.

The chat template renders `<|vision_start|><|image_pad|><|vision_end|>` per image and
`<|vision_start|><|video_pad|><|vision_end|>` per video. An image keeps its one placeholder.
A video's placeholder becomes one block per tubelet, each behind its time as text:
`<{t:.1f} seconds><|vision_start|><|video_pad|><|vision_end|>`, t the mean of the times of the
tubelet's two sampled frames (the last frame of an odd count stands in for the missing one, as
the processor pads it). Each tubelet is placed as its own one-tubelet video item, which is also
how transformers' `get_rope_index` splits the video grid. A live stream writes its tubelets
the same way after the video's begin marker, each its own item, and a narration writes the same
`<t seconds>` before each tubelet, so what a stream holds is what the processor writes for the
frames it has had.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from stillcut.engine.model_config import CheckpointError
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.prompt_formats import MarkerTexts, PromptFormat, frame_items

TIMESTAMP = "<{t:.1f} seconds>"


def tubelet_times(video: MultiModalItem, frames_per_tubelet: int) -> list[float]:
    """Each tubelet's time in seconds: the mean of its first and last frame's sampled time
    (`video.timestamps`; without them, tubelet k starts at k * `second_per_grid_ts`)."""
    num_tubelets = video.grid_thw[0]
    times = list(video.timestamps)
    if not times:
        return [k * video.second_per_grid_ts for k in range(num_tubelets)]
    times += [times[-1]] * (num_tubelets * frames_per_tubelet - len(times))
    return [
        (times[k * frames_per_tubelet] + times[(k + 1) * frames_per_tubelet - 1]) / 2
        for k in range(num_tubelets)
    ]


@dataclass(frozen=True)
class TimestampedTubeletFormat(PromptFormat):
    """Images as rendered; each video as its tubelets, each behind `<t seconds>`."""

    frames_per_tubelet: int = 2
    separate_tubelets: ClassVar[bool] = True

    def stream_tubelet(
        self, tubelet: MultiModalItem, markers: MarkerTexts | None
    ) -> tuple[str, str]:
        """`<t seconds><|vision_start|>` before the tubelet's placeholders, the end marker
        after: the block the processor writes for it in the whole clip."""
        if markers is None or None in (markers.begin, markers.end):
            raise CheckpointError("the tokenizer lacks the vision markers")
        return TIMESTAMP.format(t=self.tubelet_time(tubelet)) + markers.begin, markers.end

    def tubelet_time(self, tubelet: MultiModalItem) -> float:
        """The mean of the tubelet's first and last sampled frame times (one frame: its own)."""
        return tubelet_times(tubelet, self.frames_per_tubelet)[0]

    def expand(
        self, text: str, items: Sequence[MultiModalItem], markers: MarkerTexts | None
    ) -> tuple[str, list[MultiModalItem]]:
        """Each rendered placeholder, in order, written out for the next item."""
        if markers is None or None in (markers.video, markers.begin, markers.end):
            raise CheckpointError("the tokenizer lacks the vision markers or the video token")
        kinds = {markers.placeholder: "image", markers.video: "video"}
        pattern = re.compile("|".join(re.escape(marker) for marker in kinds))
        block = f"{markers.begin}{markers.video}{markers.end}"
        pieces, placed, remaining, last = [], [], list(items), 0
        for match in pattern.finditer(text):
            kind = kinds[match.group()]
            if not remaining or remaining[0].kind != kind:
                raise CheckpointError(
                    f"the chat template rendered a {kind} placeholder where the media parts "
                    f"hold {remaining[0].kind if remaining else 'nothing'}"
                )
            item = remaining.pop(0)
            pieces.append(text[last : match.start()])
            if kind == "image":
                pieces.append(match.group())
                placed.append(item)
            else:
                times = tubelet_times(item, self.frames_per_tubelet)
                pieces.append("".join(TIMESTAMP.format(t=t) + block for t in times))
                placed.extend(frame_items(item, self.frames_per_tubelet))
            last = match.end()
        if remaining:
            raise CheckpointError(
                f"the chat template rendered placeholders for {len(items) - len(remaining)} of "
                f"{len(items)} media parts"
            )
        return "".join(pieces) + text[last:], placed
