"""How a long video is cut into chunks, and how long a chunk may be.

The video is sampled at one rate from the start of its range, and a chunk is a run of
consecutive samples: `frames` of them (an even number: every family's tubelet is one or two
frames, so a chunk is whole tubelets), the next chunk starting `stride` samples later (a
stride under the length overlaps them). The last chunk ends with the range. Each chunk is a
video of its own to the model (its positions start at zero, as in training), asked about
behind its start and end times, which count from the start of the whole video.

Without a length from the caller, a chunk is as long as fits: its video tokens (what EVS keeps
of them, at most) must leave room in the context for the caption prompt and the caption, and
fit the engine's visual-token limit and the request's `max_video_tokens`; and it is no longer
than the longest chunk the checkpoint says it was trained to caption (config.json
`stillcut_summary.chunk_s`), else `DEFAULT_MAX_CHUNK_S` (a caption is a line or two: a longer
chunk gets a caption that leaves most of it out).

EVS in rate mode keeps `max(h*w, int(t*h*w*(1 - q)))` tokens of a chunk, its first tubelet whole:
a chunk of a few tubelets keeps its first one and next to nothing of the rest (at rate 0.75, a
chunk of under 8 tubelets keeps less than one more tubelet's worth). A caption says what
happens in its chunk, so where the rate comes from a default rather than from the request, a
chunk it would prune that far is captioned whole (`chunk_evs`); a longer chunk is pruned as
asked. A rate the request names is applied as named.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stillcut.kernels.evs import EVSConfig
from stillcut.kernels.evs.config import num_retained_tokens

DEFAULT_MAX_CHUNK_S = 30.0
# A family that writes a video as its frames (images, each between its own markers) spends
# about this many tokens per frame besides the frame's own: counted against the context.
FRAME_MARKER_TOKENS = 8


class ChunkingError(ValueError):
    """Chunks that cannot be: too long for the context, too many, an overlap past the chunk.
    The message says what would do."""


@dataclass(frozen=True)
class Chunk:
    """One chunk: seconds from the start of the video, and its samples' indices."""

    index: int
    start_s: float
    end_s: float
    first_sample: int
    num_samples: int

    @property
    def stop_sample(self) -> int:
        return self.first_sample + self.num_samples


@dataclass(frozen=True)
class ChunkLimits:
    """What bounds a chunk: the tokens its video may take in the prompt (what EVS keeps, at
    most, plus `marker_tokens_per_frame` per frame), and the longest chunk the model captions
    well (seconds)."""

    max_video_tokens: int
    max_chunk_s: float
    marker_tokens_per_frame: int = 0

    def __post_init__(self) -> None:
        for name in ("max_video_tokens", "marker_tokens_per_frame"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{name}={value!r}: must be an integer >= 0")
        if not (math.isfinite(self.max_chunk_s) and self.max_chunk_s > 0):
            raise ValueError(f"max_chunk_s={self.max_chunk_s!r}: must be a finite number > 0")


def checkpoint_hints(raw_config: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's own summary settings (config.json `stillcut_summary`): `chunk_s`, the
    longest chunk it was trained to caption, and `captions_per_round`, the most captions it was
    trained to summarise in one prompt. Missing ones are left out."""
    hints = raw_config.get("stillcut_summary") or {}
    if not isinstance(hints, Mapping):
        raise ValueError("config.json's stillcut_summary must be an object")
    return {name: hints[name] for name in ("chunk_s", "captions_per_round") if name in hints}


def chunk_evs(
    evs: EVSConfig | None, grid: tuple[int, int, int], whole_short: bool
) -> EVSConfig | None:
    """The EVS setting of a chunk whose video tokens are a (t, h, w) `grid`: `evs`, or, with
    `whole_short`, None (whole) where a rate would keep less than its first tubelet and one
    more tubelet's worth."""
    if not whole_short or evs is None or evs.is_off or evs.mode != "rate":
        return evs
    per_tubelet = grid[1] * grid[2]
    if num_retained_tokens(grid[0], per_tubelet, evs.rate) < 2 * per_tubelet:
        return None
    return evs


def chunk_frames(
    chunk_s: float | None,
    fps: float,
    limits: ChunkLimits,
    kept_tokens_of: Callable[[int], int],
) -> int:
    """Samples per chunk: `chunk_s` seconds at `fps` rounded to whole tubelets (at least one),
    or, when None, the most that fit `limits`. `kept_tokens_of(n)` is the most video tokens a
    chunk of n frames keeps. Raises `ChunkingError`, naming what would fit, when no chunk does."""

    def tokens_of(num_frames: int) -> int:  # in the prompt, with the frames' markers
        return kept_tokens_of(num_frames) + limits.marker_tokens_per_frame * num_frames

    if tokens_of(2) > limits.max_video_tokens:
        raise ChunkingError(
            f"one tubelet of this video keeps up to {tokens_of(2)} tokens, but a chunk's prompt "
            f"leaves room for {limits.max_video_tokens}: lower the pixel budget or raise the "
            "context (max_model_len) or the token limits"
        )
    if chunk_s is not None:
        frames = max(2, 2 * math.floor(chunk_s * fps / 2 + 0.5))
        if tokens_of(frames) > limits.max_video_tokens:
            fitting = _most_frames(fps, chunk_s, limits.max_video_tokens, tokens_of)
            raise ChunkingError(
                f"chunk_s={chunk_s:g} keeps up to {tokens_of(frames)} video tokens per chunk, "
                f"over the {limits.max_video_tokens} a chunk's prompt has room for: at most "
                f"chunk_s={fitting / fps:g} fits"
            )
        return frames
    return _most_frames(fps, limits.max_chunk_s, limits.max_video_tokens, tokens_of)


def _most_frames(
    fps: float, max_chunk_s: float, max_tokens: int, tokens_of: Callable[[int], int]
) -> int:
    """The longest run of whole tubelets at `fps`, at most `max_chunk_s` long (at least one
    tubelet), keeping at most `max_tokens`."""
    # Longest first: a chunk kept whole below the length a rate starts at keeps more tokens
    # than a longer one it prunes, so the tokens need not grow with the length.
    longest = max(1, math.floor(max_chunk_s * fps / 2 + 1e-9))  # in 2-frame tubelets
    for tubelets in range(longest, 1, -1):
        if tokens_of(2 * tubelets) <= max_tokens:
            return 2 * tubelets
    return 2


def overlap_frames(overlap_s: float, fps: float, frames: int) -> int:
    """Samples two neighbouring chunks share: `overlap_s` at `fps`, rounded; under `frames`."""
    overlap = math.floor(overlap_s * fps + 0.5)
    if overlap >= frames:
        raise ChunkingError(
            f"overlap_s={overlap_s:g} is {overlap} frames at {fps:g} fps; a chunk has {frames}: "
            "the overlap must be shorter than the chunk"
        )
    return overlap


def plan_chunks(
    sample_times: Sequence[float],
    range_start: float,
    range_end: float,
    fps: float,
    frames: int,
    stride: int,
) -> list[Chunk]:
    """The chunks of a range sampled at `sample_times` (`range_start + k / fps`): `frames`
    samples each, one every `stride` samples; a chunk adds at least one sample to the one
    before it. A chunk's times are its first sample's time and that plus its length, the last
    one's clamped to the range's end."""
    assert frames >= 2 and 1 <= stride <= frames, (frames, stride)
    num_samples = len(sample_times)
    chunks: list[Chunk] = []
    first = 0
    while first < num_samples and (first == 0 or first - stride + frames < num_samples):
        count = min(frames, num_samples - first)
        start = range_start + first / fps
        end = min(range_start + (first + frames) / fps, range_end)
        chunks.append(Chunk(len(chunks), start, end, first, count))
        first += stride
    return chunks
