"""Train the demo checkpoint from scratch on the synthetic task, on the CPU.

    python -m stillcut.demo.train --out DIR [--seed 0] [--vision-steps N]
        [--steps N] [--schedule-steps N] [--clips N] [--narration-clips N]
        [--clips-per-step N] [--threads 2] [--save-tower-stage FILE] [--tower-stage FILE]

The model is a transformers `Qwen2_5_VLForConditionalGeneration` (`architecture`); the vision
tower runs as stillcut's own `Qwen2_5_VLVisionTower` (the same parameters under the same names,
but it batches equal-sized frames into one attention call, tens of times faster on a CPU than
transformers' per-frame loop), the language model as transformers' own. The tower's patch
embedding starts from designed filters (`patch_init`).

Training has two stages over the same clips, each step a batch of randomly mirrored clips
(mirroring swaps left and right in the answers). First the tower alone learns what each video
token shows (the object covering most of it, and every object present in it where two meet),
through a linear head used only in training (`token_labels`): colour comes in
tens of steps, motion in a few hundred, shape in about a thousand, and answers cannot be learned
before the tower sees them (with the answers alone, a tower trained from scratch collapsed to
one constant embedding). Then the tower is frozen and every clip is encoded once, as filmed and
mirrored, so the second stage runs only the language model, at a fraction of a tower step's
cost, which buys the many steps reading shape takes. Each clip of an answer step serves one
task (`tasks`): its description and a few random question types about it (one sequence whose
questions share the video, `sequences.questions_sequence`), its narration (threshold EVS as a
live narration prunes), a chunk caption, or a summary of timed captions, each sequence pruned
by EVS its own way (`sequences`); the step's sequences run in a few batches of similar lengths.
Beside the answers, a linear head on the language model's hidden state after
`lookback_layer` layers (training only) says what each video token's place showed a tubelet
earlier and how it changed since, and in a chunk which scene a token is in
(`token_labels.lookback_targets`): the look back across tubelets that departures, still scenes
and cuts take, with an object that vanished or appeared told from one that moved (so what a
description or a narration says of it is found by presence, not by an absence). What left a
place counts `GONE_WEIGHT` times (naming what departed is reading those few places). It finds
that place by position, which the re-spread M-RoPE of `architecture` makes possible (with
Qwen2.5-VL's plain layout the loss helped little). A second head, on the last hidden state at
every answer position of a question (the description among them) or a caption
(`TrainConfig.set_weight`), says which objects the clause being written is about: the
scene's, or the caption part's (a chunk's second scene listed with the first one's objects,
or a still object left out, were most wrong captions). The answer stage also encodes clips
drawn from the narration mix (`scenes.NARRATION_MIX`, seeds of their own), so
that appearances and departures are common among the narrations; the tower stage sees only
the first set. The result is saved in bf16 with `save_pretrained`: a Hugging Face checkpoint
like any other.

Given its seed, training is deterministic on one torch build, thread count and instruction set:
the data comes from seeded numpy, single-threaded x264 and PIL, and the steps from seeded torch
with deterministic algorithms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Waiting threads sleep instead of spinning: on a shared machine a spinning thread takes the
# core its partner needs (steps ran 2-3x slower here). It must be set before torch loads
# OpenMP, and changes no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.nn.functional as F

from stillcut.demo import architecture
from stillcut.demo.clips import narration_training_seeds, training_seeds
from stillcut.demo.patch_init import init_patch_embedding
from stillcut.demo.questions import QUESTION_TYPES
from stillcut.demo.scenes import NARRATION_MIX, Scene, mirrored
from stillcut.demo.sequences import IGNORE, EVSSchedule, Sequence
from stillcut.demo.tasks import ClipView, TaskMix, TaskSequences
from stillcut.demo.token_labels import (
    COLOUR_CLASSES,
    GROUND_CLASSES,
    LOOKBACK_CLASSES,
    MOTION_CLASSES,
    NO_TARGET,
    NUM_LABELS,
    PAIRS,
    PLACE_CHANGES,
    SHAPE_CLASSES,
    mirrored_labels,
    present_pairs,
)
from stillcut.demo.training_data import SAMPLE_FPS, TrainingClip, training_clips
from stillcut.disk_cache import atomic_folder
from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.models.qwen2_vl.positions import MRopeSpec
from stillcut.engine.models.qwen2_vl.preprocess import VideoPreprocessConfig, preprocess_video
from stillcut.engine.models.qwen2_vl.tower_2_5 import Qwen2_5_VLVisionTower
from stillcut.engine.processor import PromptProcessor
from stillcut.kernels.evs.config import DEFAULT_RATE

# Bump when the task, its answers or the token labels change (the recipe is stored beside)
TASK_VERSION = 6
# Bump (with TASK_VERSION) when the clips or their token labels change: what the tower stage
# learns from, so a saved tower stage must match it. The answers' wording is not part of it.
TOWER_TASK_VERSION = 5
AUX_CLASSES = (COLOUR_CLASSES, SHAPE_CLASSES, MOTION_CLASSES, GROUND_CLASSES)
# Most tokens show only ground, and few the moving object: class weights make up for it.
AUX_WEIGHTS = (
    torch.tensor([1.0] * (COLOUR_CLASSES - 1) + [0.25]),
    torch.tensor([1.0] * (SHAPE_CLASSES - 1) + [0.25]),
    torch.tensor([4.0, 4.0, 4.0, 4.0, 1.0, 0.25]),  # left, right, up, down, still, none
    torch.tensor([1.0, 1.0]),  # flat, textured
)
# Colour is learned in tens of steps and motion in hundreds, shape last: its loss counts three
# times. The ground is one flat-or-textured call per frame, learned early: its loss counts half,
# so that its gradient does not take the clipped update's share that shape needs (with it at
# full weight and shape at double, a linear probe read shape off 57 % of object tokens after 800
# tower steps; without the ground label, 78 %).
AUX_LOSS_WEIGHTS = (1.0, 3.0, 1.0, 0.5)
# Where two objects share a token, the labels above name only the one covering more of it.
# The pairs-present head names every object covering a tenth of it (binary cross-entropy per
# pair, summed), so the tower keeps both in the token's embedding: objects near another were
# the ones descriptions left out.
PRESENT_LOSS_WEIGHT = 1.0
# The lookback targets' class weights: most places show ground and stay the same.
LOOKBACK_WEIGHTS = (
    AUX_WEIGHTS[0],
    AUX_WEIGHTS[1],
    torch.tensor([1.0, 1.0]),  # a cut, the same scene (captions only)
    # same, arrived, left, replaced, vanished, appeared
    torch.tensor([0.25, 1.0, 1.0, 1.0, 1.0, 1.0]),
    torch.tensor([1.0, 1.0]),  # a chunk's first scene, its second (captions only)
)
# What a place showed a tubelet earlier counts this many times more where it is gone now (an
# object left, vanished or was replaced): naming what left is reading those few places, and
# among the many places whose object stayed they taught the head too little to be found
# reliably.
GONE_WEIGHT = 4.0
_GONE = [PLACE_CHANGES.index(name) for name in ("left", "replaced", "vanished")]


def lookback_token_weights(targets: torch.Tensor, k: int) -> torch.Tensor:
    """The loss weights of the tokens that have lookback target `k` (`targets` [n, 5], in
    order): the target's class weight, and for what the place showed (k < 2) that times
    `GONE_WEIGHT` where the place's object is gone now."""
    has = targets[:, k] != NO_TARGET
    weights = LOOKBACK_WEIGHTS[k][targets[has, k]]
    if k < 2:
        gone = torch.isin(targets[has, 3], torch.tensor(_GONE))
        weights = torch.where(gone, GONE_WEIGHT, 1.0) * weights
    return weights


@dataclass(frozen=True)
class TrainConfig:
    """The whole training recipe; with the seed it determines the checkpoint."""

    seed: int = 0
    num_clips: int = 1200
    num_narration_clips: int = 600  # from the narration mix, for the answer stage only
    vision_steps: int = 1600  # first the tower alone learns what each token shows
    steps: int = 3000  # then the language model learns the answers, the tower frozen
    # The answer stage's learning-rate schedule spans this many steps (None: `steps`), so a
    # run stopped early is the same as a full one up to where it stopped.
    schedule_steps: int | None = None
    clips_per_step: int = 12
    questions_per_clip: int = 3
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    threads: int = 2
    tasks: TaskMix = field(default_factory=TaskMix)
    # Rate pruning for questions and chunks, a quarter of them at the rate a request that names
    # no EVS gets: describe at that rate had missed departures that it named with EVS off.
    evs: EVSSchedule = field(
        default_factory=lambda: EVSSchedule(default_share=0.25, default_value=DEFAULT_RATE)
    )
    narration_evs: EVSSchedule = field(
        default_factory=lambda: EVSSchedule(unpruned_share=0.2, max_value=0.3, mode="threshold")
    )
    # The language model's auxiliary loss: from the hidden state after this many layers, a
    # linear head (training only) says what each video token's place showed a tubelet earlier
    # (`token_labels.lookback_targets`); its mean cross-entropy counts this much (0: off).
    lookback_layer: int = 2
    lookback_weight: float = 1.0
    # The language model's second auxiliary loss: from the last hidden state at each answer
    # position, a linear head (training only) says which colour-shape pairs the clause being
    # written is about (a question's scene, a caption part's objects); its mean binary
    # cross-entropy counts this much (0: off).
    set_weight: float = 1.0
    log_every: int = 50

    def __post_init__(self) -> None:
        for name in ("num_clips", "steps", "clips_per_step", "threads", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.schedule_steps is not None and self.schedule_steps < self.steps:
            raise ValueError(f"schedule_steps={self.schedule_steps}: must be >= steps={self.steps}")
        for name in ("vision_steps", "num_narration_clips"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.evs.mode != "rate" or self.narration_evs.mode != "threshold":
            raise ValueError("evs must be a rate schedule and narration_evs a threshold one")
        if not 1 <= self.questions_per_clip <= len(QUESTION_TYPES):
            raise ValueError(
                f"questions_per_clip={self.questions_per_clip}: allowed 1..{len(QUESTION_TYPES)}"
            )
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate={self.learning_rate}: must be > 0")
        if not 1 <= self.lookback_layer <= architecture.TEXT["num_hidden_layers"]:
            raise ValueError(f"lookback_layer={self.lookback_layer}: allowed 1..num layers")
        for name in ("warmup_steps", "weight_decay", "lookback_weight", "set_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")


@dataclass(frozen=True)
class EncodedClip:
    """A training clip as the answer stage sees it: its scene and the frozen tower's
    embeddings [t*h*w, hidden] of its frames as filmed and mirrored."""

    scene: Scene
    embeds: torch.Tensor
    mirrored_embeds: torch.Tensor
    grid_thw: tuple[int, int, int]
    second_per_grid_ts: float
    labels: np.ndarray  # what each merged token shows, [t, h, w, 4] (`token_labels`)


class DemoTrainer:
    """The model being trained and the stillcut pieces that feed it, for one checkpoint
    folder that holds everything but the weights (`architecture.write_skeleton`)."""

    def __init__(self, folder: Path, config: TrainConfig) -> None:
        from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

        self.config = config
        self.processor = PromptProcessor.from_checkpoint(folder)
        self.preprocess = VideoPreprocessConfig.from_checkpoint(folder)
        model_config = load_model_config(folder)
        self.rope_spec = MRopeSpec(
            model_config.image_token_id,
            model_config.video_token_id,
            tokens_per_second=model_config.vision.tokens_per_second,
        )
        torch.manual_seed(config.seed)
        self.model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(folder))
        self.tower = Qwen2_5_VLVisionTower(model_config.vision)
        self.tower.load_state_dict(self.model.model.visual.state_dict())  # transformers' init
        init_patch_embedding(self.tower.patch_embed.proj.weight)
        self.language_model = self.model.model.language_model
        self.aux_head = torch.nn.Linear(
            model_config.vision.out_hidden_size, sum(AUX_CLASSES) + PAIRS
        )
        self.lookback_head = torch.nn.Linear(
            architecture.TEXT["hidden_size"], sum(LOOKBACK_CLASSES)
        )
        self.set_head = torch.nn.Linear(architecture.TEXT["hidden_size"], PAIRS)
        self.tasks = TaskSequences(
            self.processor,
            self.rope_spec,
            config.tasks,
            config.questions_per_clip,
            config.evs,
            config.narration_evs,
        )

    def train_tower(self, clips: list[TrainingClip], rng: np.random.Generator) -> None:
        """The tower and the token head learn what each token shows."""
        optimizer = self._optimizer([self.tower, self.aux_head])
        self._stage(
            "vision", self.config.vision_steps, None, clips, rng, optimizer, self.vision_step
        )

    def encode(self, clips: list[TrainingClip]) -> list[EncodedClip]:
        """Every clip through the frozen tower, as filmed and mirrored."""
        self.tower.requires_grad_(False)
        encoded = []
        with torch.no_grad():
            for start in range(0, len(clips), self.config.clips_per_step):
                batch = clips[start : start + self.config.clips_per_step]
                embeds, prepared = self._encode(batch, np.zeros(len(batch), bool))
                mirrored_embeds, _ = self._encode(batch, np.ones(len(batch), bool))
                sizes = [t * h * w // 4 for t, h, w in (p.grid_thw for p in prepared)]
                for clip, video, plain, flipped in zip(
                    batch, prepared, embeds.split(sizes), mirrored_embeds.split(sizes), strict=True
                ):
                    encoded.append(
                        EncodedClip(
                            clip.scene,
                            plain,
                            flipped,
                            video.grid_thw,
                            video.second_per_grid_ts,
                            clip.labels,
                        )
                    )
        return encoded

    def train_answers(self, clips: list[EncodedClip], rng: np.random.Generator) -> None:
        """The language model learns the answers about the frozen tower's embeddings."""
        optimizer = self._optimizer([self.language_model, self.lookback_head, self.set_head])
        steps, schedule_steps = self.config.steps, self.config.schedule_steps
        self._stage("answer", steps, schedule_steps, clips, rng, optimizer, self.answer_step)

    def vision_step(self, clips: list[TrainingClip], rng: np.random.Generator) -> dict:
        """The token head's loss on a batch of randomly mirrored clips."""
        flips = rng.random(len(clips)) < 0.5
        embeds, _ = self._encode(clips, flips)
        labels = [
            mirrored_labels(c.labels) if flip else c.labels
            for c, flip in zip(clips, flips, strict=True)
        ]
        labels = torch.from_numpy(np.stack(labels)).view(-1, NUM_LABELS)
        loss, shape_accuracy = self._token_loss(embeds, labels)
        return {"token loss": loss, "object shape right": shape_accuracy}

    def answer_step(self, clips: list[EncodedClip], rng: np.random.Generator) -> dict:
        """The answers' loss on one task for each of a batch of randomly mirrored clips."""
        lookback = self.config.lookback_weight > 0
        views = [
            ClipView(
                mirrored(clip.scene) if flip else clip.scene,
                clip.mirrored_embeds if flip else clip.embeds,
                clip.grid_thw,
                clip.second_per_grid_ts,
                (mirrored_labels(clip.labels) if flip else clip.labels) if lookback else None,
            )
            for clip, flip in zip(clips, rng.random(len(clips)) < 0.5, strict=True)
        ]
        answers, looked, sets = self._losses(self.tasks.for_batch(views, rng))
        losses = {"answer loss": answers}
        if lookback:
            losses["lookback loss"] = self.config.lookback_weight * looked
        if self.config.set_weight > 0:
            losses["set loss"] = self.config.set_weight * sets
        return losses

    def _stage(self, name, steps, schedule_steps, clips, rng, optimizer, step) -> None:
        started, logged = time.perf_counter(), []
        for index in range(steps):
            scale = _schedule(index, schedule_steps or steps, self.config.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = self.config.learning_rate * scale
            batch = rng.choice(len(clips), self.config.clips_per_step, replace=False)
            losses = step([clips[i] for i in batch], rng)
            _update(optimizer, sum(v for k, v in losses.items() if k.endswith("loss")))
            logged.append({k: v.item() for k, v in losses.items()})
            if (index + 1) % self.config.log_every == 0 or index + 1 == steps:
                means = "  ".join(f"{k} {np.mean([d[k] for d in logged]):.4f}" for k in logged[0])
                elapsed = time.perf_counter() - started
                print(f"  {name} step {index + 1}/{steps}  {means}  {elapsed:.0f} s", flush=True)
                logged = []

    def _optimizer(self, modules: list[torch.nn.Module]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            _parameter_groups(modules, self.config.weight_decay),
            lr=self.config.learning_rate,
            betas=(0.9, 0.98),
            foreach=True,
        )

    def _encode(self, clips: list[TrainingClip], flips: np.ndarray):
        """Encode `clips` in one tower pass, those flagged in `flips` mirrored.

        Returns the embeddings [num_tokens, hidden] and each clip's patches.
        """
        prepared = [
            preprocess_video(
                np.ascontiguousarray(c.frames[:, :, ::-1] if flip else c.frames),
                SAMPLE_FPS,
                self.preprocess,
            )
            for c, flip in zip(clips, flips, strict=True)
        ]
        grids = torch.tensor([p.grid_thw for p in prepared])
        return self.tower(torch.cat([p.patches for p in prepared]), grids), prepared

    def _token_loss(self, embeds: torch.Tensor, labels: torch.Tensor):
        """Cross-entropy of the auxiliary head's colour, shape, motion and ground guesses per
        token plus its pairs-present binary cross-entropy, `embeds` [num_tokens, hidden] and
        `labels` [num_tokens, NUM_LABELS]; and, for the log, the share of tokens showing an
        object whose shape the head gets right."""
        *parts, present = self.aux_head(embeds).split((*AUX_CLASSES, PAIRS), dim=-1)
        loss = sum(
            loss_weight * F.cross_entropy(part, labels[:, k], weight=class_weights)
            for k, (part, class_weights, loss_weight) in enumerate(
                zip(parts, AUX_WEIGHTS, AUX_LOSS_WEIGHTS, strict=True)
            )
        )
        pairs = torch.from_numpy(present_pairs(labels[:, len(AUX_CLASSES)].numpy()))
        bce = F.binary_cross_entropy_with_logits(present, pairs, reduction="none")
        loss = loss + PRESENT_LOSS_WEIGHT * bce.sum(-1).mean()
        shape = labels[:, 1]
        shown = shape != SHAPE_CLASSES - 1
        right = parts[1].detach().argmax(-1)[shown] == shape[shown]
        return loss, right.float().mean() if right.numel() else torch.tensor(1.0)

    def _losses(self, sequences: list[Sequence]) -> tuple[torch.Tensor, ...]:
        """Mean cross-entropy of every predicted token, and the lookback head's: per target
        (`LOOKBACK_CLASSES`) its class-weighted mean over the video tokens that have it, those
        means averaged (zero if no token has a target); and the set head's mean binary
        cross-entropy over the answer positions that have a set. The sequences run in a few padded
        batches of similar lengths (`length_groups`), so little of the work is padding."""
        ordered = sorted(sequences, key=lambda s: len(s.input_ids))
        sums = torch.zeros(2 + len(LOOKBACK_CLASSES))
        counts = torch.zeros(2 + len(LOOKBACK_CLASSES))
        for group in length_groups([len(s.input_ids) for s in ordered]):
            group_sums, group_counts = self._summed_losses([ordered[i] for i in group])
            sums, counts = sums + group_sums, counts + group_counts
        means = sums / counts.clamp(min=1e-9)
        looked = counts[1:-1] > 0
        lookback = means[1:-1][looked].mean() if looked.any() else torch.zeros(())
        return means[0], lookback, means[-1]

    def _summed_losses(self, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy of the predicted tokens of `sequences`; per lookback target,
        the class-weighted sum over the video tokens that have it; and the set head's binary
        cross-entropy (its mean over the pairs) summed over the answer positions that have a
        set; and their counts (summed class weights, positions), the batch padded on the
        right."""
        length = max(len(s.input_ids) for s in sequences)
        batch = len(sequences)
        input_ids = torch.zeros(batch, length, dtype=torch.long)
        positions = torch.zeros(3, batch, length, dtype=torch.long)
        attention = torch.stack([s.attention(length) for s in sequences])[:, None]
        target_ids = torch.full((batch, length), IGNORE, dtype=torch.long)
        answer_sets = torch.full((batch, length), -1, dtype=torch.long)
        for row, s in enumerate(sequences):
            n = len(s.input_ids)
            input_ids[row, :n] = torch.tensor(s.input_ids)
            positions[:, row, :n] = s.positions
            target_ids[row, :n] = torch.tensor(s.labels)
            if s.answer_sets is not None:
                answer_sets[row, :n] = s.answer_sets
        text = self.language_model.embed_tokens(input_ids)  # [batch, length, hidden]
        is_video = input_ids == self.rope_spec.video_token_id
        video = torch.cat([s.video_embeds for s in sequences])  # [num_video_tokens, hidden]
        inputs = text.masked_scatter(is_video[..., None], video)
        looks_back = self.config.lookback_weight > 0 and all(
            s.video_targets is not None or not s.video_embeds.numel() for s in sequences
        )
        output = self.language_model(
            inputs_embeds=inputs,
            attention_mask=attention,
            position_ids=positions,
            output_hidden_states=[self.config.lookback_layer] if looks_back else False,
        )
        scored = target_ids != IGNORE
        logits = self.model.lm_head(output.last_hidden_state[scored])  # [num_scored, vocab]
        sums = [F.cross_entropy(logits, target_ids[scored], reduction="sum")]
        counts = [scored.sum().float()]
        if looks_back and is_video.any():
            targets = torch.cat([s.video_targets for s in sequences if s.video_embeds.numel()])
            hidden = output.hidden_states[self.config.lookback_layer][is_video]
            parts = self.lookback_head(hidden).split(LOOKBACK_CLASSES, dim=-1)
            for k, part in enumerate(parts):
                has = targets[:, k] != NO_TARGET
                token_weights = lookback_token_weights(targets, k)
                losses = F.cross_entropy(part[has], targets[has, k], reduction="none")
                sums.append((losses * token_weights).sum())
                counts.append(token_weights.sum())
        else:
            sums += [torch.zeros(())] * len(LOOKBACK_CLASSES)
            counts += [torch.zeros(())] * len(LOOKBACK_CLASSES)
        has_set = answer_sets >= 0
        if self.config.set_weight > 0 and has_set.any():
            truth = torch.from_numpy(present_pairs(answer_sets[has_set].numpy()))
            guess = self.set_head(output.last_hidden_state[has_set])
            bce = F.binary_cross_entropy_with_logits(guess, truth, reduction="none")
            sums.append(bce.mean(-1).sum())
            counts.append(has_set.sum().float())
        else:
            sums.append(torch.zeros(()))
            counts.append(torch.zeros(()))
        return torch.stack(sums), torch.stack(counts)

    def save(self, folder: Path) -> None:
        """Write the weights (bf16) and the configs into `folder`."""
        self.model.model.visual.load_state_dict(self.tower.state_dict())
        self.model.to(torch.bfloat16).save_pretrained(folder)


# The recipe fields the tower stage depends on: a saved tower stage is reused only under the
# same values (with the same task version, vision tower shape and torch build).
TOWER_STAGE_FIELDS = (
    "seed",
    "num_clips",
    "num_narration_clips",
    "vision_steps",
    "clips_per_step",
    "learning_rate",
    "warmup_steps",
    "weight_decay",
    "threads",
)


def tower_stage_key(config: TrainConfig) -> dict:
    """What a saved tower stage must have been made with to stand in for this run's."""
    recipe = {name: getattr(config, name) for name in TOWER_STAGE_FIELDS}
    return {
        "tower_task_version": TOWER_TASK_VERSION,
        "vision": dict(architecture.VISION),
        "torch": str(torch.__version__),
        "recipe": recipe,
    }


def train_checkpoint(
    out: str | Path,
    config: TrainConfig = TrainConfig(),
    tower_stage: str | Path | None = None,
    save_tower_stage: str | Path | None = None,
) -> dict[str, float]:
    """Train a demo checkpoint into `out` (a new or empty folder); returns the timings.
    The caller's torch threads, determinism flag and random state are left as they were.

    `save_tower_stage` writes the trained tower, its token head and the random state after the
    tower stage to a file; `tower_stage` starts from such a file instead of training the tower
    (the clips are rendered again: they are deterministic). Both give the checkpoint a full
    run gives. A recipe search over answer-stage settings then pays for the tower once.
    """
    folder = Path(out)
    metadata = {"task_version": TASK_VERSION, "recipe": asdict(config)}
    wall, cpu = time.perf_counter(), _cpu_seconds()
    saved = None if tower_stage is None else _load_tower_stage(Path(tower_stage), config)
    with _reproducible(config.threads), atomic_folder(folder, exist_ok=False) as partial:
        architecture.write_skeleton(partial, metadata)
        trainer = DemoTrainer(partial, config)
        print(f"rendering {config.num_clips} + {config.num_narration_clips} clips", flush=True)
        clips = training_clips(
            training_seeds(config.num_clips), trainer.preprocess, workers=config.threads
        )
        narration_clips = training_clips(
            narration_training_seeds(config.num_narration_clips),
            trainer.preprocess,
            mix=NARRATION_MIX,
            workers=config.threads,
        )
        data_wall, data_cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
        rng = np.random.default_rng([config.seed, 2])
        if saved is None:
            print(f"training {config.vision_steps} + {config.steps} steps", flush=True)
            trainer.train_tower(clips, rng)
        else:
            print(f"the saved tower stage, then {config.steps} steps", flush=True)
            trainer.tower.load_state_dict(saved["tower"])
            trainer.aux_head.load_state_dict(saved["token_head"])
            rng.bit_generator.state = json.loads(saved["rng"])
        if save_tower_stage is not None:
            _save_tower_stage(Path(save_tower_stage), trainer, rng, config)
        trainer.train_answers(trainer.encode(clips + narration_clips), rng)
        trainer.save(partial)
    timings = {
        "data_wall_s": data_wall,
        "data_cpu_s": data_cpu,
        "total_wall_s": time.perf_counter() - wall,
        "total_cpu_s": _cpu_seconds() - cpu,
    }
    print(", ".join(f"{name} {value:.0f}" for name, value in timings.items()))
    return timings


def _save_tower_stage(
    path: Path, trainer: DemoTrainer, rng: np.random.Generator, config: TrainConfig
) -> None:
    stage = {
        "key": tower_stage_key(config),
        "tower": trainer.tower.state_dict(),
        "token_head": trainer.aux_head.state_dict(),
        "rng": json.dumps(rng.bit_generator.state),  # 128-bit integers: kept as text
    }
    partial = path.with_name(path.name + ".partial")
    torch.save(stage, partial)
    partial.replace(path)


def _load_tower_stage(path: Path, config: TrainConfig) -> dict:
    """A saved tower stage, checked against the run's recipe. Only tensors, numbers and strings
    are read (`weights_only`), so a file from elsewhere cannot run code."""
    stage = torch.load(path, weights_only=True)
    if stage.get("key") != tower_stage_key(config):
        raise ValueError(
            f"{path}: the tower stage was made with {stage.get('key')}, "
            f"this run needs {tower_stage_key(config)}"
        )
    return stage


PADDING_COST = 256  # a batch's fixed cost, in tokens, when splitting sequences by length


def length_groups(lengths: list[int]) -> list[range]:
    """Split `lengths` (ascending) into consecutive groups, each run as one batch padded to its
    longest, minimising the padded tokens plus `PADDING_COST` per batch."""
    best = [0.0] + [math.inf] * len(lengths)  # best[k]: the cost of the first k
    cut = [0] * (len(lengths) + 1)
    for end in range(1, len(lengths) + 1):
        for start in range(end):
            cost = best[start] + PADDING_COST + lengths[end - 1] * (end - start)
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(lengths)
    while end:
        groups.append(range(cut[end], end))
        end = cut[end]
    return groups[::-1]


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the rendering processes)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@contextlib.contextmanager
def _reproducible(threads: int) -> Iterator[None]:
    """Run with `threads` torch threads, deterministic algorithms and a forked random state."""
    previous = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(previous[0])
        torch.use_deterministic_algorithms(previous[1])


def _update(optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(
        [p for group in optimizer.param_groups for p in group["params"]], 1.0
    )
    optimizer.step()


def _schedule(step: int, steps: int, warmup_steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _parameter_groups(modules: list[torch.nn.Module], weight_decay: float) -> list[dict]:
    """Matrices decay; norms, biases and other vectors do not."""
    params = [p for module in modules for p in module.parameters()]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    parser.add_argument(
        "--save-tower-stage", type=Path, help="also write the trained tower stage to this file"
    )
    parser.add_argument(
        "--tower-stage", type=Path, help="start from a saved tower stage (same tower recipe)"
    )
    defaults = TrainConfig()
    names = ("seed", "vision_steps", "steps", "schedule_steps", "num_clips", "num_narration_clips")
    for name in (*names, "clips_per_step", "threads"):
        flag = f"--{name.removeprefix('num_').replace('_', '-')}"
        parser.add_argument(flag, dest=name, type=int, default=getattr(defaults, name))
    args = parser.parse_args()
    stages = ("out", "tower_stage", "save_tower_stage")
    overrides = {k: v for k, v in vars(args).items() if k not in stages}
    train_checkpoint(args.out, TrainConfig(**overrides), args.tower_stage, args.save_tower_stage)


if __name__ == "__main__":
    main()
