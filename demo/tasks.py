"""The answer stage's tasks: the training sequences a batch of encoded clips gives.

Each clip of a batch serves one task, drawn by `TaskMix`: its description and a few other
questions about it (one sequence, `questions_sequence`), its narration, the caption of a chunk
cut from it and the next clip of the batch played after it (half the chunks straddle the cut
between the two; pruned as a summary prunes a chunk by default, so never down to a first
tubelet that cannot show the next scene), or the summary of the timed captions of a few clips
played one after another (text only: the true captions, as a long-video summary would pass
the model's own). Every prompt is the one stillcut sends (`sequences`). The answer positions of
a question (the description among them) or a caption carry the objects their clause is about
(`Sequence.answer_sets`): the scene's, or each caption part's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from stillcut.demo.captions import (
    CHUNK_SECONDS,
    THEN,
    ScenePart,
    chunk_caption,
    chunk_parts,
    draw_chunk,
    summary,
)
from stillcut.demo.chunk_prompts import TimedCaption, aggregation_messages, chunk_caption_messages
from stillcut.demo.narration import segment
from stillcut.demo.questions import PROMPTS, QUESTION_TYPES, answer
from stillcut.demo.scenes import DURATION_S, Scene
from stillcut.demo.sequences import (
    MERGE_SIZE,
    EVSSchedule,
    Sequence,
    answer_sequence,
    narration_sequence,
    pruned_video,
    questions_sequence,
)
from stillcut.demo.token_labels import NO_TARGET, lookback_targets, pair_index
from stillcut.engine.models.qwen2_vl.positions import MRopeSpec
from stillcut.engine.processor import DEFAULT_NARRATE_PROMPT, PromptProcessor
from stillcut.vision.pixel_stage import merged_grid
from stillcut.vision.summary.chunks import chunk_evs

TASKS = ("questions", "narration", "caption", "summary")
MAX_OFFSET_SCENES = 10  # a sequence of scenes starts up to this many scenes into its video
SUMMARY_SCENES = (2, 3)


def summary_hints() -> dict[str, float | int]:
    """What the chunk tasks train on, for long-video summaries to keep to (config.json's
    `stillcut_summary`): the longest chunk captioned, and the most captions summarised at
    once (the most scenes of a summary, in chunks of the shortest length)."""
    longest = max(SUMMARY_SCENES) * DURATION_S
    return {
        "chunk_s": float(max(CHUNK_SECONDS)),
        "captions_per_round": math.ceil(longest / min(CHUNK_SECONDS)),
    }


def pairs_mask(objects) -> int:
    """The bit mask of the colour-shape pairs of `objects` (`token_labels.pair_index`)."""
    mask = 0
    for obj in objects:
        mask |= 1 << pair_index(obj.colour, obj.shape)
    return mask


def part_mask(part: ScenePart) -> int:
    """The pairs mask of the objects a chunk's part shows at any of its sampled frames."""
    times = part.frame_times()
    return pairs_mask(o for o in part.scene.objects if any(o.shown(t) for t in times))


@dataclass(frozen=True)
class TaskMix:
    """How often a clip of a batch serves each task (relative weights)."""

    questions: float = 0.55
    narration: float = 0.25
    caption: float = 0.45
    summary: float = 0.05

    def __post_init__(self) -> None:
        for name in TASKS:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if not sum(getattr(self, name) for name in TASKS) > 0:
            raise ValueError("TaskMix: at least one task needs a weight > 0")

    def draw(self, rng: np.random.Generator) -> str:
        weights = np.array([getattr(self, name) for name in TASKS])
        return TASKS[int(rng.choice(len(TASKS), p=weights / weights.sum()))]


@dataclass(frozen=True)
class ClipView:
    """An encoded clip as one step sees it (perhaps mirrored): its scene and the tower's
    embeddings [t*h*w, hidden] of its frames, patch grid `grid_thw`."""

    scene: Scene
    embeds: torch.Tensor
    grid_thw: tuple[int, int, int]
    second_per_grid_ts: float
    # what each merged token shows ([t, h, w, 4], `token_labels`), for the lookback targets
    # (`token_labels.lookback_targets`); None: the sequences carry none
    labels: np.ndarray | None = None

    def lookback(self, previous: np.ndarray | None = None, cuts: bool = False):
        """The lookback targets [t*h*w, 5] of the clip's tokens (None without labels), after
        a cut from a scene whose last tubelet's labels are `previous`. Only chunks (`cuts`)
        may hold a cut, so elsewhere the cut and part targets are left out: always "the same
        scene", they would only teach the head that there never is one."""
        if self.labels is None:
            return None
        targets = torch.from_numpy(lookback_targets(self.labels, previous))
        if not cuts:
            targets[:, [2, 4]] = NO_TARGET
        return targets


@dataclass(frozen=True)
class TaskSequences:
    """Builds each task's sequences with the checkpoint's processor."""

    processor: PromptProcessor
    rope_spec: MRopeSpec
    mix: TaskMix
    questions_per_clip: int
    evs: EVSSchedule  # rate mode: questions and chunks
    narration_evs: EVSSchedule  # threshold mode

    def for_batch(self, views: list[ClipView], rng: np.random.Generator) -> list[Sequence]:
        """The sequences of one step: one task per clip, the next clip its partner."""
        sequences = []
        for index, view in enumerate(views):
            partner = views[(index + 1) % len(views)]
            task = self.mix.draw(rng)
            if task == "questions":
                sequences += self.questions(view, rng)
            elif task == "narration":
                sequences.append(self.narration(view, rng))
            elif task == "caption":
                sequences.append(self.caption(view, partner, rng))
            else:
                count = min(len(views), int(rng.choice(SUMMARY_SCENES)))
                chosen = rng.choice(len(views), count, replace=False)
                sequences.append(self.summary([views[i].scene for i in chosen], rng))
        return sequences

    def questions(self, view: ClipView, rng: np.random.Generator) -> list[Sequence]:
        """The description and `questions_per_clip - 1` other question types, each worded at
        random, about the clip pruned one way, in one sequence (`questions_sequence`)."""
        others = [kind for kind in QUESTION_TYPES if kind != "describe"]
        kinds = ["describe", *rng.choice(others, self.questions_per_clip - 1, replace=False)]
        item, targets = pruned_video(
            view.embeds, view.grid_thw, view.second_per_grid_ts, self.evs.draw(rng), view.lookback()
        )
        prompts, answers = [], []
        for kind in map(str, kinds):
            question = PROMPTS[kind][int(rng.integers(len(PROMPTS[kind])))]
            prompts.append(self.processor.build_text(question, [item]))
            answers.append(answer(view.scene, kind))
        masks = [pairs_mask(view.scene.objects)] * len(answers)
        return [
            questions_sequence(
                self.processor, self.rope_spec, prompts, answers, targets, answer_masks=masks
            )
        ]

    def narration(self, view: ClipView, rng: np.random.Generator) -> Sequence:
        num_tubelets = view.grid_thw[0]
        return narration_sequence(
            self.processor,
            self.rope_spec,
            DEFAULT_NARRATE_PROMPT,
            view.embeds,
            view.grid_thw,
            [i * view.second_per_grid_ts for i in range(num_tubelets)],
            [segment(view.scene, i) for i in range(num_tubelets)],
            self.narration_evs.draw(rng),
            view.lookback(),
        )

    def caption(self, first: ClipView, second: ClipView, rng: np.random.Generator) -> Sequence:
        """A chunk of `first` played before `second`: inside `first` or across the cut."""
        start_s, end_s = draw_chunk(rng, first.scene.duration_s)
        parts = chunk_parts(first.scene, second.scene, start_s, end_s)
        seconds = first.second_per_grid_ts  # per tubelet
        start, end = round(start_s / seconds), round(end_s / seconds)
        tokens = first.embeds.shape[0] // first.grid_thw[0]
        rows = slice(start * tokens, end * tokens)
        embeds = torch.cat([first.embeds, second.embeds])[rows]
        targets = None
        if first.labels is not None and second.labels is not None:
            following = second.lookback(first.labels[-1], cuts=True)
            targets = torch.cat([first.lookback(cuts=True), following])[rows]
            targets[:tokens] = NO_TARGET  # the chunk's first tubelet: nothing before it
        grid = (end - start, *first.grid_thw[1:])
        # As a summary prunes a chunk by default: whole where a rate would leave about its
        # first tubelet alone, so no caption is trained on a scene it cannot see
        evs = chunk_evs(self.evs.draw(rng), merged_grid(grid, MERGE_SIZE), whole_short=True)
        item, targets = pruned_video(embeds, grid, seconds, evs, targets)
        offset = int(rng.integers(0, MAX_OFFSET_SCENES)) * first.scene.duration_s
        messages = chunk_caption_messages(offset + start_s, offset + end_s)
        prompt = self.processor.build(messages, [item])
        text = chunk_caption(parts)
        clauses = text.split(THEN)
        pieces = [
            (clause if k == 0 else THEN + clause, part_mask(part))
            for k, (clause, part) in enumerate(zip(clauses, parts, strict=True))
        ]
        return answer_sequence(self.processor, self.rope_spec, prompt, text, targets, pieces)

    def summary(self, scenes: list[Scene], rng: np.random.Generator) -> Sequence:
        """The summary of `scenes` played one after another, captioned in equal chunks."""
        length = float(rng.choice(CHUNK_SECONDS))
        offset = int(rng.integers(0, MAX_OFFSET_SCENES)) * scenes[0].duration_s
        starts = np.cumsum([0.0] + [s.duration_s for s in scenes])  # each scene's start
        captions, start = [], 0.0
        while start < starts[-1]:
            end = min(start + length, starts[-1])
            parts = [
                ScenePart(scene, max(start, s0) - s0, min(end, s1) - s0)
                for scene, s0, s1 in zip(scenes, starts[:-1], starts[1:], strict=True)
                if s0 < end and start < s1
            ]
            captions.append(TimedCaption(offset + start, offset + end, chunk_caption(parts)))
            start = end
        prompt = self.processor.build(aggregation_messages(captions))
        return self._answer(prompt, summary([c.text for c in captions]))

    def _answer(self, prompt, text: str) -> Sequence:
        return answer_sequence(self.processor, self.rope_spec, prompt, text)
