"""Draw a scene's frames: a muted ground, solid shapes on it, then camera noise.

Everything comes from seeded numpy. Shapes have hard edges (the downscale to the model's input
size softens them, as a lens would); the noise is fresh in every frame (drawn from a small bank
of noise fields at random offsets, which costs a copy per frame instead of a normal draw) plus a
small flicker of the whole frame's brightness.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from stillcut.demo.scenes import Scene, SceneObject

_NOISE_BANK = 3  # noise fields per clip
_FLICKER = 1.0  # levels, standard deviation of the per-frame brightness change
_BLOCKS = (3, 8)  # how many muted blocks a textured ground gets


def value_noise(rng: np.random.Generator, height: int, width: int, cell_px: float) -> np.ndarray:
    """Fractal value noise [height, width] in [0, 1]; coarsest features are `cell_px` wide."""
    out = np.zeros((height, width))
    octaves = 6  # down to features of cell_px / 32: fine detail inside every 14 px patch
    for octave in range(octaves):
        scale = 2**octave / cell_px
        grid = rng.random((int(height * scale) + 2, int(width * scale) + 2))
        y, x = np.arange(height) * scale, np.arange(width) * scale
        y0, x0 = y.astype(int), x.astype(int)
        # Smoothstep weights hide the grid's straight seams.
        fy = (y - y0) ** 2 * (3 - 2 * (y - y0))
        fx = (x - x0) ** 2 * (3 - 2 * (x - x0))
        top = grid[y0][:, x0] * (1 - fx) + grid[y0][:, x0 + 1] * fx  # [height, width]
        bottom = grid[y0 + 1][:, x0] * (1 - fx) + grid[y0 + 1][:, x0 + 1] * fx
        out += (top * (1 - fy[:, None]) + bottom * fy[:, None]) * 0.5**octave
    return out / (2 - 0.5 ** (octaves - 1))


def ground(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """The empty scene [H, W, 3] float32: a flat colour with a faint light falloff, or noise
    between two muted colours with a few muted blocks."""
    h, w = scene.height, scene.width
    low, high = np.asarray(scene.ground_low, np.float32), np.asarray(scene.ground_high, np.float32)
    if scene.ground == "flat":
        falloff = np.linspace(6.0, -6.0, h, dtype=np.float32)[:, None, None]  # [H, 1, 1]
        return np.broadcast_to(low + falloff, (h, w, 3)).copy()
    noise = value_noise(rng, h, w, cell_px=float(rng.uniform(40, 90))).astype(np.float32)
    image = low + noise[..., None] * (high - low)  # [H, W, 3]
    for _ in range(int(rng.integers(*_BLOCKS))):
        y0, x0 = rng.integers(0, (h, w))
        size_y, size_x = rng.integers(10, 50, size=2)
        region = image[y0 : y0 + size_y, x0 : x0 + size_x]
        shade = low + rng.uniform(0, 1) * (high - low) + rng.uniform(-10, 10, 3)
        region[:] = 0.6 * region + 0.4 * shade.astype(np.float32)
    return image


def coverage(
    obj: SceneObject, t: float, height: int, width: int
) -> tuple[slice, slice, np.ndarray]:
    """Where the object is at `t`: the (rows, cols) slices of its bounding box in the frame
    and the bool mask of the pixels it covers inside that box."""
    cx, cy = obj.centre(t)
    r = obj.size
    rows = slice(max(0, int(cy - r) - 1), min(height, int(cy + r) + 2))
    cols = slice(max(0, int(cx - r) - 1), min(width, int(cx + r) + 2))
    y = np.arange(rows.start, rows.stop, dtype=np.float32)[:, None] + 0.5 - cy  # [h, 1]
    x = np.arange(cols.start, cols.stop, dtype=np.float32)[None, :] + 0.5 - cx  # [1, w]
    if obj.shape == "circle":
        mask = x**2 + y**2 <= r**2
    elif obj.shape == "square":
        mask = (np.abs(x) <= 0.85 * r) & (np.abs(y) <= 0.85 * r)  # about a circle's area
    elif obj.shape == "triangle":  # pointing up: apex at -r, base at +0.75 r
        mask = (y <= 0.75 * r) & (np.abs(x) <= (y + r) / 1.75)
    else:  # cross: two bars a third of the extent wide
        arm = r / 3
        mask = ((np.abs(x) <= arm) & (np.abs(y) <= r)) | ((np.abs(y) <= arm) & (np.abs(x) <= r))
    return rows, cols, mask


def paint(image: np.ndarray, obj: SceneObject, t: float) -> None:
    """Paint the object as it is at `t` into `image` [H, W, 3] in place."""
    rows, cols, mask = coverage(obj, t, *image.shape[:2])
    image[rows, cols][mask] = obj.rgb


def frames(scene: Scene) -> Iterator[np.ndarray]:
    """The clip's frames [H, W, 3] uint8, frame i at t = i / fps."""
    rng = np.random.default_rng([scene.seed, 1])  # apart from the stream that drew the scene
    empty = ground(scene, rng)
    shape = (scene.height, scene.width, 3)
    bank = rng.standard_normal((_NOISE_BANK, *shape), dtype=np.float32) * scene.noise_sigma
    for index in range(scene.num_frames):
        t = index / scene.fps
        image = empty.copy()
        for obj in scene.objects:
            if obj.shown(t):
                paint(image, obj, t)
        shift = rng.integers(0, (scene.height, scene.width))
        image += np.roll(bank[index % _NOISE_BANK], tuple(shift), axis=(0, 1))
        image += np.float32(rng.normal(0.0, _FLICKER))
        yield np.clip(np.rint(image), 0, 255).astype(np.uint8)
