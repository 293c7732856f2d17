"""What each video token of a training clip shows: the targets of the trainer's auxiliary loss.

Besides the answers, the trainer asks the vision tower's output, through a linear head used
only in training, what each merged token covers in its tubelet: the colour and the shape of the
object that covers most of it (or none), how that object moves (left, right, up, down, still,
or no object there), and the clip's ground (flat or textured), which a description names: the
version 2 checkpoint, trained without this label, named the ground of 100 held-out clips at
chance (54 wrong). It also says which colour-shape pairs are present in the token at all
(every object covering a tenth of it): where two objects meet, one token shows both, and with
only the larger one named the tower was free to drop the other (descriptions left out a still
object four times as often when another stood near it). The answers alone are a few words per
clip, and from scratch they teach the tower slowly; this dense signal teaches it colour, shape
and motion features within a few hundred steps. The head is dropped afterwards: the
checkpoint is a plain Qwen2.5-VL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import numpy as np

from stillcut.demo.render import coverage
from stillcut.demo.scenes import COLOURS, MOTIONS, SHAPES, Ground, Scene

COLOUR_CLASSES = len(COLOURS) + 1  # the last class: no object
SHAPE_CLASSES = len(SHAPES) + 1
MOTION_CLASSES = len(MOTIONS) + 1  # left, right, up, down, still, no object
GROUNDS: tuple[Ground, ...] = get_args(Ground)
GROUND_CLASSES = len(GROUNDS)
PAIRS = len(COLOURS) * len(SHAPES)  # the colour-shape pairs an object can be
NUM_LABELS = 5  # colour, shape, motion, ground, the pairs present (a bit mask)
STILL, NO_MOTION = MOTIONS.index("none"), len(MOTIONS)
MIN_COVER = 0.3  # share of a token's footprint (over its tubelet) an object must cover
MIN_PRESENT = 0.1  # share an object must cover to count as present in the token
_COLOUR_INDEX = {name: index for index, name in enumerate(COLOURS)}


def token_labels(scene: Scene, times: Sequence[float], grid_hw: tuple[int, int]) -> np.ndarray:
    """[t, h, w, 5] int64 (colour, shape, motion, ground) class of every merged token, and
    which colour-shape pairs it shows (`present_pairs`), for frames sampled at `times` in
    2-frame tubelets (the last frame repeated to fill the last one)."""
    times = list(times) + list(times[-1:]) * (len(times) % 2)
    rows = np.linspace(0, scene.height, grid_hw[0] + 1).round().astype(int)
    cols = np.linspace(0, scene.width, grid_hw[1] + 1).round().astype(int)
    tubelets = []
    for first in range(0, len(times), 2):
        owner = [_owner_map(scene, t) for t in times[first : first + 2]]  # 2 x [H, W]
        tubelets.append(_block_labels(scene, np.stack(owner), rows, cols))
    objects = np.stack(tubelets)  # [t, h, w, 4]
    ground = np.full((*objects.shape[:-1], 1), GROUNDS.index(scene.ground), np.int64)
    return np.concatenate([objects[..., :3], ground, objects[..., 3:]], axis=-1)


def pair_index(colour: str, shape: str) -> int:
    """The bit of a colour-shape pair in the present-pairs mask."""
    return class_pair(_COLOUR_INDEX[colour], SHAPES.index(shape))


def class_pair(colour, shape):
    """`pair_index` of colour and shape classes (ints or arrays); a "none" class lands past
    every pair."""
    return colour * len(SHAPES) + shape


def present_pairs(masks: np.ndarray) -> np.ndarray:
    """[..., PAIRS] 0/1 float32: the bits of present-pair masks (`token_labels`' last column)."""
    return ((masks[..., None] >> np.arange(PAIRS)) & 1).astype(np.float32)


LOOKBACK_CLASSES = (COLOUR_CLASSES, SHAPE_CLASSES, 2, 6, 2)  # colour, shape, cut, change, part
# the fourth target's classes; "vanished": the object that left is nowhere in the tubelet
# now; "appeared": the object that arrived was nowhere in the tubelet before
PLACE_CHANGES = ("same", "arrived", "left", "replaced", "vanished", "appeared")
NO_TARGET = -100  # cross-entropy's ignored class


def lookback_targets(labels: np.ndarray, previous: np.ndarray | None = None) -> np.ndarray:
    """[t*h*w, 5] int64: what each merged token's place showed one tubelet earlier, the
    language model's auxiliary targets in training (`train.TrainConfig.lookback_layer`): that
    tubelet's colour and shape class there (`labels` [t, h, w, 5]); 1 (the same scene), or 0
    for a first tubelet after a cut from `previous` ([h, w, 5], the other scene's last
    tubelet's labels); how the place changed since (`PLACE_CHANGES`: the same object or
    none, an object arrived, an object left, one object replaced by another, and an object
    that left and shows nowhere in the tubelet (vanished) or arrived and showed nowhere in
    the one before (appeared)); and which scene of a chunk the token is in, 1 after a cut
    from `previous` and 0 without one (every tubelet has this last one). With no `previous`
    the first tubelet has none of the others (`NO_TARGET`); after a cut it has only the cut:
    what the other scene showed there is no part of what a caption says of the new one.

    Saying what left a place ("the red circle leaves"), that nothing left anywhere (a still
    scene, not a departure) and where one scene cuts to the next all take this look back
    across tubelets, which the tower cannot make (it sees one tubelet at a time): the answers
    alone taught it slowly (the task version 3 model named 69 % of departures right and 98.9 %
    of appearances, and called still scenes departures)."""
    before = labels[:-1] if previous is None else np.concatenate([previous[None], labels[:-1]])
    after = labels[1:] if previous is None else labels
    none = COLOUR_CLASSES - 1
    was, now = before[..., 0] != none, after[..., 0] != none
    change = np.where(
        was & now,
        np.where(before[..., 0] == after[..., 0], 0, 3),
        np.where(now, 1, np.where(was, 2, 0)),
    )
    # an object that left a place and shows nowhere in the tubelet now has vanished; one
    # that arrived and showed nowhere in the tubelet before has appeared
    gone = ~_shows(before[..., :2], after[..., 4])
    new = ~_shows(after[..., :2], before[..., 4])
    change = np.where((change == 2) & gone, 4, np.where((change == 1) & new, 5, change))
    targets = np.full((*labels.shape[:-1], 5), NO_TARGET, np.int64)
    first = 1 if previous is None else 0
    targets[first:, ..., :2] = before[..., :2]
    targets[first:, ..., 2] = 1
    targets[first:, ..., 3] = change
    if previous is not None:
        targets[0, ..., 2] = 0
        targets[0, ..., [0, 1, 3]] = NO_TARGET
    targets[..., 4] = previous is not None
    return targets.reshape(-1, 5)


def _shows(objects: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """[t, h, w] bool: whether the object (colour and shape class, `objects` [t, h, w, 2])
    shows anywhere in the same tubelet of the present-pairs `masks` [t, h, w]."""
    shown = np.bitwise_or.reduce(masks.reshape(len(masks), -1), axis=1)[:, None, None]
    return ((shown >> class_pair(objects[..., 0], objects[..., 1])) & 1) == 1


def mirrored_labels(labels: np.ndarray) -> np.ndarray:
    """The labels of the mirrored clip: columns reversed, left and right swapped."""
    flipped = labels[:, :, ::-1].copy()
    motion = flipped[..., 2]
    left, right = MOTIONS.index("left"), MOTIONS.index("right")
    flipped[..., 2] = np.where(motion == left, right, np.where(motion == right, left, motion))
    return flipped


def _owner_map(scene: Scene, t: float) -> np.ndarray:
    """[H, W] int8: the index of the object covering each pixel at `t`, -1 for none."""
    owner = np.full((scene.height, scene.width), -1, np.int8)
    for index, obj in enumerate(scene.objects):
        if obj.shown(t):
            rows, cols, mask = coverage(obj, t, scene.height, scene.width)
            owner[rows, cols][mask] = index
    return owner


def _block_labels(scene: Scene, owner: np.ndarray, rows: np.ndarray, cols: np.ndarray):
    """[h, w, 4] labels of one tubelet from its frames' owner maps [2, H, W]: the covering
    object's colour, shape and motion, and the mask of every pair present."""
    labels = np.empty((len(rows) - 1, len(cols) - 1, 4), np.int64)
    bits = [1 << pair_index(o.colour, o.shape) for o in scene.objects]
    for h in range(len(rows) - 1):
        for w in range(len(cols) - 1):
            block = owner[:, rows[h] : rows[h + 1], cols[w] : cols[w + 1]]
            shares = np.bincount(block.ravel() + 1, minlength=len(scene.objects) + 1)[1:]
            shares = shares / block.size
            mask = 0
            for bit, share in zip(bits, shares, strict=True):
                if share >= MIN_PRESENT:
                    mask |= bit
            labels[h, w] = (*_object_labels(scene, shares), mask)
    return labels


def _object_labels(scene: Scene, shares: np.ndarray) -> tuple[int, int, int]:
    if shares.size == 0 or shares.max() < MIN_COVER:
        return len(COLOURS), len(SHAPES), NO_MOTION
    index = int(shares.argmax())
    obj = scene.objects[index]
    moves = index == scene.subject and scene.motion != "none"
    motion = MOTIONS.index(scene.motion) if moves else STILL
    return _COLOUR_INDEX[obj.colour], SHAPES.index(obj.shape), motion
