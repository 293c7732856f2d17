"""The answer stage's tasks: every task's sequences are the prompts stillcut sends, predict
exactly their answers, and go through the trainer's loss.

A narration sequence must be what a live narration runs: the instruction and per tubelet its
timestamp and one-tubelet video (`narration_prompt`, `narration_input`), with the segment after
each; a tubelet threshold EVS empties is left out with its segment, and the first is kept
whole. Its video tokens sit at t = 0 of each tubelet's own grid, each tubelet after the text
before it, as the engine places appended input.
"""

import dataclasses

import numpy as np
import pytest
import torch

from stillcut.demo import architecture
from stillcut.demo.captions import CHUNK_SECONDS
from stillcut.demo.clips import narration_training_seeds, training_seeds
from stillcut.demo.narration import segment
from stillcut.demo.questions import PROMPTS, answer
from stillcut.demo.scenes import COLOURS, NARRATION_MIX, sample_scene
from stillcut.demo.sequences import (
    IGNORE,
    answer_sequence,
    narration_sequence,
    questions_sequence,
    video_item,
)
from stillcut.demo.tasks import TASKS, ClipView, TaskMix, pairs_mask
from stillcut.demo.token_labels import (
    LOOKBACK_CLASSES,
    NO_TARGET,
    PLACE_CHANGES,
    lookback_targets,
    token_labels,
)
from stillcut.demo.train import (
    GONE_WEIGHT,
    LOOKBACK_WEIGHTS,
    DemoTrainer,
    TrainConfig,
    length_groups,
    lookback_token_weights,
)
from stillcut.demo.training_data import training_clips
from stillcut.engine.processor import DEFAULT_NARRATE_PROMPT
from stillcut.kernels.evs import EVSConfig
from stillcut.kernels.evs.config import num_retained_tokens
from stillcut.service.narrate_options import NarrateOptions

COLOURS_INDEX = {name: index for index, name in enumerate(COLOURS)}
CONFIG = TrainConfig(
    num_clips=2, num_narration_clips=2, clips_per_step=4, questions_per_clip=2, lookback_weight=0.5
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("skeleton")
    architecture.write_skeleton(folder, {})
    trainer = DemoTrainer(folder, CONFIG)
    clips = training_clips(training_seeds(2), trainer.preprocess)
    clips += training_clips(narration_training_seeds(2), trainer.preprocess, mix=NARRATION_MIX)
    views = [
        ClipView(c.scene, c.embeds, c.grid_thw, c.second_per_grid_ts) for c in trainer.encode(clips)
    ]
    return trainer, views


def _predicted_text(trainer, sequence) -> str:
    return trainer.processor.tokenizer.decode(
        [label for label in sequence.labels if label != IGNORE], skip_special_tokens=False
    )


@pytest.mark.parametrize("task", TASKS)
def test_each_task_gives_sequences_the_loss_takes(setup, task):
    trainer, views = setup
    weights = {name: float(name == task) for name in TASKS}
    tasks = dataclasses.replace(trainer.tasks, mix=TaskMix(**weights))
    sequences = tasks.for_batch(views, np.random.default_rng(0))
    assert len(sequences) == len(views)
    video_id = trainer.rope_spec.video_token_id
    for sequence in sequences:
        assert len(sequence.labels) == len(sequence.input_ids) == sequence.positions.shape[1]
        assert sequence.input_ids.count(video_id) == sequence.video_embeds.shape[0]
        assert _predicted_text(trainer, sequence).strip()
    if task == "summary":
        assert all(s.video_embeds.numel() == 0 for s in sequences)
    loss = trainer._losses(sequences)[0]
    assert torch.isfinite(loss) and loss > 0


def test_questions_in_one_sequence_teach_what_each_question_alone_would(setup):
    trainer, views = setup
    view = views[0]
    item = video_item(view.embeds, view.grid_thw, view.second_per_grid_ts, None)
    kinds = ("describe", "colour", "count")
    prompts = [trainer.processor.build_text(PROMPTS[kind][0], [item]) for kind in kinds]
    answers = [answer(view.scene, kind) for kind in kinds]
    shared = questions_sequence(trainer.processor, trainer.rope_spec, prompts, answers)
    alone = [
        answer_sequence(trainer.processor, trainer.rope_spec, p, a)
        for p, a in zip(prompts, answers, strict=True)
    ]
    video_id = trainer.rope_spec.video_token_id
    assert shared.input_ids.count(video_id) == item.embeds.shape[0]  # the video once
    assert len(shared.input_ids) < sum(len(s.input_ids) for s in alone) / 2
    assert _predicted_text(trainer, shared) == "".join(_predicted_text(trainer, s) for s in alone)
    # each branch sees the video and its own question at the positions it has alone: the
    # same loss, token for token, as the three sequences run one by one
    with torch.no_grad():
        torch.testing.assert_close(
            trainer._summed_losses([shared])[0][0],
            sum(trainer._summed_losses([s])[0][0] for s in alone),
        )
        torch.testing.assert_close(trainer._losses([shared, *alone])[0], trainer._losses(alone)[0])


@dataclasses.dataclass(frozen=True)
class _FixedRate:
    rate: float

    def draw(self, rng):
        return EVSConfig(mode="rate", rate=self.rate)


def test_a_chunk_is_captioned_whole_where_a_summary_would_not_prune_it(setup):
    """Chunks train as a summary captions them by default: a rate that would leave about the
    chunk's first tubelet alone (the next scene unseen) gives way to the whole chunk."""
    trainer, views = setup
    per_tubelet = views[0].embeds.shape[0] // views[0].grid_thw[0]
    video_id = trainer.rope_spec.video_token_id

    def kept_tokens(rate: float) -> set[int]:
        tasks = dataclasses.replace(trainer.tasks, mix=TaskMix(0, 0, 1, 0), evs=_FixedRate(rate))
        return {
            sequence.input_ids.count(video_id)
            for seed in range(4)
            for sequence in tasks.for_batch(views, np.random.default_rng(seed))
        }

    tubelets = [round(seconds / views[0].second_per_grid_ts) for seconds in CHUNK_SECONDS]
    # rate 0.9 would keep under two tubelets' worth of any chunk: every chunk is whole
    assert kept_tokens(0.9) <= {t * per_tubelet for t in tubelets}
    # rate 0.3 keeps 70 % of a chunk: the 3 and 4 s chunks are pruned as drawn, the 2 s one
    # would keep under two tubelets' worth and is whole
    pruned = {num_retained_tokens(t, per_tubelet, 0.3) for t in tubelets[1:]}
    assert kept_tokens(0.3) == {tubelets[0] * per_tubelet} | pruned


def test_lookback_targets_say_what_each_place_showed_a_tubelet_earlier():
    scene = next(
        s
        for s in map(lambda seed: sample_scene(seed, fps=2, mix=NARRATION_MIX), range(100))
        if s.event == "disappears" and s.motion == "none"
    )
    times = [k / 2 for k in range(round(scene.duration_s * 2))]
    labels = token_labels(scene, times, (6, 8))  # [t, h, w, 5]
    targets = lookback_targets(labels).reshape(*labels.shape[:3], 5)
    assert (targets[0, ..., :4] == NO_TARGET).all()  # nothing before the first tubelet
    torch.testing.assert_close(targets[1:, ..., :2], labels[:-1, ..., :2])
    assert (targets[1:, ..., 2] == 1).all()
    # where the subject was: after it leaves, the place shows ground but looks back on it
    subject = COLOURS_INDEX[scene.subject_object.colour]
    gone = next(t for t in range(1, len(labels)) if not (labels[t, ..., 0] == subject).any())
    place = labels[gone - 1, ..., 0] == subject
    assert place.any() and (targets[gone][place][:, 0] == subject).all()
    # it is nowhere in the tubelet: it vanished, and only there
    assert (targets[gone][place][:, 3] == PLACE_CHANGES.index("vanished")).all()
    assert (targets[..., 3] == PLACE_CHANGES.index("vanished")).sum() == place.sum()
    assert (targets[1 : gone - 1, ..., 3] == PLACE_CHANGES.index("same")).all()  # nothing moved
    # after a cut, the first tubelet says it is a cut, and nothing of what the other scene
    # showed there: a chunk's caption names what the new scene shows
    after_cut = lookback_targets(labels, previous=labels[-1]).reshape(*labels.shape[:3], 5)
    assert (after_cut[0, ..., [0, 1, 3]] == NO_TARGET).all()
    torch.testing.assert_close(after_cut[1:, ..., :4], targets[1:, ..., :4])
    assert (after_cut[0, ..., 2] == 0).all() and (after_cut[1:, ..., 2] == 1).all()
    # and every one of its tokens is in a chunk's second scene, where before a cut none is
    assert (after_cut[..., 4] == 1).all() and (targets[..., 4] == 0).all()


def _moving_subject_changes(event: str):
    """Per tubelet of a narration-mix scene whose moving subject `event`s: whether the
    subject covers most of some place, and each place's change target [t, h, w]."""
    scene = next(
        s
        for s in map(lambda seed: sample_scene(seed, fps=2, mix=NARRATION_MIX), range(200))
        if s.event == event and s.motion != "none"
    )
    times = [k / 2 for k in range(round(scene.duration_s * 2))]
    labels = token_labels(scene, times, (6, 8))
    change = lookback_targets(labels).reshape(*labels.shape[:3], 5)[..., 3]
    subject = COLOURS_INDEX[scene.subject_object.colour]
    return (labels[..., 0] == subject).any(axis=(1, 2)), change


def test_an_object_arrives_at_places_but_appears_only_where_it_was_nowhere_before():
    shown, change = _moving_subject_changes("appears")
    arrived = (change == PLACE_CHANGES.index("arrived")).any(axis=(1, 2))
    appeared = (change == PLACE_CHANGES.index("appeared")).any(axis=(1, 2))
    first = int(shown.argmax())  # the first tubelet that shows it
    assert first > 0 and appeared.sum() == 1 and appeared[first]
    assert arrived[first + 1 :].any() and not arrived[: first + 1].any()  # then it moves on


def test_a_moving_object_leaves_places_but_vanishes_only_where_it_is_gone():
    shown, change = _moving_subject_changes("disappears")
    left = (change == PLACE_CHANGES.index("left")).any(axis=(1, 2))
    vanished = (change == PLACE_CHANGES.index("vanished")).any(axis=(1, 2))
    assert left[shown].any() and not vanished[shown].any()  # moving on: it left places
    assert vanished.sum() == 1 and not shown[vanished.argmax()]  # then it is gone


def test_what_left_a_place_weighs_more_than_what_stayed():
    scene = next(
        s
        for s in map(lambda seed: sample_scene(seed, fps=2, mix=NARRATION_MIX), range(100))
        if s.event == "disappears" and s.motion == "none" and s.bystanders
    )
    times = [k / 2 for k in range(round(scene.duration_s * 2))]
    targets = torch.from_numpy(lookback_targets(token_labels(scene, times, (6, 8))))
    left = targets[:, 3] == PLACE_CHANGES.index("vanished")  # where the subject was
    stayed = (
        (targets[:, 3] == PLACE_CHANGES.index("same"))
        & (targets[:, 0] != COLOURS_INDEX[scene.subject_object.colour])
        & (targets[:, 0] < len(COLOURS))
    )  # a still object's place
    assert left.any() and stayed.any()
    has = targets[:, 0] != NO_TARGET
    for k in (0, 1):  # what the place showed: its colour, its shape
        weights = lookback_token_weights(targets, k)
        class_weights = LOOKBACK_WEIGHTS[k][targets[has, k]]
        torch.testing.assert_close(weights[left[has]], GONE_WEIGHT * class_weights[left[has]])
        torch.testing.assert_close(weights[stayed[has]], class_weights[stayed[has]])
    # the change itself is weighed by its class alone
    change = lookback_token_weights(targets, 3)
    torch.testing.assert_close(change, LOOKBACK_WEIGHTS[3][targets[targets[:, 3] != NO_TARGET, 3]])


def test_every_kept_video_token_carries_its_lookback_target(setup):
    trainer, views = setup
    clips = training_clips(training_seeds(2), trainer.preprocess)
    encoded = trainer.encode(clips)
    labelled = [
        ClipView(c.scene, c.embeds, c.grid_thw, c.second_per_grid_ts, c.labels) for c in encoded
    ]
    for task in TASKS[:3]:
        weights = {name: float(name == task) for name in TASKS}
        tasks = dataclasses.replace(trainer.tasks, mix=TaskMix(**weights))
        for sequence in tasks.for_batch(labelled, np.random.default_rng(1)):
            assert sequence.video_targets.shape == (
                sequence.video_embeds.shape[0],
                len(LOOKBACK_CLASSES),
            )
    assert trainer.config.lookback_weight > 0
    sequences = trainer.tasks.for_batch(labelled, np.random.default_rng(2))
    answers, lookback, sets = trainer._losses(sequences)
    assert torch.isfinite(answers) and torch.isfinite(lookback) and lookback > 0
    assert torch.isfinite(sets) and sets > 0


def test_answer_positions_carry_what_their_clause_is_about(setup):
    """A question's answer positions carry every object of the scene; a caption's, the
    objects of the part its clause is about: the first scene's, then from "then" on the
    second's."""
    trainer, views = setup
    tokenizer = trainer.processor.tokenizer
    crossed = 0
    for task, seed in [("questions", 3)] + [("caption", seed) for seed in range(3, 7)]:
        weights = {name: float(name == task) for name in TASKS}
        tasks = dataclasses.replace(trainer.tasks, mix=TaskMix(**weights))
        for index, sequence in enumerate(tasks.for_batch(views, np.random.default_rng(seed))):
            sets = sequence.answer_sets
            predicted = torch.tensor(sequence.labels) != IGNORE
            assert ((sets >= 0) == predicted).all()  # every answer position, no other
            if task == "questions":
                assert set(sets[predicted].tolist()) == {pairs_mask(views[index].scene.objects)}
                continue
            words = [tokenizer.decode([t]) for t in torch.tensor(sequence.labels)[predicted]]
            masks = sets[predicted].tolist()
            first = pairs_mask(views[index].scene.objects)
            second = pairs_mask(views[(index + 1) % len(views)].scene.objects)
            if "then" not in [w.strip() for w in words]:
                assert len(set(masks)) == 1 and masks[0] & ~first == 0
                continue
            cut = [w.strip() for w in words].index("then") - 1  # "; then" starts the second
            assert len(set(masks[:cut])) == 1 and masks[0] & ~first == 0
            assert len(set(masks[cut:])) == 1 and masks[-1] & ~second == 0
            crossed += 1
    assert crossed  # some chunks were across a cut


def test_sequences_are_batched_by_length_with_little_padding():
    assert length_groups([100] * 8) == [range(0, 8)]
    assert length_groups([10] * 6 + [400] * 6) == [range(0, 6), range(6, 12)]
    lengths = sorted([30, 35, 40, 250, 260, 270, 280, 600])
    groups = length_groups(lengths)
    assert [k for g in groups for k in g] == list(range(len(lengths)))
    assert sum(max(lengths[k] for k in g) * len(g) for g in groups) < 1.2 * sum(lengths) + 600


def test_a_narration_sequence_is_what_a_live_narration_runs(setup):
    trainer, views = setup
    view = next(v for v in views if v.scene.event != "none")
    processor, num_tubelets = trainer.processor, view.grid_thw[0]
    segments = [segment(view.scene, i) for i in range(num_tubelets)]
    times = [float(i) for i in range(num_tubelets)]

    def narrate(evs):
        return narration_sequence(
            processor,
            trainer.rope_spec,
            DEFAULT_NARRATE_PROMPT,
            view.embeds,
            view.grid_thw,
            times,
            segments,
            evs,
        )

    dense = narrate(None)
    assert _predicted_text(trainer, dense) == "".join(segments)
    tokens = view.embeds.shape[0] // num_tubelets
    expected = []
    for i in range(num_tubelets):
        tubelet = view.embeds[i * tokens : (i + 1) * tokens]
        item = video_item(tubelet, (1, *view.grid_thw[1:]), 1.0, None)
        if i == 0:
            expected += processor.narration_prompt(DEFAULT_NARRATE_PROMPT, item, 0.0).token_ids
        else:
            expected += processor.narration_input(item, times[i])
        expected += processor.encode(segments[i])
    assert dense.input_ids == expected[:-1]
    torch.testing.assert_close(dense.video_embeds, view.embeds)
    # every tubelet's video tokens start one past the text before them, at t = 0
    video = torch.tensor(dense.input_ids) == trainer.rope_spec.video_token_id
    starts = [k for k in range(1, len(video)) if video[k] and not video[k - 1]]
    assert len(starts) == num_tubelets
    for start in starts:
        assert dense.positions[0, start] == dense.positions[0, start - 1] + 1
        span = dense.positions[:, start : start + tokens]
        assert (span[0] == span[0, 0]).all()  # one tubelet: one temporal position
    pruned = narrate(EVSConfig(mode="threshold", threshold=0.3))
    num_video = pruned.input_ids.count(trainer.rope_spec.video_token_id)
    assert tokens <= num_video < dense.input_ids.count(trainer.rope_spec.video_token_id)
    said = _predicted_text(trainer, pruned)
    assert said.startswith(segments[0]) and said.count("\n") <= num_tubelets


def test_a_segment_ends_at_its_last_token_as_a_narration_stops(setup):
    trainer, views = setup
    processor = trainer.processor
    ends = processor.segment_end_token_ids(NarrateOptions(prompt="x").segment_end)
    for view in views:
        for index in range(view.grid_thw[0]):
            ids = processor.encode(segment(view.scene, index))
            assert [i in ends for i in ids] == [False] * (len(ids) - 1) + [True]
    assert len(processor.encode("Nothing changes.\n")) <= 3  # a still scene costs little
