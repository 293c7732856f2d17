"""Which of the sample clips in `samples/` the demo model can speak about.

The task samples are held-out scenes of the demo's task. The others exercise EVS and speed (a
camera pan, a scene cut, a long near-static clip, steady motion, known motion masks) and show
nothing the demo was trained on, so its words about them mean nothing: `outside_task_notice`
says so, and the command line prints it on stderr when one of them is described or narrated
with the demo model.
"""

from __future__ import annotations

import os
from pathlib import Path

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "samples"
TASK_SAMPLES = (
    "moving_object.mp4",
    "vertical_motion.mp4",
    "appearing_object.mp4",
    "still_scene.mp4",
)
EVS_SAMPLES = (
    "pan.mp4",
    "scene_cut.mp4",
    "near_static_long.mp4",
    "steady_motion.mp4",
    "motion_mask.mp4",
)


def outside_task_notice(video: str | os.PathLike) -> str | None:
    """The note to show when `video` is one of the EVS and speed samples (in `samples/`),
    else None."""
    path = Path(video).resolve()
    if path.parent != SAMPLES_DIR or path.name not in EVS_SAMPLES:
        return None
    task = ", ".join(name.removesuffix(".mp4") for name in TASK_SAMPLES)
    return (
        f"note: {path.name} is an EVS and speed sample, outside the demo model's task "
        "(coloured shapes on muted ground), so the demo's words about it mean nothing; "
        f"its task samples are {task}"
    )
