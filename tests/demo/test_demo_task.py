"""The demo's synthetic task: scenes, their frames and clips, the true answers and scoring.

The task is what the shipped demo model is trained and scored on, so the tests pin what the
accuracy numbers rely on: a seed names one scene and one clip (byte for byte), the held-out
scenes cover every colour, shape, motion, event and ground, objects never overlap, and the
scorer accepts the true answer and rejects a wrong one.
"""

import dataclasses
import hashlib
import itertools

import numpy as np
import pytest

from stillcut.demo.clips import clip_bytes, held_out_seeds, training_seeds
from stillcut.demo.questions import DIRECTION_PHRASES, QUESTION_TYPES, answer, is_correct
from stillcut.demo.render import coverage, frames
from stillcut.demo.scenes import COLOURS, MOTIONS, SHAPES, mirrored, sample_scene
from stillcut.vision.decode import DecodeConfig, decode_video

HELD_OUT = [sample_scene(seed) for seed in held_out_seeds()]


def test_seed_ranges_are_disjoint_and_the_held_out_set_is_large():
    assert len(held_out_seeds()) >= 500
    assert max(training_seeds(100_000)) < min(held_out_seeds())
    with pytest.raises(ValueError, match="count="):
        training_seeds(2_000_000)


def test_held_out_scenes_cover_the_whole_task():
    objects = [o for scene in HELD_OUT for o in scene.objects]
    assert {o.colour for o in objects} == set(COLOURS) and len(COLOURS) >= 6
    assert {o.shape for o in objects} == set(SHAPES) and len(SHAPES) >= 4
    assert {s.motion for s in HELD_OUT} == set(MOTIONS)
    assert {s.event for s in HELD_OUT} == {"none", "appears", "disappears"}
    assert {s.ground for s in HELD_OUT} == {"flat", "textured"}
    assert {len(s.objects) for s in HELD_OUT} == {1, 2, 3}
    assert any(s.subject is None for s in HELD_OUT)  # still scenes: nothing changes


def test_objects_are_distinct_inside_the_frame_and_never_overlap():
    for scene in HELD_OUT[:200]:
        assert len({o.colour for o in scene.objects}) == len(scene.objects)
        assert len({o.shape for o in scene.objects}) == len(scene.objects)
        for t in np.linspace(0, scene.duration_s, 13):
            painted = np.zeros((scene.height, scene.width), int)
            for obj in scene.objects:
                x, y = obj.centre(t)
                assert obj.size <= x <= scene.width - obj.size, (scene.seed, t)
                assert obj.size <= y <= scene.height - obj.size, (scene.seed, t)
                rows, cols, mask = coverage(obj, t, scene.height, scene.width)
                painted[rows, cols] += mask
            assert painted.max() <= 1, scene.seed


def test_only_the_subject_moves_or_changes():
    for scene in HELD_OUT:
        for index, obj in enumerate(scene.objects):
            changes = obj.vx != 0 or obj.vy != 0 or obj.shown_from > 0 or obj.shown_until < 99
            assert changes == (index == scene.subject), scene.seed
        if scene.motion != "none":
            subject = scene.subject_object
            velocity = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
            assert tuple(np.sign([subject.vx, subject.vy])) == velocity[scene.motion]


def test_a_seed_names_one_clip_byte_for_byte():
    scene = sample_scene(3)
    assert sample_scene(3) == scene
    digests = {hashlib.sha256(clip_bytes(scene)).hexdigest() for _ in range(3)}
    assert len(digests) == 1


def test_clip_decodes_to_the_sampled_frames():
    scene = next(s for s in HELD_OUT if s.motion != "none" and s.event == "none")
    decoded = decode_video(clip_bytes(scene), DecodeConfig())
    assert (decoded.width, decoded.height) == (320, 240)
    assert decoded.timestamps == pytest.approx([k / 2 for k in range(12)])
    # The subject is where the scene says, through camera noise and compression.
    for index in (0, 6, 11):
        t = index / 2
        rows, cols, mask = coverage(scene.subject_object, t, 240, 320)
        painted = decoded.frames[index][rows, cols][mask].astype(int)
        assert np.abs(painted - scene.subject_object.rgb).mean() < 20, t


def test_a_mirrored_scene_renders_as_the_flipped_clip():
    still_ground = {"ground": "flat", "noise_sigma": 0.0}
    for seed in range(6):
        scene = dataclasses.replace(sample_scene(seed, fps=2), **still_ground)
        flipped = [frame[:, ::-1] for frame in frames(scene)]
        for ours, theirs in zip(frames(mirrored(scene)), flipped, strict=True):
            np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("question_type", QUESTION_TYPES)
def test_true_answers_score_right(question_type):
    for scene in HELD_OUT:
        assert is_correct(scene, question_type, answer(scene, question_type)), scene.seed


def test_wrong_answers_score_wrong():
    scene = next(
        s for s in HELD_OUT if s.motion == "left" and s.event == "none" and len(s.objects) == 1
    )
    colour, shape = scene.subject_object.colour, scene.subject_object.shape
    other = next(c for c in COLOURS if c != colour)
    assert is_correct(scene, "colour", f"The object is {colour}.")
    assert not is_correct(scene, "colour", f"It is {other}.")
    assert not is_correct(scene, "colour", f"It is {colour} or {other}.")
    assert not is_correct(scene, "colour", "Nothing moves.")
    assert not is_correct(scene, "shape", "It is a blob.")
    assert is_correct(scene, "direction", "Leftwards: it moves to the left.")
    assert not is_correct(scene, "direction", "It moves to the left, then right.")
    assert not is_correct(scene, "count", "There are two objects.")
    assert not is_correct(scene, "change", "No, nothing changes.")
    description = f"A {colour} {shape} moves to the left on a flat background."
    assert is_correct(scene, "describe", description)
    assert not is_correct(scene, "describe", description.replace("left", "right"))
    assert not is_correct(scene, "describe", description.replace(colour, other))


def test_answers_name_what_the_scene_holds():
    still = next(s for s in HELD_OUT if s.subject is None and len(s.objects) == 3)
    assert answer(still, "direction") == "Nothing moves."
    assert answer(still, "change") == "No, nothing changes."
    assert answer(still, "count") == "There are three objects."
    assert answer(still, "describe").endswith("nothing changes.")
    appearing = next(s for s in HELD_OUT if s.event == "appears" and s.motion != "none")
    assert " appears and moves " in answer(appearing, "describe")
    pairs = {(s.subject_object.colour, s.motion) for s in HELD_OUT if s.motion != "none"}
    assert len(pairs) == len(COLOURS) * 4  # every colour goes every way
    assert (
        len(
            set(itertools.product(SHAPES, MOTIONS[:4]))
            - {(s.subject_object.shape, s.motion) for s in HELD_OUT if s.motion != "none"}
        )
        == 0
    )


def test_a_description_lists_every_object_then_says_what_the_subject_does():
    scene = next(
        s
        for s in HELD_OUT
        if s.event == "disappears" and s.motion != "none" and len(s.objects) == 3
    )
    subject = scene.subject_object
    names = [f"{o.colour} {o.shape}" for o in scene.objects]
    text = answer(scene, "describe")
    listing, rest = text.split(":")
    # every object, the subject among them, once each, in the fixed colour order
    assert all(listing.count(name) == 1 for name in names)
    rank = list(COLOURS).index
    listed_order = [rank(name.split()[0]) for name in sorted(names, key=listing.index)]
    assert listed_order == sorted(rank(o.colour) for o in scene.objects)
    assert listing.endswith(f"on a {scene.ground} background")
    assert rest == (
        f" the {subject.colour} {subject.shape} moves {DIRECTION_PHRASES[scene.motion]} and "
        "disappears; the others stay still."
    )


def test_a_description_must_name_every_object_and_the_ground_and_nothing_else():
    scene = next(
        s for s in HELD_OUT if s.motion == "right" and s.event == "none" and len(s.objects) == 3
    )
    true = answer(scene, "describe")
    assert is_correct(scene, "describe", true)
    subject, (first, second) = scene.subject_object, scene.bystanders
    absent_colour = next(c for c in COLOURS if c not in {o.colour for o in scene.objects})
    absent_shape = next(s for s in SHAPES if s not in {o.shape for o in scene.objects})
    other_ground = "flat" if scene.ground == "textured" else "textured"
    wrong = [
        true.replace(
            f" and a{'n' if second.colour == 'orange' else ''} {second.colour} {second.shape}", ""
        ),  # a bystander left out
        true.replace(f"{first.colour} {first.shape}", f"{first.colour} {absent_shape}"),
        true.replace(f"{first.colour} {first.shape}", f"{absent_colour} {first.shape}"),
        true.replace(scene.ground, other_ground),
        true.replace(f" on a {scene.ground} background", ""),  # the ground left out
        true.replace(" stay still", ""),  # what the others do left out
        true.rstrip(".") + f"; a {absent_colour} {absent_shape} appears.",  # an invented object
        f"A {subject.colour} {subject.shape} moves to the right.",
    ]
    for text in wrong:
        assert text != true
        assert not is_correct(scene, "describe", text), text


def test_a_still_scenes_description_names_each_object_and_that_nothing_changes():
    scene = next(s for s in HELD_OUT if s.subject is None and len(s.objects) == 2)
    true = answer(scene, "describe")
    assert is_correct(scene, "describe", true)
    assert not is_correct(scene, "describe", true.replace("; nothing changes", ""))
    assert not is_correct(scene, "describe", true.replace("still", "up"))
    obj = scene.objects[0]
    assert not is_correct(scene, "describe", true.replace(obj.shape, "blob"))
