"""The committed sample clips match what samples/README.md documents.

Other tests and benchmarks rely on these files' frame counts, timing and sizes, and EVS recall
is measured against motion_mask.npz, so the mask must line up frame by frame with its clip and
with the generator that made it. The task samples are held-out scenes of the demo's task, and
must be exactly the clips their scenes encode to.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import av
import numpy as np
import pytest

from stillcut.demo.clips import clip_bytes, held_out_seeds

SAMPLES_DIR = Path(__file__).resolve().parents[2] / "samples"

# name: (width, height, fps, num_frames), as documented in samples/README.md
TASK_CLIPS = {
    name: (320, 240, 8, 48)
    for name in ("moving_object", "vertical_motion", "appearing_object", "still_scene")
}
CLIPS = {
    **TASK_CLIPS,
    "pan": (320, 240, 24, 144),
    "scene_cut": (320, 240, 24, 144),
    "near_static_long": (160, 120, 4, 1000),
    "motion_mask": (224, 224, 24, 192),
    "steady_motion": (320, 240, 4, 480),
}


def decode(name: str, keep_frames: bool = False) -> tuple[dict, list[float], list[np.ndarray]]:
    """Decode a clip: stream facts, each frame's time in seconds, and optionally RGB frames."""
    times, frames = [], []
    with av.open(str(SAMPLES_DIR / f"{name}.mp4")) as container:
        stream = container.streams.video[0]
        info = {
            "size": (stream.width, stream.height),
            "fps": stream.average_rate,
            "duration_s": float(stream.duration * stream.time_base),
        }
        for frame in container.decode(stream):
            assert (frame.width, frame.height) == info["size"]
            times.append(float(frame.pts * frame.time_base))
            if keep_frames:
                frames.append(frame.to_ndarray(format="rgb24"))
    return info, times, frames


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_clip_decodes_to_documented_geometry_and_timing(name: str) -> None:
    width, height, fps, num_frames = CLIPS[name]
    info, times, _ = decode(name)
    assert info["size"] == (width, height)
    assert info["fps"] == fps
    assert len(times) == num_frames
    assert np.all(np.diff(times) > 0), "presentation times must increase strictly"
    np.testing.assert_allclose(times, np.arange(num_frames) / fps, atol=1e-3)
    assert info["duration_s"] == pytest.approx(num_frames / fps, abs=1e-3)


def test_samples_stay_small() -> None:
    files = [p for p in SAMPLES_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sum(p.stat().st_size for p in files) < 2_000_000
    assert (SAMPLES_DIR / "near_static_long.mp4").stat().st_size <= 500_000


def test_motion_mask_lines_up_with_its_clip() -> None:
    width, height, fps, num_frames = CLIPS["motion_mask"]
    _, times, frames = decode("motion_mask", keep_frames=True)
    with np.load(SAMPLES_DIR / "motion_mask.npz") as data:
        mask, mask_fps, frame_times = data["mask"], data["fps"], data["frame_times"]
    assert mask.dtype == np.bool_ and mask.shape == (num_frames, height, width)
    assert float(mask_fps) == fps
    assert frame_times.dtype == np.float64
    np.testing.assert_allclose(frame_times, times, atol=1e-6)

    assert not mask[0].any()
    assert mask[1:].any(axis=(1, 2)).all(), "the fast object moves in every frame"
    assert 0.005 < mask.mean() < 0.2

    # The encoded clip must change where the mask says so, and not a frame early or late.
    change = np.abs(np.diff(np.stack(frames).astype(np.int16), axis=0)).mean(axis=-1)  # [T-1, H, W]

    def contrast(shift: int) -> float:
        moved = np.roll(mask, shift, axis=0)[1:]  # [T-1, H, W]
        return change[moved].mean() / change[~moved].mean()

    assert contrast(0) > 10
    assert contrast(0) > 2 * max(contrast(-1), contrast(1))


def test_generator_matches_committed_specs_and_mask() -> None:
    script = runpy.run_path(str(SAMPLES_DIR / "make_samples.py"))
    specs = {spec.name: spec for spec, _ in script["CLIPS"]}
    specs |= script["task_sample_scenes"]()
    assert {name: (s.width, s.height, s.fps, s.num_frames) for name, s in specs.items()} == CLIPS
    with np.load(SAMPLES_DIR / "motion_mask.npz") as data:
        np.testing.assert_array_equal(script["motion_masks"](specs["motion_mask"]), data["mask"])


def test_task_samples_are_held_out_scenes_encoded_byte_for_byte() -> None:
    script = runpy.run_path(str(SAMPLES_DIR / "make_samples.py"))
    scenes = script["task_sample_scenes"]()
    assert set(scenes) == set(TASK_CLIPS)
    for name, scene in scenes.items():
        assert scene.seed in held_out_seeds()
        assert clip_bytes(scene) == (SAMPLES_DIR / f"{name}.mp4").read_bytes(), name
