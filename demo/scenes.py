"""The demo task's scenes: up to three coloured shapes, one of which may move or change.

A scene is one 6 s, 320x240 clip. Its objects have distinct colours and distinct shapes. At
most one of them, the subject, does something: it moves left, right, up or down, and it may
appear or disappear part-way through; the others stand still the whole time. A still scene has
no subject at all: nothing changes. `sample_scene(seed)` draws every choice from the seed, so a
seed names a scene; the training set and the held-out set are disjoint seed ranges. A
`SceneMix` sets how often each kind of scene is drawn: narration's mix (`NARRATION_MIX`) draws
appearances and departures far more often, so that every kind of change is common among its
segments.

Objects never overlap, not even along the subject's path, so every object is fully visible
whenever it is shown. Grounds are muted (a flat colour or a noise texture) and objects
saturated, so no colour is hidden in the background.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

RGB = tuple[int, int, int]
COLOURS: dict[str, RGB] = {
    "red": (220, 40, 40),
    "orange": (245, 140, 25),
    "yellow": (235, 215, 40),
    "green": (40, 170, 70),
    "blue": (45, 95, 225),
    "purple": (145, 65, 200),
}
SHAPES = ("circle", "square", "triangle", "cross")
Motion = Literal["left", "right", "up", "down", "none"]
MOTIONS: tuple[Motion, ...] = ("left", "right", "up", "down", "none")
Event = Literal["none", "appears", "disappears"]
Ground = Literal["flat", "textured"]

WIDTH, HEIGHT = 320, 240
FPS = 8
DURATION_S = 6.0
MAX_OBJECTS = 3
_MARGIN = 6  # px between an object and the frame edge, and between two objects
_SIZE_RANGE = (28.0, 36.0)  # half the object's extent, px: 3-4 patches across at the model's size
_TRAVEL = {"horizontal": (150.0, 230.0), "vertical": (100.0, 150.0)}  # px over the clip
_APPEAR_RANGE_S, _DISAPPEAR_RANGE_S = (1.5, 4.0), (2.0, 4.5)
_COLOUR_JITTER = 12  # per channel, so a colour is a range, not one exact value


@dataclass(frozen=True)
class SceneMix:
    """How often each kind of scene is drawn (`moving`, `changing`: the subject only appears
    or disappears, `still`: nothing changes), how often a moving subject also appears or
    disappears (`moving_event`), and whether the time of an appearance or a departure is
    rounded to a whole multiple of `event_step_s` seconds (None: it is not)."""

    moving: float = 0.7
    changing: float = 0.15
    still: float = 0.15
    moving_event: float = 0.3
    event_step_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("moving", "changing", "still", "moving_event"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: allowed [0, 1]")
        if abs(self.moving + self.changing + self.still - 1.0) > 1e-9:
            raise ValueError(
                f"moving + changing + still = {self.moving + self.changing + self.still}: must be 1"
            )
        if self.event_step_s is not None and not 0 < self.event_step_s <= 1.0:
            raise ValueError(f"event_step_s={self.event_step_s}: allowed None or (0, 1]")


# Narration's segments: a moving subject gives a "moves" segment every tubelet, an appearance
# or a departure one segment per scene, so those scenes are drawn far more often. Their times
# fall on tubelet boundaries (1 s at 2 fps): a change part-way through a tubelet makes EVS keep
# the next one too, whose "Nothing changes." would crowd out the changes.
NARRATION_MIX = SceneMix(moving=0.3, changing=0.6, still=0.1, moving_event=1.0, event_step_s=1.0)


@dataclass(frozen=True)
class SceneObject:
    """One shape: where its centre is at t = 0 s, how fast it moves, when it is shown."""

    colour: str
    shape: str
    rgb: RGB
    size: float  # half of its extent, px
    x: float
    y: float
    vx: float = 0.0  # px / s
    vy: float = 0.0
    shown_from: float = 0.0  # s
    shown_until: float = math.inf

    def __post_init__(self) -> None:
        if self.colour not in COLOURS:
            raise ValueError(f"colour={self.colour!r}: allowed {tuple(COLOURS)}")
        if self.shape not in SHAPES:
            raise ValueError(f"shape={self.shape!r}: allowed {SHAPES}")
        if not self.size > 0 or not self.shown_from < self.shown_until:
            raise ValueError(f"size={self.size} must be > 0 and shown_from < shown_until")

    def centre(self, t: float) -> tuple[float, float]:
        """(x, y) of the centre at time `t` s."""
        return self.x + self.vx * t, self.y + self.vy * t

    def shown(self, t: float) -> bool:
        return self.shown_from <= t < self.shown_until


@dataclass(frozen=True)
class Scene:
    """One clip of the task. `subject` indexes `objects` (None: a still scene)."""

    seed: int
    objects: tuple[SceneObject, ...]
    subject: int | None
    motion: Motion
    event: Event
    ground: Ground
    ground_low: RGB  # flat grounds use `ground_low` alone
    ground_high: RGB
    noise_sigma: float  # camera noise, levels
    crf: int  # H.264 quality
    width: int = WIDTH
    height: int = HEIGHT
    fps: int = FPS
    duration_s: float = DURATION_S

    def __post_init__(self) -> None:
        if not 1 <= len(self.objects) <= MAX_OBJECTS:
            raise ValueError(f"{len(self.objects)} objects: allowed 1..{MAX_OBJECTS}")
        if (self.subject is None) != (self.motion == "none" and self.event == "none"):
            raise ValueError("a scene has a subject exactly when something moves or changes")

    @property
    def num_frames(self) -> int:
        return round(self.fps * self.duration_s)

    @property
    def subject_object(self) -> SceneObject | None:
        return None if self.subject is None else self.objects[self.subject]

    @property
    def bystanders(self) -> tuple[SceneObject, ...]:
        """The objects that stand still the whole clip, in listing order (`listing_order`)."""
        return listing_order(o for i, o in enumerate(self.objects) if i != self.subject)


def listing_order(objects: Iterable[SceneObject]) -> tuple[SceneObject, ...]:
    """`objects` in the order answers list them: by colour, in `COLOURS`' order (red first).
    A fixed order of what each object is, not of where it stands: the next object to name is
    the first colour in the order that is in the scene and not yet named, which a small model
    reads off far more reliably than "the next one to the right of the last"."""
    rank = {colour: index for index, colour in enumerate(COLOURS)}
    return tuple(sorted(objects, key=lambda o: rank[o.colour]))


def sample_scene(seed: int, fps: int = FPS, mix: SceneMix = SceneMix()) -> Scene:
    """The scene that `seed` names in `mix`: kind, objects, path, timing, ground, noise and
    quality. `fps` changes only how densely the same motion is filmed."""
    rng = np.random.default_rng(seed)
    kinds = {"moving": mix.moving, "changing": mix.changing, "still": mix.still}
    kind = str(rng.choice(list(kinds), p=list(kinds.values())))
    num_objects = int(rng.integers(1, MAX_OBJECTS + 1))
    colours = rng.choice(list(COLOURS), num_objects, replace=False)
    shapes = rng.choice(SHAPES, num_objects, replace=False)
    motion: Motion = "none" if kind != "moving" else str(rng.choice(MOTIONS[:4]))
    event: Event = "none"
    if kind == "changing" or (kind == "moving" and rng.random() < mix.moving_event):
        event = str(rng.choice(["appears", "disappears"]))
    objects = _place_objects(rng, colours, shapes, motion, event, mix.event_step_s)
    ground: Ground = str(rng.choice(["flat", "textured"]))
    low, high = _muted(rng, 40, 130), _muted(rng, 120, 210)
    return Scene(
        seed=seed,
        objects=objects,
        subject=None if kind == "still" else 0,
        motion=motion,
        event=event,
        ground=ground,
        ground_low=low if ground == "textured" else _muted(rng, 45, 205),
        ground_high=high,
        noise_sigma=float(rng.uniform(1.0, 3.0)),
        crf=int(rng.integers(20, 31)),
        fps=fps,
    )


def mirrored(scene: Scene) -> Scene:
    """The scene seen in a mirror (left and right swapped). Every shape is symmetric about
    its vertical axis, so the mirrored scene's frames are the original's flipped."""
    objects = tuple(replace(o, x=scene.width - o.x, vx=-o.vx) for o in scene.objects)
    swap = {"left": "right", "right": "left"}
    return replace(scene, objects=objects, motion=swap.get(scene.motion, scene.motion))


def _place_objects(
    rng, colours, shapes, motion: Motion, event: Event, event_step_s: float | None
) -> tuple[SceneObject, ...]:
    """The subject (first) on a path inside the frame, then bystanders clear of its path."""
    objects: list[SceneObject] = []
    boxes: list[tuple[float, float, float, float]] = []  # (x0, y0, x1, y1) ever covered
    for index, (colour, shape) in enumerate(zip(colours, shapes, strict=True)):
        for _ in range(100):
            candidate = _draw_object(rng, str(colour), str(shape), motion if index == 0 else "none")
            box = _swept_box(candidate)
            if not any(_overlap(box, other) for other in boxes):
                break
        else:  # no room left: the scene keeps the objects placed so far
            if index == 0:
                raise AssertionError("the subject always fits in an empty frame")
            break
        if index == 0 and event != "none":
            candidate = _with_event(rng, candidate, event, event_step_s)
        objects.append(candidate)
        boxes.append(box)
    return tuple(objects)


def _draw_object(rng, colour: str, shape: str, motion: Motion) -> SceneObject:
    size = float(rng.uniform(*_SIZE_RANGE))
    reach = size + _MARGIN  # the centre stays this far inside the frame
    vx = vy = 0.0
    travel_x = travel_y = 0.0
    if motion in ("left", "right"):
        travel_x = float(rng.uniform(*_TRAVEL["horizontal"]))
        vx = travel_x / DURATION_S * (1 if motion == "right" else -1)
    elif motion in ("up", "down"):
        travel_y = float(rng.uniform(*_TRAVEL["vertical"]))
        vy = travel_y / DURATION_S * (1 if motion == "down" else -1)
    # Choose where the path's low end lies, then start from whichever end the motion begins at.
    low_x = rng.uniform(reach, WIDTH - reach - travel_x)
    low_y = rng.uniform(reach, HEIGHT - reach - travel_y)
    x = low_x + (travel_x if vx < 0 else 0.0)
    y = low_y + (travel_y if vy < 0 else 0.0)
    jitter = rng.integers(-_COLOUR_JITTER, _COLOUR_JITTER + 1, 3)
    rgb = tuple(int(c) for c in np.clip(np.asarray(COLOURS[colour]) + jitter, 0, 255))
    return SceneObject(colour, shape, rgb, size, float(x), float(y), vx, vy)


def _with_event(rng, subject: SceneObject, event: Event, step_s: float | None) -> SceneObject:
    low, high = _APPEAR_RANGE_S if event == "appears" else _DISAPPEAR_RANGE_S
    at = float(rng.uniform(low, high))
    if step_s is not None:  # the nearest whole step inside the range
        at = min(max(round(at / step_s) * step_s, math.ceil(low / step_s) * step_s), high)
    if event == "appears":
        return replace(subject, shown_from=at)
    return replace(subject, shown_until=at)


def _swept_box(obj: SceneObject) -> tuple[float, float, float, float]:
    """The box the object covers at some time in the clip, grown by the margin."""
    (x0, y0), (x1, y1) = obj.centre(0.0), obj.centre(DURATION_S)
    grow = obj.size + _MARGIN / 2
    return min(x0, x1) - grow, min(y0, y1) - grow, max(x0, x1) + grow, max(y0, y1) + grow


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _muted(rng, low: int, high: int) -> RGB:
    """A greyish colour: a level in [low, high] with a small tint per channel."""
    level = rng.uniform(low, high)
    tint = rng.uniform(-18, 18, 3)
    return tuple(int(v) for v in np.clip(np.rint(level + tint), 0, 255))
