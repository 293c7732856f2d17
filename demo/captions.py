"""Chunk captions and summaries of the demo task: the true answers to `chunk_prompts`.

A long video of the task is a sequence of scenes, one after another (a hard cut between two).
A chunk of it covers part of one scene or the end of one and the start of the next; its
caption says what happens in each part, in order, joined by "; then ": the subject appears,
disappears or moves (as a description says it) as seen at the chunk's sampled frames, or,
when nothing happens there, which objects stand still ("nothing is shown" on empty ground).
The summary of a list of captions is their clauses in order, a clause that repeats the one
before it dropped. Captions are scored clause by clause, by keywords like the answers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stillcut.demo.narration import NARRATION_FPS, change_between
from stillcut.demo.questions import (
    DIRECTION_PHRASES,
    DIRECTIONS,
    EVENTS,
    capitalised,
    keywords_match,
    listed,
    named,
)
from stillcut.demo.scenes import COLOURS, SHAPES, Scene, listing_order

THEN = "; then "
CHUNK_SECONDS = (2, 3, 4)  # a chunk's length, whole seconds: whole tubelets at 2 fps
_STATES = ("still", "nothing")


@dataclass(frozen=True)
class ScenePart:
    """The part of `scene` from `start_s` to `end_s` (scene time) that a chunk covers."""

    scene: Scene
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.start_s < self.end_s <= self.scene.duration_s:
            raise ValueError(
                f"start_s={self.start_s}, end_s={self.end_s}: need "
                f"0 <= start_s < end_s <= {self.scene.duration_s}"
            )

    def frame_times(self, fps: float = NARRATION_FPS) -> list[float]:
        """The scene times of the part's frames sampled at `fps`."""
        first, stop = round(self.start_s * fps), round(self.end_s * fps)
        return [k / fps for k in range(first, stop)]


def draw_chunk(rng: np.random.Generator, duration_s: float) -> tuple[float, float]:
    """A chunk of 2-4 whole seconds in two scenes of `duration_s` played back to back, as
    (start_s, end_s) from the first scene's start: half inside the first scene, half across
    the cut with at least a second of each."""
    length, first_end = int(rng.choice(CHUNK_SECONDS)), int(duration_s)
    if rng.random() < 0.5:
        start = int(rng.integers(first_end - length + 1, first_end))
    else:
        start = int(rng.integers(0, first_end - length + 1))
    return float(start), float(start + length)


def chunk_parts(first: Scene, second: Scene, start_s: float, end_s: float) -> list[ScenePart]:
    """The parts of the chunk from `start_s` to `end_s` of `first` played before `second`."""
    cut = first.duration_s
    parts = [ScenePart(first, start_s, min(end_s, cut))] if start_s < cut else []
    if end_s > cut:
        parts.append(ScenePart(second, max(start_s, cut) - cut, end_s - cut))
    return parts


def clause(part: ScenePart) -> str:
    """What happens in `part`, lower case, without a full stop."""
    scene, times = part.scene, part.frame_times()
    change = change_between(scene, times)
    subject = scene.subject_object
    if change == "nothing":
        shown = listing_order(o for o in scene.objects if o.shown(times[0]))
        if not shown:
            return "nothing is shown"
        verb = "stands" if len(shown) == 1 else "stand"
        return f"{listed([named(o, 'a') for o in shown])} {verb} still"
    moves = scene.motion != "none" and sum(subject.shown(t) for t in times) >= 2
    motion = f"moves {DIRECTION_PHRASES[scene.motion]}" if moves else ""
    if change == "appears":
        return f"{named(subject, 'a')} appears" + (f" and {motion}" if motion else "")
    if change == "leaves":
        return f"{named(subject, 'a')} " + (f"{motion} and disappears" if motion else "disappears")
    return f"{named(subject, 'a')} {motion}"


def chunk_caption(parts: Sequence[ScenePart]) -> str:
    """The true caption of a chunk made of `parts` (one per scene it covers, in order)."""
    return capitalised(THEN.join(clause(part) for part in parts)) + "."


def summary(captions: Sequence[str]) -> str:
    """The true summary of timed captions' texts: their clauses in order, each clause that
    repeats the one before it dropped."""
    clauses: list[str] = []
    for caption in captions:
        for piece in caption.strip().rstrip(".").split(THEN):
            piece = piece[:1].lower() + piece[1:]
            if not clauses or clauses[-1] != piece:
                clauses.append(piece)
    return capitalised(THEN.join(clauses)) + "."


def caption_is_correct(parts: Sequence[ScenePart], text: str) -> bool:
    """Whether `text` captions the chunk: one clause per part, in order ("then" between), each
    holding the part's keywords (what happens, to which colour and shape) and no others."""
    pieces = text.lower().split("then")
    return len(pieces) == len(parts) and all(
        keywords_match(piece, _clause_keywords(part), _KINDS)
        for piece, part in zip(pieces, parts, strict=True)
    )


_KINDS = [tuple(COLOURS), SHAPES, DIRECTIONS, EVENTS, _STATES]


def _clause_keywords(part: ScenePart) -> set[str]:
    """The words a right clause about `part` holds: those of its true clause that name a
    colour, a shape, a direction, an event or a state."""
    words = set(re.findall(r"[a-z]+", clause(part).lower()))  # "triangle," is "triangle"
    return words & {word for kind in _KINDS for word in kind}
