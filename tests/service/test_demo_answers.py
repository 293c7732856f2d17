"""The default demo tells the truth about the task samples, on the command line and the page.

`stillcut describe SAMPLE` with no `--model` runs the trained demo shipped with the package,
with every default (the prompt "Describe this video.", EVS rate 0.75); its answer must name
the moving object's true colour and direction and no other direction (a still scene's: that
nothing moves). The whole sentence is not held to be right: the demo still misnames a shape or
a bystander in some (the page shows which). The page's copy of the demo's answers
(`sample_answers.json`) must be what the demo answers now.
"""

import json
import re
import runpy
from pathlib import Path

import httpx
import pytest

from stillcut.demo.questions import DIRECTIONS, PROMPTS
from stillcut.demo.scenes import Scene
from stillcut.service import cli
from stillcut.service.cli_options import RANDOM_WEIGHTS_NOTICE
from stillcut.service.page_routes import STATIC_DIR

SAMPLES_DIR = Path(__file__).resolve().parents[2] / "samples"
MAKE_SAMPLES = runpy.run_path(str(SAMPLES_DIR / "make_samples.py"))
TASK_SCENES = MAKE_SAMPLES["task_sample_scenes"]()
DESCRIBE = PROMPTS["describe"][0]  # describe's default prompt


def names_true_colour_and_direction(scene: Scene, answer: str) -> bool:
    """Whether a description names what moves by its true colour and direction, and no other
    direction (a still scene's: that nothing moves, and no direction)."""
    words = set(re.findall(r"[a-z]+", answer.lower()))
    if scene.motion == "none":
        return "nothing" in words and not words & set(DIRECTIONS)
    named = {scene.subject_object.colour, scene.motion} <= words
    return named and not words & (set(DIRECTIONS) - {scene.motion})


@pytest.mark.parametrize("name", sorted(TASK_SCENES))
def test_describe_names_the_true_colour_and_direction(name, capsys):
    assert cli.main(["describe", str(SAMPLES_DIR / f"{name}.mp4")]) == 0
    out, err = capsys.readouterr()
    answer = out.split("\n\n")[0]
    assert names_true_colour_and_direction(TASK_SCENES[name], answer), answer
    assert "evs:rate:q=0.75" in out
    assert RANDOM_WEIGHTS_NOTICE not in err


def test_the_pages_copy_is_what_the_demo_answers_now():
    stored = json.loads((STATIC_DIR / "sample_answers.json").read_text())
    assert stored == MAKE_SAMPLES["sample_answers"](SAMPLES_DIR)
    assert set(stored["samples"]) == {f"{name}.mp4" for name in TASK_SCENES}
    for name, rows in stored["samples"].items():
        assert len(rows) == 6
        (description,) = [row["answer"] for row in rows if row["question"] == DESCRIBE]
        assert names_true_colour_and_direction(TASK_SCENES[name.removesuffix(".mp4")], description)


def test_the_server_serves_the_pages_copy(main_server):
    response = httpx.get(f"{main_server.url}/static/sample_answers.json")
    assert response.status_code == 200
    assert response.json() == json.loads((STATIC_DIR / "sample_answers.json").read_text())
