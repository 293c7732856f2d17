"""Training sequences: prompts exactly as stillcut builds them, and the tokens to predict.

A sequence is what the engine would run: the prompt processor builds the prompt around the
kept video tokens, M-RoPE positions come from the kept tokens' coordinates (`extend_mrope`,
as the engine places them), and an answer continues from the next position as generated
tokens would. Four kinds, all from one clip's (or a few clips') embeddings:
- a question and its answer (`answer_sequence` of `processor.build_text`);
- a chunk caption (`chunk_prompts.chunk_caption_messages`) and an aggregation prompt
  (`chunk_prompts.aggregation_messages`, text only), built the same way;
- a narration (`narration_sequence`): the instruction, then per tubelet its timestamp and
  the tubelet as its own video (`processor.narration_prompt` / `narration_input`), each
  followed by its segment, pruned by threshold EVS whose references carry from tubelet to
  tubelet as a live narration's do; a tubelet EVS empties gets no segment, as live.
Videos of questions and chunks are pruned by EVS rate mode at a random rate (each sequence
afresh, on the current embeddings, as the pipeline would), some not at all, so one model serves
every EVS setting; narrations likewise at a random threshold, some unpruned.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from stillcut.engine.models.qwen2_vl.positions import MRopeCursor, MRopeSpec, extend_mrope
from stillcut.engine.multimodal import MultiModalItem, dense_coords
from stillcut.engine.processor import Prompt, PromptProcessor
from stillcut.kernels.evs import EVSConfig, ThresholdPruner, prune

END_OF_TURN = "<|im_end|>"  # how the chat template ends the assistant's turn
MERGE_SIZE = 2  # Qwen merges 2x2 patches into one language-model token
IGNORE = -100  # the label of a position whose next token is not predicted


@dataclass(frozen=True)
class EVSSchedule:
    """How training prunes: a share of sequences unpruned, the rest at a setting drawn
    uniformly below `max_value`: rate q (questions, chunks) or threshold tau (narrations)."""

    unpruned_share: float = 0.3
    max_value: float = 0.95
    mode: str = "rate"

    def __post_init__(self) -> None:
        if not 0.0 <= self.unpruned_share <= 1.0:
            raise ValueError(f"unpruned_share={self.unpruned_share}: allowed [0, 1]")
        if self.mode not in ("rate", "threshold"):
            raise ValueError(f"mode={self.mode!r}: allowed 'rate' or 'threshold'")
        if not 0.0 <= self.max_value < (1.0 if self.mode == "rate" else 2.0):
            raise ValueError(
                f"max_value={self.max_value}: allowed [0, 1) for rate, [0, 2) for threshold"
            )

    def draw(self, rng: np.random.Generator) -> EVSConfig | None:
        """One sequence's setting (None: every token kept)."""
        if rng.random() < self.unpruned_share:
            return None
        value = float(rng.uniform(0.0, self.max_value))
        if self.mode == "rate":
            return EVSConfig(mode="rate", rate=value)
        return EVSConfig(mode="threshold", threshold=value)


@dataclass(frozen=True)
class Sequence:
    """One training sequence: inputs, where its video tokens go, what it must predict."""

    input_ids: list[int]  # every token but the last
    positions: torch.Tensor  # [3, len(input_ids)] long
    video_embeds: torch.Tensor  # [num_video_tokens, hidden], the video placeholders' rows
    labels: list[int]  # per input position the next token to predict, or IGNORE


def video_item(
    embeds: torch.Tensor,
    grid_thw: tuple[int, int, int],
    second_per_grid_ts: float,
    evs: EVSConfig | None,
) -> MultiModalItem:
    """A clip's video item from its dense embeddings [t*h*w, hidden] (post-merge grid of the
    patch grid `grid_thw`), pruned by `evs` in rate mode (None: every token kept)."""
    t, h, w = grid_thw
    llm_grid = (t, h // MERGE_SIZE, w // MERGE_SIZE)
    kept_embeds, coords = embeds, dense_coords(*llm_grid)
    if evs is not None:
        kept = prune(embeds.detach(), llm_grid, evs)
        kept_embeds, coords = embeds[kept.kept_index], kept.kept_coords
    return MultiModalItem(
        "video", kept_embeds, coords, grid_thw, second_per_grid_ts=second_per_grid_ts
    )


def answer_sequence(
    processor: PromptProcessor, rope_spec: MRopeSpec, prompt: Prompt, answer: str
) -> Sequence:
    """`prompt` (from `processor.build` or `build_text`) followed by `answer` and the end of
    the turn, which are predicted."""
    builder = _Builder(processor, rope_spec)
    builder.add_input(prompt.token_ids, prompt.items)
    builder.add_answer(answer + END_OF_TURN)
    return builder.sequence()


def narration_sequence(
    processor: PromptProcessor,
    rope_spec: MRopeSpec,
    instruction: str,
    embeds: torch.Tensor,
    grid_thw: tuple[int, int, int],
    timestamps: Seq[float],
    segments: Seq[str],
    evs: EVSConfig | None,
) -> Sequence:
    """A narration of a clip whose dense embeddings are `embeds` [t*h*w, hidden] (patch grid
    `grid_thw`): per tubelet i that `evs` (threshold mode; None: every token kept) leaves a
    token of, its timestamp `timestamps[i]`, the tubelet, and `segments[i]` (predicted)."""
    t, h, w = grid_thw
    tokens_per_tubelet = h * w // MERGE_SIZE**2
    pruner = None
    if evs is not None:
        grid_hw = (h // MERGE_SIZE, w // MERGE_SIZE)
        pruner = ThresholdPruner(evs, grid_hw, embeds.shape[1], embeds.device, embeds.dtype)
    builder = _Builder(processor, rope_spec)
    for index in range(t):
        tubelet = embeds[index * tokens_per_tubelet : (index + 1) * tokens_per_tubelet]
        coords = dense_coords(1, h // MERGE_SIZE, w // MERGE_SIZE)
        if pruner is not None:
            kept = pruner.push(tubelet.detach())
            if not kept.num_kept_tokens:
                continue  # a live narration appends nothing for it and says nothing
            tubelet, coords = tubelet[kept.kept_index], kept.kept_coords * torch.tensor([0, 1, 1])
        item = MultiModalItem("video", tubelet, coords, (1, h, w), timestamps=(timestamps[index],))
        if builder.empty:
            ids = processor.narration_prompt(instruction, item, timestamps[index]).token_ids
        else:
            ids = processor.narration_input(item, timestamps[index])
        builder.add_input(ids, [item])
        builder.add_answer(segments[index])
    return builder.sequence()


class _Builder:
    """Tokens, their M-RoPE positions as the engine places them, and which are predicted."""

    def __init__(self, processor: PromptProcessor, rope_spec: MRopeSpec) -> None:
        self.processor, self.rope_spec = processor, rope_spec
        self.cursor = MRopeCursor()
        self.tokens: list[int] = []
        self.predicted: list[bool] = []
        self.positions: list[torch.Tensor] = []
        self.items: list[MultiModalItem] = []

    @property
    def empty(self) -> bool:
        return not self.tokens

    def add_input(self, token_ids: Seq[int], items: Seq[MultiModalItem]) -> None:
        """Prompt tokens (a sequence's start or appended input), placed after the cursor."""
        positions, self.cursor = extend_mrope(self.cursor, token_ids, items, self.rope_spec)
        self._add(list(token_ids), positions, predicted=False)
        self.items.extend(items)

    def add_answer(self, text: str) -> None:
        """Generated tokens: each at the next position, each predicted."""
        ids = self.processor.encode(text)
        positions = self.cursor.next_position + torch.arange(len(ids))
        self.cursor = self.cursor.after_decoded(len(ids))
        self._add(ids, positions.expand(3, -1), predicted=True)

    def sequence(self) -> Sequence:
        labels = [
            t if p else IGNORE for t, p in zip(self.tokens[1:], self.predicted[1:], strict=True)
        ]
        video = [item.embeds for item in self.items]
        return Sequence(
            input_ids=self.tokens[:-1],
            positions=torch.cat(self.positions, dim=1)[:, :-1],
            video_embeds=torch.cat(video) if video else torch.empty(0),
            labels=labels,
        )

    def _add(self, ids: list[int], positions: torch.Tensor, predicted: bool) -> None:
        self.tokens += ids
        self.predicted += [predicted] * len(ids)
        self.positions.append(positions)
