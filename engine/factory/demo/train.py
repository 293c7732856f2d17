"""Train the demo checkpoint from scratch on the synthetic task, on the CPU.

    python -m stillcut.engine.factory.demo.train --out DIR [--seed 0] [--steps N] [--clips N]

The model is a transformers `Qwen2_5_VLForConditionalGeneration` (`architecture`); the vision
tower runs as stillcut's own `Qwen2_5_VLVisionTower` (the same parameters under the same names,
but it batches equal-sized frames into one attention call, tens of times faster on a CPU than
transformers' per-frame loop), the language model as transformers' own. Each step encodes a
batch of training clips (randomly mirrored, which swaps left and right in the answers), asks a
few random question types about each, each with its own EVS pruning (`sequences`), and takes
one AdamW step on the answers' cross-entropy. The result is saved in bf16 with
`save_pretrained`: a Hugging Face checkpoint like any other.

Given its seed, training is deterministic on one torch build, thread count and instruction set:
the data comes from seeded numpy, single-threaded x264 and PIL, and the steps from seeded torch
with deterministic algorithms.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from stillcut.engine.disk_cache import atomic_folder
from stillcut.engine.factory.demo import architecture
from stillcut.engine.factory.demo.clips import training_seeds
from stillcut.engine.factory.demo.questions import PROMPTS, QUESTION_TYPES, answer
from stillcut.engine.factory.demo.scenes import mirrored
from stillcut.engine.factory.demo.sequences import EVSSchedule, Sequence, build_sequence
from stillcut.engine.factory.demo.training_data import SAMPLE_FPS, TrainingClip, training_clips
from stillcut.engine.model_config import load_model_config
from stillcut.engine.positions import MRopeSpec
from stillcut.engine.processor import PromptProcessor
from stillcut.vision.preprocess import VideoPreprocessConfig, preprocess_video
from stillcut.vision.qwen2_5_vl import Qwen2_5_VLVisionTower

TASK_VERSION = 1  # bump when the task, its answers or the recipe change


@dataclass(frozen=True)
class TrainConfig:
    """The whole training recipe; with the seed it determines the checkpoint."""

    seed: int = 0
    num_clips: int = 2500
    steps: int = 2000
    clips_per_step: int = 12
    questions_per_clip: int = 3
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    threads: int = 2
    evs: EVSSchedule = field(default_factory=EVSSchedule)
    log_every: int = 50

    def __post_init__(self) -> None:
        for name in ("num_clips", "steps", "clips_per_step", "threads", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if not 1 <= self.questions_per_clip <= len(QUESTION_TYPES):
            raise ValueError(
                f"questions_per_clip={self.questions_per_clip}: allowed 1..{len(QUESTION_TYPES)}"
            )
        if not (self.learning_rate > 0 and self.warmup_steps >= 0 and self.weight_decay >= 0):
            raise ValueError("learning_rate must be > 0, warmup_steps and weight_decay >= 0")


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
        self.language_model = self.model.model.language_model
        self.optimizer = torch.optim.AdamW(
            _parameter_groups([self.tower, self.language_model], config.weight_decay),
            lr=config.learning_rate,
            betas=(0.9, 0.98),
            foreach=True,
        )

    def train(self, clips: list[TrainingClip]) -> None:
        """Run `config.steps` steps over `clips`, logging the loss."""
        config = self.config
        rng = np.random.default_rng([config.seed, 2])
        started, running = time.perf_counter(), []
        for step in range(config.steps):
            for group in self.optimizer.param_groups:
                group["lr"] = config.learning_rate * _schedule(step, config)
            batch = rng.choice(len(clips), config.clips_per_step, replace=False)
            loss = self.step([clips[i] for i in batch], rng)
            running.append(loss)
            if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                mean, elapsed = sum(running) / len(running), time.perf_counter() - started
                line = f"  step {step + 1}/{config.steps}  loss {mean:.4f}  {elapsed:.0f} s"
                print(line, flush=True)
                running = []

    def step(self, clips: list[TrainingClip], rng: np.random.Generator) -> float:
        """One optimizer step on a batch of clips; returns the batch's mean token loss."""
        flips = rng.random(len(clips)) < 0.5
        prepared = [
            preprocess_video(
                np.ascontiguousarray(c.frames[:, :, ::-1] if flip else c.frames),
                SAMPLE_FPS,
                self.preprocess,
            )
            for c, flip in zip(clips, flips, strict=True)
        ]
        grids = [p.grid_thw for p in prepared]
        embeds = self.tower(torch.cat([p.patches for p in prepared]), torch.tensor(grids))
        per_clip = embeds.split([t * h * w // 4 for t, h, w in grids])
        sequences = []
        for clip, flip, clip_embeds, video in zip(clips, flips, per_clip, prepared, strict=True):
            scene = mirrored(clip.scene) if flip else clip.scene
            kinds = rng.choice(QUESTION_TYPES, self.config.questions_per_clip, replace=False)
            for kind in kinds:
                prompts = PROMPTS[str(kind)]
                sequences.append(
                    build_sequence(
                        self.processor,
                        self.rope_spec,
                        clip_embeds,
                        video.grid_thw,
                        video.second_per_grid_ts,
                        prompts[int(rng.integers(len(prompts)))],
                        answer(scene, str(kind)),
                        self.config.evs.draw(rng),
                    )
                )
        loss = self._loss(sequences)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(
            [p for group in self.optimizer.param_groups for p in group["params"]], 1.0
        )
        self.optimizer.step()
        return loss.item()

    def _loss(self, sequences: list[Sequence]) -> torch.Tensor:
        """Mean cross-entropy of every answer token, the batch padded on the right."""
        length = max(len(s.input_ids) for s in sequences)
        batch = len(sequences)
        input_ids = torch.zeros(batch, length, dtype=torch.long)
        positions = torch.zeros(3, batch, length, dtype=torch.long)
        attention = torch.zeros(batch, length, dtype=torch.long)
        target_ids = torch.full((batch, length), -100, dtype=torch.long)
        for row, s in enumerate(sequences):
            n = len(s.input_ids)
            input_ids[row, :n] = torch.tensor(s.input_ids)
            positions[:, row, :n] = s.positions
            attention[row, :n] = 1
            first = s.num_prompt_tokens - 1  # the last prompt token predicts the first answer
            target_ids[row, first : first + len(s.targets)] = torch.tensor(s.targets)
        text = self.language_model.embed_tokens(input_ids)  # [batch, length, hidden]
        is_video = (input_ids == self.rope_spec.video_token_id)[..., None]
        video = torch.cat([s.video_embeds for s in sequences])  # [num_video_tokens, hidden]
        inputs = text.masked_scatter(is_video, video)
        hidden = self.language_model(
            inputs_embeds=inputs, attention_mask=attention, position_ids=positions
        ).last_hidden_state
        scored = target_ids != -100
        logits = self.model.lm_head(hidden[scored])  # [num_answer_tokens, vocab]
        return F.cross_entropy(logits, target_ids[scored])

    def save(self, folder: Path) -> None:
        """Write the weights (bf16) and the configs into `folder`."""
        self.model.model.visual.load_state_dict(self.tower.state_dict())
        self.model.to(torch.bfloat16).save_pretrained(folder)


def train_checkpoint(out: str | Path, config: TrainConfig = TrainConfig()) -> dict[str, float]:
    """Train a demo checkpoint into `out` (a new or empty folder); returns the timings."""
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    folder = Path(out)
    metadata = {"task_version": TASK_VERSION, "recipe": asdict(config)}
    wall, cpu = time.perf_counter(), time.process_time()
    with atomic_folder(folder, exist_ok=False) as partial:
        architecture.write_skeleton(partial, metadata)
        trainer = DemoTrainer(partial, config)
        print(f"rendering {config.num_clips} training clips", flush=True)
        clips = training_clips(training_seeds(config.num_clips), trainer.preprocess)
        data_wall, data_cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"training {config.steps} steps", flush=True)
        trainer.train(clips)
        trainer.save(partial)
    timings = {
        "data_wall_s": data_wall,
        "data_cpu_s": data_cpu,
        "total_wall_s": time.perf_counter() - wall,
        "total_cpu_s": time.process_time() - cpu,
    }
    print(", ".join(f"{name} {value:.0f}" for name, value in timings.items()))
    return timings


def _schedule(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
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
    defaults = TrainConfig()
    for name in ("seed", "steps", "num_clips", "clips_per_step", "threads"):
        flag = "--clips" if name == "num_clips" else f"--{name.replace('_', '-')}"
        parser.add_argument(flag, dest=name, type=int, default=getattr(defaults, name))
    args = parser.parse_args()
    overrides = {k: v for k, v in vars(args).items() if k != "out"}
    train_checkpoint(args.out, TrainConfig(**overrides))


if __name__ == "__main__":
    main()
