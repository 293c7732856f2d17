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
from stillcut.demo.clips import narration_training_seeds, training_seeds
from stillcut.demo.narration import segment
from stillcut.demo.scenes import NARRATION_MIX
from stillcut.demo.sequences import IGNORE, narration_sequence, video_item
from stillcut.demo.tasks import TASKS, ClipView, TaskMix
from stillcut.demo.train import DemoTrainer, TrainConfig
from stillcut.demo.training_data import training_clips
from stillcut.engine.processor import DEFAULT_NARRATE_PROMPT
from stillcut.kernels.evs import EVSConfig
from stillcut.service.narrate_options import NarrateOptions

CONFIG = TrainConfig(num_clips=2, num_narration_clips=2, clips_per_step=4, questions_per_clip=2)


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
    assert len(sequences) == len(views) * (2 if task == "questions" else 1)
    video_id = trainer.rope_spec.video_token_id
    for sequence in sequences:
        assert len(sequence.labels) == len(sequence.input_ids) == sequence.positions.shape[1]
        assert sequence.input_ids.count(video_id) == sequence.video_embeds.shape[0]
        assert _predicted_text(trainer, sequence).strip()
    if task == "summary":
        assert all(s.video_embeds.numel() == 0 for s in sequences)
    loss = trainer._answer_loss(sequences)
    assert torch.isfinite(loss) and loss > 0


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
