"""The prompts of a long-video summary: each chunk captioned, then the captions summarised.

A long video is cut into chunks of a few seconds. Each chunk is asked about on its own, its
start and end times first, then the chunk as a video, then the instruction
(`chunk_caption_messages`); its answer is a caption of what happens in it. The timed captions
then go into one text-only prompt (`aggregation_messages`) whose answer is a short summary. The
demo model is trained on exactly these prompts (change a string and it must be retrained); a
long-video summary sends them to any model, through that model's own chat template and prompt
format (`PromptProcessor.build`), so a real checkpoint gets the same instructions in its own
format. Times are seconds from the start of the whole video.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

CHUNK_TIMES = "From {start:.1f}s to {end:.1f}s:"
CHUNK_INSTRUCTION = "Caption what happens in this chunk."
AGGREGATION_INSTRUCTION = "Summarise the video from its timed captions:"
CAPTION_LINE = "[{start:.1f}-{end:.1f}s] {text}"


class TimedCaption(NamedTuple):
    """A chunk's caption and the chunk's start and end, seconds into the video."""

    start_s: float
    end_s: float
    text: str


def chunk_caption_messages(start_s: float, end_s: float) -> list[dict[str, Any]]:
    """The user turn that asks for the caption of the chunk from `start_s` to `end_s`; its
    one video part is the chunk."""
    _check_times(start_s, end_s)
    times = CHUNK_TIMES.format(start=start_s, end=end_s)
    parts = [
        {"type": "text", "text": times},
        {"type": "video"},
        {"type": "text", "text": CHUNK_INSTRUCTION},
    ]
    return [{"role": "user", "content": parts}]


def aggregation_messages(captions: Sequence[TimedCaption]) -> list[dict[str, Any]]:
    """The text-only user turn that asks for a short summary of `captions`, one line each in
    the order given."""
    if not captions:
        raise ValueError("captions must hold at least one caption")
    lines = [AGGREGATION_INSTRUCTION]
    for index, caption in enumerate(captions):
        _check_times(caption.start_s, caption.end_s)
        text = caption.text.strip()
        if not text or "\n" in text:
            raise ValueError(f"captions[{index}].text={caption.text!r}: must be one non-empty line")
        lines.append(CAPTION_LINE.format(start=caption.start_s, end=caption.end_s, text=text))
    return [{"role": "user", "content": "\n".join(lines)}]


def _check_times(start_s: float, end_s: float) -> None:
    if not (math.isfinite(start_s) and math.isfinite(end_s) and 0 <= start_s < end_s):
        raise ValueError(f"start_s={start_s!r}, end_s={end_s!r}: need 0 <= start_s < end_s")
