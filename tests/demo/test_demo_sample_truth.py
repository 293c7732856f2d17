"""What the shipped demo says about its task samples must be wholly true.

`stillcut describe` on each task sample must print a description that the strict scorer
accepts (every object, what each does, the ground, nothing invented), and `stillcut narrate`
on the moving and the appearing sample must say, for every tubelet it speaks about, the change
that tubelet shows. The tests compute in float32, as on a CPU without bfloat16 dot products;
the shipped checkpoint says the same with bfloat16 products (the default on a CPU that has
them).
"""

import runpy

import pytest

from stillcut.demo.narration import FRAMES_PER_TUBELET, NARRATION_FPS, segment_is_correct
from stillcut.demo.questions import PROMPTS, is_correct
from stillcut.demo.sample_clips import SAMPLES_DIR
from stillcut.service.api import VideoLLM

TASK_SCENES = runpy.run_path(str(SAMPLES_DIR / "make_samples.py"))["task_sample_scenes"]()


@pytest.fixture(scope="module")
def demo():
    return VideoLLM()


def test_describe_is_wholly_true_on_every_task_sample(demo):
    wrong = {}
    for name, scene in TASK_SCENES.items():
        text = demo.describe(SAMPLES_DIR / f"{name}.mp4", PROMPTS["describe"][0]).text
        if not is_correct(scene, "describe", text):
            wrong[name] = text
    assert not wrong


def test_narration_of_the_moving_and_appearing_samples_tells_each_change(demo):
    wrong = []
    for name in ("moving_object", "appearing_object"):
        scene = TASK_SCENES[name]
        segments = list(demo.narrate(SAMPLES_DIR / f"{name}.mp4", lag="queue"))
        assert segments, name
        for segment in segments:
            index = round(segment.t[0] * NARRATION_FPS) // FRAMES_PER_TUBELET
            if not segment_is_correct(scene, index, segment.text):
                wrong.append((name, segment.t, segment.text))
    assert not wrong
