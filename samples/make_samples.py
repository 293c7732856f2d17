"""Render the synthetic sample clips that tests, examples and benchmarks use.

Two kinds. The task samples are scenes of the demo model's synthetic task (coloured shapes that
move, appear or stand still; `stillcut.demo`): each is the first held-out
scene that fits its description, so it is one of the clips the accuracy bench scores and the
demo never trained on. The others each exercise one EVS behaviour (a pan, a scene cut, a long
near-static clip, known motion). Every frame is drawn from seeded numpy (no wall clock), then
encoded with libx264 on one thread with bit-exact muxing, so rerunning the script with the same
PyAV/FFmpeg build reproduces the files byte for byte. ``motion_mask.npz`` is the ground truth
for ``motion_mask.mp4``: which pixels of the pre-encoding frames changed since the previous
frame.

The web page shows what the demo model answers about each task sample; `sample_answers`
asks it (describe's default EVS) and main writes the page's copy,
``service/static/sample_answers.json``. Rerun after retraining the demo.

Usage: python samples/make_samples.py [--out samples] [--answers PATH | --no-answers]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stillcut.demo.clips import clip_bytes, encode_h264, held_out_seeds
from stillcut.demo.questions import PROMPTS, QUESTION_TYPES, answer, is_correct
from stillcut.demo.render import value_noise
from stillcut.demo.scenes import Scene, sample_scene

PAGE_ANSWERS = Path(__file__).resolve().parent.parent / "service" / "static" / "sample_answers.json"

RGB = tuple[float, float, float]
# A renderer yields the clip's frames, each [H, W, 3] uint8.
Renderer = Callable[["ClipSpec"], Iterator[np.ndarray]]


@dataclass(frozen=True)
class ClipSpec:
    """One sample clip: geometry, timing and encoder settings."""

    name: str
    width: int
    height: int
    fps: int
    num_frames: int
    crf: int = 23
    gop: int = 48

    def __post_init__(self) -> None:
        for field in ("width", "height"):
            value = getattr(self, field)
            if value < 16 or value % 2:
                raise ValueError(f"{field}={value}: must be an even number >= 16 (yuv420p)")
        if not 1 <= self.fps <= 60:
            raise ValueError(f"fps={self.fps}: allowed range is 1..60")
        if self.num_frames < 2:
            raise ValueError(f"num_frames={self.num_frames}: must be >= 2")
        if not 0 <= self.crf <= 51:
            raise ValueError(f"crf={self.crf}: allowed range is 0..51")


def backdrop(seed: int, height: int, width: int, low: RGB, high: RGB) -> np.ndarray:
    """A static scene [H, W, 3] float: noise on a colour ramp plus translucent coloured blocks."""
    rng = np.random.default_rng(seed)
    noise = value_noise(rng, height, width, cell_px=80)
    scene = np.asarray(low) + noise[..., None] * (np.asarray(high) - np.asarray(low))
    # Blocks give the scene sharp edges and distinct regions, like objects in a real room.
    for _ in range(height * width // 5000):
        y0, x0 = rng.integers(0, (height, width))
        size_y, size_x = rng.integers(6, 40, size=2)
        region = scene[y0 : y0 + size_y, x0 : x0 + size_x]
        region[:] = 0.5 * region + 0.5 * rng.uniform(0, 255, size=3)
    return scene


def disk(height: int, width: int, cy: float, cx: float, radius: float) -> np.ndarray:
    """Coverage [height, width] bool of a filled disk (hard edges keep the mask exact)."""
    y, x = np.ogrid[:height, :width]
    return (y - cy) ** 2 + (x - cx) ** 2 <= radius**2


def square(height: int, width: int, cy: float, cx: float, half: float) -> np.ndarray:
    """Coverage [height, width] bool of a filled axis-aligned square."""
    y, x = np.ogrid[:height, :width]
    return (np.abs(y - cy) <= half) & (np.abs(x - cx) <= half)


def compose(background: np.ndarray, objects: list[tuple[np.ndarray, RGB]]) -> np.ndarray:
    """Paint solid objects over a float background (later ones on top) -> [H, W, 3] uint8."""
    frame = background.copy()
    for coverage, colour in objects:
        frame[coverage] = colour
    return np.clip(np.rint(frame), 0, 255).astype(np.uint8)


def render_pan(spec: ClipSpec) -> Iterator[np.ndarray]:
    """A camera pan across a wide backdrop: every frame is the previous one shifted."""
    step = 3  # pixels per frame; whole pixels so every frame is an exact crop
    h, w = spec.height, spec.width
    panorama = backdrop(2, h, w + step * spec.num_frames, (20, 40, 90), (240, 220, 170))
    for i in range(spec.num_frames):
        yield compose(panorama[:, i * step : i * step + w], [])


def render_scene_cut(spec: ClipSpec) -> Iterator[np.ndarray]:
    """Two static scenes, each with one slowly moving object, joined by a hard cut."""
    h, w = spec.height, spec.width
    cut = spec.num_frames // 2  # even, so the cut falls on a two-frame tubelet boundary
    warm = backdrop(3, h, w, (90, 40, 20), (250, 200, 120))
    cool = backdrop(4, h, w, (10, 30, 60), (120, 200, 230))
    for i in range(spec.num_frames):
        if i < cut:
            obj = disk(h, w, 80, 60 + i, 12)
            yield compose(warm, [(obj, (250, 250, 250))])
        else:
            obj = square(h, w, 60 + (i - cut), 240, 10)
            yield compose(cool, [(obj, (250, 220, 0))])


def render_steady_motion(spec: ClipSpec) -> Iterator[np.ndarray]:
    """A static textured scene; one ball circles it at a steady speed, once every 20 s."""
    h, w = spec.height, spec.width
    background = backdrop(6, h, w, (30, 60, 80), (220, 210, 170))
    for i in range(spec.num_frames):
        angle = 2 * np.pi * i / (20 * spec.fps)
        ball = disk(h, w, h / 2 + 70 * np.sin(angle), w / 2 + 110 * np.cos(angle), 16)
        yield compose(background, [(ball, (240, 200, 30))])


NEAR_STATIC_EVENTS_S = (20, 110, 200)  # seconds at which the object appears


def render_near_static_long(spec: ClipSpec) -> Iterator[np.ndarray]:
    """A still room, as a fixed camera sees it; a small object slides by three times."""
    h, w = spec.height, spec.width
    room = backdrop(5, h, w, (50, 50, 60), (210, 200, 180))
    rng = np.random.default_rng(7)
    event_len = 3 * spec.fps  # each visit lasts 3 s
    event_starts = [s * spec.fps for s in NEAR_STATIC_EVENTS_S]
    # Per event: start (y, x) and end (y, x) of the small object's short slide.
    paths = rng.uniform((10, 10, 10, 10), (h - 10, w - 10, h - 10, w - 10), size=(3, 4))
    for i in range(spec.num_frames):
        objects = []
        for (y0, x0, y1, x1), first in zip(paths, event_starts, strict=True):
            if first <= i < first + event_len:
                t = (i - first) / (event_len - 1)
                position = (y0 + t * (y1 - y0), x0 + t * (x1 - x0))
                objects.append((disk(h, w, *position, 6), (255, 60, 200)))
        yield compose(room, objects)


def motion_mask_scene(spec: ClipSpec) -> Iterator[tuple[np.ndarray, list[np.ndarray]]]:
    """Yield each frame [H, W, 3] uint8 with its objects' coverage [H, W] (slow, fast)."""
    h, w = spec.height, spec.width
    background = backdrop(6, h, w, (30, 60, 30), (220, 230, 200))
    stop_from, stop_until = 3 * spec.fps, 5 * spec.fps  # the slow square rests for 2 s
    span = w - 40
    for i in range(spec.num_frames):
        # The fast ball bounces horizontally at 6 px/frame between x=20 and x=w-20.
        bounce = (6 * i) % (2 * span)
        fast = disk(h, w, 150, 20 + min(bounce, 2 * span - bounce), 14)
        slow_steps = min(i, stop_from) + max(0, i - stop_until)
        slow = square(h, w, 50 + 0.5 * slow_steps, 30 + slow_steps, 16)
        yield compose(background, [(slow, (40, 80, 230)), (fast, (240, 60, 30))]), [slow, fast]


def render_motion_mask(spec: ClipSpec) -> Iterator[np.ndarray]:
    """The frames of `motion_mask_scene` alone, for encoding."""
    for frame, _ in motion_mask_scene(spec):
        yield frame


def motion_masks(spec: ClipSpec) -> np.ndarray:
    """Ground truth [num_frames, H, W] bool: pixels changed since the previous rendered frame.

    Besides pixels whose value changed, a moved object's old and new footprints are both True:
    a solid object overlaps itself between frames, and the mask should say "the object moved
    here", not only mark its leading and trailing edges. Frame 0 is all False.
    """
    masks = [np.zeros((spec.height, spec.width), dtype=bool)]
    scene = motion_mask_scene(spec)
    prev_frame, prev_covers = next(scene)
    for frame, covers in scene:
        mask = np.any(frame != prev_frame, axis=-1)  # [H, W]
        for cov, prev_cov in zip(covers, prev_covers, strict=True):
            if np.any(cov != prev_cov):
                mask |= cov | prev_cov
        masks.append(mask)
        prev_frame, prev_covers = frame, covers
    return np.stack(masks)


def encode(path: Path, spec: ClipSpec, frames: Iterator[np.ndarray]) -> None:
    """Write frames to an H.264 .mp4 at constant frame rate (pts = frame index / fps)."""
    encode_h264(path, frames, spec.fps, crf=spec.crf, preset="medium", gop=spec.gop)


CLIPS: list[tuple[ClipSpec, Renderer]] = [
    (ClipSpec("pan", 320, 240, 24, 144), render_pan),
    (ClipSpec("scene_cut", 320, 240, 24, 144), render_scene_cut),
    (ClipSpec("near_static_long", 160, 120, 4, 1000, gop=240), render_near_static_long),
    (ClipSpec("motion_mask", 224, 224, 24, 192), render_motion_mask),
    (ClipSpec("steady_motion", 320, 240, 4, 480), render_steady_motion),
]


# Each task sample: what its scene must be like.
TASK_SAMPLES: dict[str, Callable[[Scene], bool]] = {
    "moving_object": lambda s: (
        s.motion in ("left", "right")
        and s.event == "none"
        and s.ground == "textured"
        and len(s.objects) == 2
    ),
    "vertical_motion": lambda s: (
        s.motion in ("up", "down")
        and s.event == "none"
        and s.ground == "flat"
        and len(s.objects) == 3
    ),
    "appearing_object": lambda s: s.motion != "none" and s.event == "appears",
    "still_scene": lambda s: s.subject is None and len(s.objects) == 3,
}


def task_sample_scenes() -> dict[str, Scene]:
    """Each task sample's scene: the first held-out scene that fits its description."""
    scenes = [sample_scene(seed) for seed in held_out_seeds()]
    return {name: next(s for s in scenes if fits(s)) for name, fits in TASK_SAMPLES.items()}


def sample_answers(samples_dir: Path) -> dict:
    """What the shipped demo answers about each task sample, beside the true answers."""
    from stillcut.service.api import VideoLLM

    llm = VideoLLM()
    samples = {}
    for name, scene in task_sample_scenes().items():
        rows = []
        for kind in QUESTION_TYPES:
            text = llm.describe(samples_dir / f"{name}.mp4", PROMPTS[kind][0]).text
            rows.append(
                {
                    "question": PROMPTS[kind][0],
                    "answer": text,
                    "truth": answer(scene, kind),
                    "correct": is_correct(scene, kind, text),
                }
            )
        samples[f"{name}.mp4"] = rows
    return {"model": llm.name, "evs": llm.evs_default.setting, "samples": samples}


def write_motion_mask(path: Path, spec: ClipSpec) -> None:
    """Save the motion_mask ground truth as a compressed .npz (mask, fps, frame_times)."""
    np.savez_compressed(
        path,
        mask=motion_masks(spec),
        fps=np.float64(spec.fps),
        frame_times=np.arange(spec.num_frames, dtype=np.float64) / spec.fps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    answers = parser.add_mutually_exclusive_group()
    answers.add_argument("--answers", type=Path, default=PAGE_ANSWERS, help="the page's copy")
    answers.add_argument("--no-answers", action="store_true", help="render the clips only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, scene in task_sample_scenes().items():
        (args.out / f"{name}.mp4").write_bytes(clip_bytes(scene))
        print(f"{name}: scene {scene.seed}, {scene.num_frames} frames, {scene.duration_s:.1f} s")
    for spec, render in CLIPS:
        encode(args.out / f"{spec.name}.mp4", spec, render(spec))
        if render is render_motion_mask:
            write_motion_mask(args.out / "motion_mask.npz", spec)
        print(f"{spec.name}: {spec.num_frames} frames, {spec.num_frames / spec.fps:.1f} s")
    if not args.no_answers:
        args.answers.write_text(json.dumps(sample_answers(args.out), indent=2) + "\n")
        print(f"the demo's answers about the task samples: {args.answers}")


if __name__ == "__main__":
    main()
