"""Narration of the demo task: what changed in each tubelet, as one short segment.

A live narration (`stillcut narrate`, the WebSocket's narrate mode) samples at 2 fps and speaks
once per 2-frame tubelet that EVS keeps any token of. Each segment says the one change the
tubelet shows, seen from the frame before it (the previous tubelet's last) to its own last
frame: the subject appears or leaves (its colour and shape), or it moves (colour, shape,
direction), or nothing changes ("Nothing changes.": short, since a static scene should cost
little). An appearance or a departure outranks motion in the same tubelet. Segments end with
the narration's default segment end, a newline, and are scored by keywords like the answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from stillcut.demo.questions import (
    DIRECTION_PHRASES,
    DIRECTIONS,
    capitalised,
    keywords_match,
    named,
)
from stillcut.demo.scenes import COLOURS, SHAPES, Scene

Change = Literal["appears", "leaves", "moves", "nothing"]
CHANGES: tuple[Change, ...] = ("appears", "leaves", "moves", "nothing")
SEGMENT_END = "\n"  # NarrateOptions' default segment end
NARRATION_FPS = 2.0  # a narration's default sampling rate (NarrateOptions.fps)
FRAMES_PER_TUBELET = 2


def change_between(scene: Scene, times: Sequence[float]) -> Change:
    """What the subject does over frames sampled at `times` (in order): shown at the last
    but not the first (appears), the reverse (leaves), else moving while shown in two of them
    (moves), else nothing."""
    subject = scene.subject_object
    if subject is None:
        return "nothing"
    shown = [subject.shown(t) for t in times]
    if shown[-1] and not shown[0]:
        return "appears"
    if shown[0] and not shown[-1]:
        return "leaves"
    if scene.motion != "none" and sum(shown) >= 2:
        return "moves"
    return "nothing"


def tubelet_times(index: int, fps: float = NARRATION_FPS) -> tuple[float, ...]:
    """The frame before tubelet `index` (none for the first) and the tubelet's frames."""
    first = FRAMES_PER_TUBELET * index
    frames = range(max(0, first - 1), first + FRAMES_PER_TUBELET)
    return tuple(k / fps for k in frames)


def num_tubelets(scene: Scene, fps: float = NARRATION_FPS) -> int:
    """How many tubelets a narration of the scene's clip at `fps` has (the last frame of an
    odd count is padded into a tubelet)."""
    num_frames = round(scene.duration_s * fps)
    return -(-num_frames // FRAMES_PER_TUBELET)


def tubelet_change(scene: Scene, index: int, fps: float = NARRATION_FPS) -> Change:
    """The change tubelet `index` of the scene's narration shows."""
    return change_between(scene, tubelet_times(index, fps))


def segment(scene: Scene, index: int, fps: float = NARRATION_FPS) -> str:
    """The true segment about tubelet `index`, its segment end included."""
    change = tubelet_change(scene, index, fps)
    subject = scene.subject_object
    if change == "appears":
        text = f"{named(subject, 'a')} appears."
    elif change == "leaves":
        text = f"{named(subject, 'the')} leaves."
    elif change == "moves":
        text = f"{named(subject, 'the')} moves {DIRECTION_PHRASES[scene.motion]}."
    else:
        text = "nothing changes."
    return capitalised(text) + SEGMENT_END


def segment_is_correct(scene: Scene, index: int, text: str, fps: float = NARRATION_FPS) -> bool:
    """Whether `text` names tubelet `index`'s true change and no other: its change word (and
    the subject's colour and shape, and for motion its direction), no other change word,
    colour, shape or direction."""
    change = tubelet_change(scene, index, fps)
    required = {change}
    if change != "nothing":
        required |= {scene.subject_object.colour, scene.subject_object.shape}
    if change == "moves":
        required.add(scene.motion)
    return keywords_match(text, required, [CHANGES, tuple(COLOURS), SHAPES, DIRECTIONS])
