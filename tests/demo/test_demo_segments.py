"""Narration segments, chunk captions and summaries of the demo task: their truths and scoring.

What the narration and caption accuracies rest on: each tubelet's change is read off the scene
at the sampled frames (an appearance is announced in the tubelet whose frames first show the
object), the true segment and caption score right, and a segment or caption that names a wrong
or an extra change, colour, shape or direction, or scenes out of order, scores wrong. The
prompts are the documented ones.
"""

import dataclasses

import numpy as np
import pytest

from stillcut.demo.captions import (
    ScenePart,
    caption_is_correct,
    chunk_caption,
    chunk_parts,
    draw_chunk,
    summary,
)
from stillcut.demo.chunk_prompts import (
    TimedCaption,
    aggregation_messages,
    chunk_caption_messages,
)
from stillcut.demo.clips import held_out_seeds
from stillcut.demo.narration import (
    CHANGES,
    num_tubelets,
    segment,
    segment_is_correct,
    tubelet_change,
)
from stillcut.demo.questions import capitalised, named
from stillcut.demo.scenes import NARRATION_MIX, SceneMix, sample_scene
from stillcut.service.narrate_options import NarrateOptions

SCENES = [sample_scene(seed, mix=NARRATION_MIX) for seed in held_out_seeds(200)]


# both mixes: the narration mix has no moving scene without an appearance or a departure
BOTH_MIXES = SCENES + [sample_scene(seed) for seed in held_out_seeds(200)]


def _first(predicate):
    return next(s for s in BOTH_MIXES if predicate(s))


def test_narration_constants_are_the_live_narrations_defaults():
    from stillcut.demo.narration import NARRATION_FPS, SEGMENT_END

    options = NarrateOptions(prompt="x")
    assert options.segment_end == (SEGMENT_END,) and options.fps == NARRATION_FPS


def test_an_appearance_is_told_in_the_tubelet_that_first_shows_it():
    scene = _first(lambda s: s.event == "appears" and s.motion == "none")
    shown_from = scene.subject_object.shown_from
    first_shown = next(k for k in range(12) if k / 2 >= shown_from)  # 2 fps frame index
    changes = [tubelet_change(scene, i) for i in range(num_tubelets(scene))]
    assert changes[first_shown // 2] == "appears"
    assert changes.count("appears") == 1 and set(changes) == {"appears", "nothing"}
    appears = capitalised(f"{named(scene.subject_object, 'a')} appears.\n")
    assert segment(scene, first_shown // 2) == appears


def test_every_change_is_common_in_the_narration_mix_and_changes_fall_on_whole_seconds():
    changes = [tubelet_change(s, i) for s in SCENES for i in range(num_tubelets(s))]
    for change in CHANGES:
        assert changes.count(change) > 0.05 * len(changes), change
    for scene in SCENES:
        subject = scene.subject_object
        if scene.event != "none":
            at = subject.shown_from if scene.event == "appears" else subject.shown_until
            assert at == round(at), scene.seed
        if scene.motion != "none":
            assert "moves" in {tubelet_change(scene, i) for i in range(num_tubelets(scene))}
    with pytest.raises(ValueError, match="must be 1"):
        SceneMix(moving=0.5, changing=0.5, still=0.5)
    with pytest.raises(ValueError, match="event_step_s"):
        SceneMix(event_step_s=0.0)


def test_true_segments_score_right_and_wrong_ones_wrong():
    for scene in BOTH_MIXES:
        for index in range(num_tubelets(scene)):
            assert segment_is_correct(scene, index, segment(scene, index)), scene.seed
    scene = _first(lambda s: s.motion == "left" and s.event == "none")
    colour, shape = scene.subject_object.colour, scene.subject_object.shape
    assert segment_is_correct(scene, 2, f"The {colour} {shape} moves to the left.")
    assert not segment_is_correct(scene, 2, f"The {colour} {shape} moves to the right.")
    assert not segment_is_correct(scene, 2, f"The {colour} {shape} moves left and leaves.")
    assert not segment_is_correct(scene, 2, "Nothing changes.")
    assert not segment_is_correct(scene, 2, f"The {colour} thing moves to the left.")
    still = _first(lambda s: s.subject is None)
    assert segment_is_correct(still, 3, "Nothing changes.")
    assert not segment_is_correct(still, 3, f"The {still.objects[0].colour} one leaves.")


def test_a_chunk_across_a_cut_captions_both_scenes_in_order():
    moving = _first(lambda s: s.motion == "up" and s.event == "none")
    still = _first(lambda s: s.subject is None and len(s.objects) == 2)
    parts = [ScenePart(moving, 4.0, 6.0), ScenePart(still, 0.0, 2.0)]
    caption = chunk_caption(parts)
    subject = moving.subject_object
    assert caption.startswith(capitalised(f"{named(subject, 'a')} moves up; then "))
    assert caption.endswith(" stand still.")
    assert caption_is_correct(parts, caption)
    first, second = caption.rstrip(".").split("; then ")
    assert not caption_is_correct(parts, f"{second}; then {first}.")  # out of order
    assert not caption_is_correct(parts, first + ".")  # a scene left out
    assert not caption_is_correct(parts, caption.replace("up", "down"))
    assert not caption_is_correct(parts[:1], caption)


def test_every_true_caption_is_judged_right_and_a_missing_object_wrong():
    rng = np.random.default_rng(0)
    scenes = [sample_scene(seed) for seed in range(60)]
    for first, second in zip(scenes[::2], scenes[1::2], strict=True):
        start, end = draw_chunk(rng, first.duration_s)
        parts = chunk_parts(first, second, start, end)
        assert caption_is_correct(parts, chunk_caption(parts)), (first.seed, second.seed)
    three = _first(lambda s: s.subject is None and len(s.objects) == 3)
    parts = [ScenePart(three, 0.0, 2.0)]
    caption = chunk_caption(parts)  # "A red circle, a blue square and a green cross stand still."
    assert caption.count(",") == 1 and caption_is_correct(parts, caption)
    assert not caption_is_correct(parts, caption.split(",")[0] + " stands still.")


def test_a_part_before_an_appearance_is_still_and_the_summary_drops_repeats():
    scene = _first(lambda s: s.event == "appears" and s.motion == "none")
    before = ScenePart(scene, 0.0, 1.0)
    assert "appears" not in chunk_caption([before])
    whole = ScenePart(scene, 0.0, 6.0)
    assert " appears" in chunk_caption([whole])
    captions = ["A red circle moves up.", "A red circle moves up; then a blue cross disappears."]
    assert summary(captions) == "A red circle moves up; then a blue cross disappears."
    with pytest.raises(ValueError, match="end_s"):
        ScenePart(scene, 2.0, 7.0)


def test_chunk_and_aggregation_prompts():
    (message,) = chunk_caption_messages(4.0, 8.0)
    assert [p["type"] for p in message["content"]] == ["text", "video", "text"]
    assert message["content"][0]["text"] == "From 4.0s to 8.0s:"
    (summary_message,) = aggregation_messages(
        [TimedCaption(0.0, 4.0, "A red circle moves up."), TimedCaption(4.0, 8.0, "B.")]
    )
    assert summary_message["content"].splitlines()[1:] == [
        "[0.0-4.0s] A red circle moves up.",
        "[4.0-8.0s] B.",
    ]
    with pytest.raises(ValueError, match="start_s"):
        chunk_caption_messages(5.0, 4.0)
    with pytest.raises(ValueError, match=r"captions\[0\].text"):
        aggregation_messages([TimedCaption(0.0, 1.0, "two\nlines")])
    with pytest.raises(ValueError, match="at least one"):
        aggregation_messages([])


def test_the_default_mix_draws_the_scenes_it_always_drew():
    assert sample_scene(1_000_017) == sample_scene(1_000_017, mix=SceneMix())
    assert dataclasses.replace(sample_scene(3), seed=3) == sample_scene(3)
