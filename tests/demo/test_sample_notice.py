"""The sample clips a user is pointed at: the demo's task samples, or EVS and speed samples
that the command line flags (on stderr) when the demo model describes or narrates one.
"""

import shutil

import pytest

from stillcut.demo.sample_clips import (
    EVS_SAMPLES,
    SAMPLES_DIR,
    TASK_SAMPLES,
    outside_task_notice,
)
from stillcut.service import cli

NOTICE = "outside the demo model's task"


def test_every_sample_clip_is_a_task_sample_or_an_evs_sample():
    clips = {path.name for path in SAMPLES_DIR.glob("*.mp4")}
    assert clips == set(TASK_SAMPLES) | set(EVS_SAMPLES)
    assert not set(TASK_SAMPLES) & set(EVS_SAMPLES)
    readme = (SAMPLES_DIR / "README.md").read_text()
    for name in clips:
        assert f"`{name}`" in readme, name


def test_the_notice_names_only_the_evs_samples(tmp_path):
    for name in EVS_SAMPLES:
        assert NOTICE in outside_task_notice(SAMPLES_DIR / name)
    for name in TASK_SAMPLES:
        assert outside_task_notice(SAMPLES_DIR / name) is None
    elsewhere = tmp_path / "pan.mp4"  # a user's own clip of the same name
    shutil.copy(SAMPLES_DIR / "pan.mp4", elsewhere)
    assert outside_task_notice(elsewhere) is None


@pytest.mark.parametrize("command", ["describe", "narrate"])
def test_the_cli_notes_an_evs_sample_described_with_the_demo(command, capsys):
    limit = ["--max-tokens", "2"] if command == "describe" else ["--max-tokens-per-segment", "2"]
    assert cli.main([command, str(SAMPLES_DIR / "scene_cut.mp4"), *limit]) == 0
    assert NOTICE in capsys.readouterr().err
    assert cli.main([command, str(SAMPLES_DIR / "moving_object.mp4"), *limit]) == 0
    assert NOTICE not in capsys.readouterr().err
