"""The demo model summarises a long video of its task truthfully, and says when things appear.

The video is 20 held-out scenes of the task played back to back (6 s each, a hard cut between
two), each with one moving object, no two of them the same colour and shape. Cut into 4 s
chunks (a third of them straddle a cut), it is summarised by the shipped demo model. Each
timeline entry must lie within one chunk of the scenes it describes, and at least 90 % of
entries must name each scene's true colour and direction and no other (a chunk across a cut:
both scenes, in order, "then" between); "when does the <colour> <shape> appear?" must be
answered within one chunk of the scene's start for at least 90 % of the scenes.
"""

import itertools

import pytest

from stillcut.demo.clips import HELD_OUT_START, TASK_X264_PARAMS, encode_h264
from stillcut.demo.questions import DIRECTIONS, keywords_match
from stillcut.demo.render import frames
from stillcut.demo.scenes import COLOURS, DURATION_S, FPS, SceneMix, sample_scene
from stillcut.service.api import VideoLLM

NUM_SCENES = 20
CHUNK_S = 4.0
MOVING = SceneMix(moving=1.0, changing=0.0, still=0.0, moving_event=0.0)
FIRST_SEED = HELD_OUT_START + 20_000  # apart from the held-out seeds the benches use


def distinct_scenes() -> list:
    """`NUM_SCENES` moving scenes whose subjects differ in colour or shape."""
    scenes, seen = [], set()
    for seed in itertools.count(FIRST_SEED):
        scene = sample_scene(seed, mix=MOVING)
        subject = (scene.subject_object.colour, scene.subject_object.shape)
        if subject not in seen:
            seen.add(subject)
            scenes.append(scene)
        if len(scenes) == NUM_SCENES:
            return scenes


@pytest.fixture(scope="module")
def scenes():
    return distinct_scenes()


@pytest.fixture(scope="module")
def summary(scenes, tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "scenes.mp4"
    images = itertools.chain.from_iterable(frames(scene) for scene in scenes)
    with path.open("wb") as out:
        encode_h264(out, images, FPS, crf=24, x264_params=TASK_X264_PARAMS)
    questions = [
        f"when does the {s.subject_object.colour} {s.subject_object.shape} appear?" for s in scenes
    ]
    return VideoLLM().summarize(path, chunk_s=CHUNK_S, questions=questions)


def covered(start_s: float, end_s: float) -> list[int]:
    """The scenes a chunk from `start_s` to `end_s` shows, in order."""
    first, last = int(start_s // DURATION_S), int((end_s - 1e-6) // DURATION_S)
    return list(range(first, min(last, NUM_SCENES - 1) + 1))


def test_the_timeline_names_each_scenes_colour_and_direction(scenes, summary):
    timeline = summary.timeline
    assert len(timeline) == NUM_SCENES * DURATION_S / CHUNK_S
    right = 0
    for entry in timeline:
        shown = covered(entry.start_s, entry.end_s)
        for index in shown:  # within one chunk of the scene it describes
            assert index * DURATION_S - CHUNK_S <= entry.start_s
            assert entry.end_s <= (index + 1) * DURATION_S + CHUNK_S
        pieces = entry.text.lower().split("then")
        right += len(pieces) == len(shown) and all(
            keywords_match(
                piece,
                {scenes[index].subject_object.colour, scenes[index].motion},
                [tuple(COLOURS), DIRECTIONS],
            )
            for piece, index in zip(pieces, shown, strict=False)
        )
    assert right >= 0.9 * len(timeline), [entry.text for entry in timeline]


def test_when_a_shape_appears_is_answered_within_one_chunk(scenes, summary):
    starts = [index * DURATION_S for index in range(NUM_SCENES)]
    right = sum(
        answer.first_s is not None and abs(answer.first_s - start) <= CHUNK_S
        for answer, start in zip(summary.answers, starts, strict=True)
    )
    assert right >= 0.9 * NUM_SCENES, [answer.text for answer in summary.answers]
