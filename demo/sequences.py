"""Training sequences: prompts exactly as stillcut builds them, and the tokens to predict.

A sequence is what the engine would run: the prompt processor builds the prompt around the
kept video tokens, M-RoPE positions come from the kept tokens' coordinates (`extend_mrope`,
as the engine places them), and an answer continues from the next position as generated
tokens would. Four kinds, all from one clip's (or a few clips') embeddings:
- a question and its answer (`answer_sequence` of `processor.build_text`), or several questions
  about one video in one sequence (`questions_sequence`): the prompts' common start (the system
  message and the video) once, then each question and its answer as a branch that attends to
  the common start and to itself only, at the positions it would have alone, so it learns
  exactly what the lone question would teach for a fraction of the tokens;
- a chunk caption (`chunk_prompts.chunk_caption_messages`) and an aggregation prompt
  (`chunk_prompts.aggregation_messages`, text only), built the same way;
- a narration (`narration_sequence`): the instruction, then per tubelet its timestamp and
  the tubelet as its own video (`processor.narration_prompt` / `narration_input`), each
  followed by its segment, pruned by threshold EVS whose references carry from tubelet to
  tubelet as a live narration's do; a tubelet EVS empties gets no segment, as live.
Videos of questions and chunks are pruned by EVS rate mode at a random rate (each sequence
afresh, on the current embeddings, as the pipeline would), some not at all and some at the rate
a request gets by default (`EVSSchedule.default_share`), so one model serves every EVS setting
and is best at the one most answers are given under; narrations likewise at a random
threshold, some unpruned.
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
from stillcut.vision.pixel_stage import merged_grid

END_OF_TURN = "<|im_end|>"  # how the chat template ends the assistant's turn
MERGE_SIZE = 2  # Qwen merges 2x2 patches into one language-model token
IGNORE = -100  # the label of a position whose next token is not predicted


@dataclass(frozen=True)
class EVSSchedule:
    """How training prunes: a share of sequences unpruned, a share at `default_value` (what a
    request that names no EVS gets, so the setting most answers are given under is trained
    most), the rest at a setting drawn uniformly below `max_value`: rate q (questions,
    chunks) or threshold tau (narrations)."""

    unpruned_share: float = 0.3
    max_value: float = 0.95
    mode: str = "rate"
    default_share: float = 0.0
    default_value: float = 0.0

    def __post_init__(self) -> None:
        for name in ("unpruned_share", "default_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: allowed [0, 1]")
        if self.unpruned_share + self.default_share > 1.0:
            raise ValueError("unpruned_share + default_share: must be <= 1")
        if self.mode not in ("rate", "threshold"):
            raise ValueError(f"mode={self.mode!r}: allowed 'rate' or 'threshold'")
        for name in ("max_value", "default_value"):
            if not 0.0 <= getattr(self, name) < (1.0 if self.mode == "rate" else 2.0):
                raise ValueError(
                    f"{name}={getattr(self, name)}: allowed [0, 1) for rate, [0, 2) for threshold"
                )

    def draw(self, rng: np.random.Generator) -> EVSConfig | None:
        """One sequence's setting (None: every token kept)."""
        draw = rng.random()
        if draw < self.unpruned_share:
            return None
        if draw < self.unpruned_share + self.default_share:
            value = self.default_value
        else:
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
    # per input position its branch (`questions_sequence`): 0 is seen by every position after
    # it, k > 0 only by positions of branch k. None: one causal sequence.
    branches: list[int] | None = None
    # [num_video_tokens, 5] what each video token's place showed a tubelet earlier
    # (`token_labels.lookback_targets`), or None
    video_targets: torch.Tensor | None = None
    # [len(input_ids)] int64: per input position that predicts an answer token, the bit mask
    # of the colour-shape pairs (`token_labels.pair_index`) of what its clause is about, -1
    # elsewhere; None: no position has one
    answer_sets: torch.Tensor | None = None

    def attention(self, length: int) -> torch.Tensor:
        """[length, length] bool: which positions each position attends to, padded to
        `length` (a padding position attends to itself alone, so no row is empty)."""
        n = len(self.input_ids)
        allowed = torch.ones(n, n, dtype=torch.bool).tril_()
        if self.branches is not None:
            branch = torch.tensor(self.branches)
            allowed &= (branch[None, :] == 0) | (branch[None, :] == branch[:, None])
        mask = torch.eye(length, dtype=torch.bool)
        mask[:n, :n] = allowed
        return mask


def video_item(
    embeds: torch.Tensor,
    grid_thw: tuple[int, int, int],
    second_per_grid_ts: float,
    evs: EVSConfig | None,
) -> MultiModalItem:
    """A clip's video item from its dense embeddings [t*h*w, hidden] (post-merge grid of the
    patch grid `grid_thw`), pruned by `evs` in rate mode (None: every token kept)."""
    return pruned_video(embeds, grid_thw, second_per_grid_ts, evs)[0]


def pruned_video(
    embeds: torch.Tensor,
    grid_thw: tuple[int, int, int],
    second_per_grid_ts: float,
    evs: EVSConfig | None,
    targets: torch.Tensor | None = None,
) -> tuple[MultiModalItem, torch.Tensor | None]:
    """`video_item`, and the rows of `targets` [t*h*w, k] (one per dense token, or None) of
    the tokens it keeps."""
    llm_grid = merged_grid(grid_thw, MERGE_SIZE)
    kept_embeds, coords = embeds, dense_coords(*llm_grid)
    if evs is not None:
        kept = prune(embeds.detach(), llm_grid, evs)
        kept_embeds, coords = embeds[kept.kept_index], kept.kept_coords
        targets = None if targets is None else targets[kept.kept_index]
    item = MultiModalItem(
        "video", kept_embeds, coords, grid_thw, second_per_grid_ts=second_per_grid_ts
    )
    return item, targets


def answer_sequence(
    processor: PromptProcessor,
    rope_spec: MRopeSpec,
    prompt: Prompt,
    answer: str,
    video_targets: torch.Tensor | None = None,
    pieces: Seq[tuple[str, int]] | None = None,
) -> Sequence:
    """`prompt` (from `processor.build` or `build_text`) followed by `answer` and the end of
    the turn, which are predicted; `video_targets` go with the prompt's video tokens, and
    `pieces` (the answer's text in pieces, each with its pairs mask) give `answer_sets`."""
    builder = _Builder(processor, rope_spec)
    builder.add_input(prompt.token_ids, prompt.items, video_targets)
    builder.add_answer(answer + END_OF_TURN, pieces)
    return builder.sequence()


def questions_sequence(
    processor: PromptProcessor,
    rope_spec: MRopeSpec,
    prompts: Seq[Prompt],
    answers: Seq[str],
    video_targets: torch.Tensor | None = None,
    answer_masks: Seq[int] | None = None,
) -> Sequence:
    """Several prompts about the same video items, each followed by its answer, in one
    sequence: their common start once, then per prompt the rest of it and its answer as a
    branch that sees the common start and itself only, placed where it would be alone. The
    common start must hold every video token (the question comes after the video)."""
    if not prompts or len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts and {len(answers)} answers: need as many, >= 1")
    first = prompts[0].token_ids
    common = min(len(p.token_ids) for p in prompts) - 1  # every branch keeps an input token
    for prompt in prompts[1:]:
        common = next((k for k in range(common) if prompt.token_ids[k] != first[k]), common)
    video = rope_spec.video_token_id
    if any(list(p.token_ids[common:]).count(video) for p in prompts):
        raise ValueError("the prompts differ before their last video token")
    builder = _Builder(processor, rope_spec)
    builder.add_input(first[:common], prompts[0].items, video_targets)
    start = builder.cursor
    masks = answer_masks if answer_masks is not None else [None] * len(answers)
    for branch, (prompt, answer, mask) in enumerate(
        zip(prompts, answers, masks, strict=True), start=1
    ):
        builder.branch, builder.cursor = branch, start
        builder.add_input(prompt.token_ids[common:], [])
        builder.add_answer(answer + END_OF_TURN, None if mask is None else [(answer, mask)])
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
    targets: torch.Tensor | None = None,
) -> Sequence:
    """A narration of a clip whose dense embeddings are `embeds` [t*h*w, hidden] (patch grid
    `grid_thw`): per tubelet i that `evs` (threshold mode; None: every token kept) leaves a
    token of, its timestamp `timestamps[i]`, the tubelet, and `segments[i]` (predicted);
    `targets` [t*h*w, k] go with the video tokens kept."""
    t, h, w = grid_thw
    tokens_per_tubelet = h * w // MERGE_SIZE**2
    pruner = None
    if evs is not None:
        grid_hw = (h // MERGE_SIZE, w // MERGE_SIZE)
        pruner = ThresholdPruner(evs, grid_hw, embeds.shape[1], embeds.device, embeds.dtype)
    builder = _Builder(processor, rope_spec)
    for index in range(t):
        rows = slice(index * tokens_per_tubelet, (index + 1) * tokens_per_tubelet)
        tubelet, tubelet_targets = embeds[rows], None if targets is None else targets[rows]
        coords = dense_coords(1, h // MERGE_SIZE, w // MERGE_SIZE)
        if pruner is not None:
            kept = pruner.push(tubelet.detach())
            if not kept.num_kept_tokens:
                continue  # a live narration appends nothing for it and says nothing
            tubelet, coords = tubelet[kept.kept_index], kept.kept_coords * torch.tensor([0, 1, 1])
            if tubelet_targets is not None:
                tubelet_targets = tubelet_targets[kept.kept_index]
        item = MultiModalItem("video", tubelet, coords, (1, h, w), timestamps=(timestamps[index],))
        if builder.empty:
            ids = processor.narration_prompt(instruction, item, timestamps[index]).token_ids
        else:
            ids = processor.narration_input(item, timestamps[index])
        builder.add_input(ids, [item], tubelet_targets)
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
        self.branch = 0  # the branch tokens are added to (`questions_sequence`)
        self.branches: list[int] = []
        self.targets: list[torch.Tensor | None] = []  # per item added
        self.sets: list[int] = []  # per token, its clause's pairs mask (-1: none)

    @property
    def empty(self) -> bool:
        return not self.tokens

    def add_input(
        self,
        token_ids: Seq[int],
        items: Seq[MultiModalItem],
        targets: torch.Tensor | None = None,
    ) -> None:
        """Prompt tokens (a sequence's start or appended input), placed after the cursor;
        `targets` are those of the items' video tokens, in order."""
        positions, self.cursor = extend_mrope(self.cursor, token_ids, items, self.rope_spec)
        self._add(list(token_ids), positions, predicted=False)
        self.items.extend(items)
        if items:
            self.targets.append(targets)

    def add_answer(self, text: str, pieces: Seq[tuple[str, int]] | None = None) -> None:
        """Generated tokens: each at the next position, each predicted. `pieces` split the
        start of `text` into clauses, each with the pairs mask of what it is about: a token
        gets the mask of the clause it is in (what follows the last piece, the last one's)."""
        ids = self.processor.encode(text)
        positions = self.cursor.next_position + torch.arange(len(ids))
        self.cursor = self.cursor.after_decoded(len(ids))
        self._add(ids, positions.expand(3, -1), predicted=True)
        self.sets[-len(ids) :] = self._clause_sets(ids, text, pieces)

    def _clause_sets(self, ids: list[int], text: str, pieces) -> list[int]:
        if not pieces:
            return [-1] * len(ids)
        if not text.startswith("".join(piece for piece, _ in pieces)):
            raise ValueError(f"{pieces!r}: not the start of {text!r}")
        sets, prefix = [], ""
        for piece, mask in pieces[:-1]:  # the last piece runs to the end: no boundary to find
            prefix += piece
            prefix_ids = self.processor.encode(prefix)
            if ids[: len(prefix_ids)] != prefix_ids:
                raise ValueError(f"{piece!r}: does not end at a token boundary of {text!r}")
            sets += [mask] * (len(prefix_ids) - len(sets))
        return sets + [pieces[-1][1]] * (len(ids) - len(sets))

    def sequence(self) -> Sequence:
        labels = [
            t if p else IGNORE for t, p in zip(self.tokens[1:], self.predicted[1:], strict=True)
        ]
        video = [item.embeds for item in self.items]
        sets = [m if p else -1 for m, p in zip(self.sets[1:], self.predicted[1:], strict=True)]
        return Sequence(
            input_ids=self.tokens[:-1],
            positions=torch.cat(self.positions, dim=1)[:, :-1],
            video_embeds=torch.cat(video) if video else torch.empty(0),
            labels=labels,
            branches=self.branches[:-1] if any(self.branches) else None,
            video_targets=(
                torch.cat(self.targets)
                if self.targets and all(t is not None for t in self.targets)
                else None
            ),
            answer_sets=torch.tensor(sets) if any(m >= 0 for m in sets) else None,
        )

    def _add(self, ids: list[int], positions: torch.Tensor, predicted: bool) -> None:
        self.tokens += ids
        self.predicted += [predicted] * len(ids)
        self.positions.append(positions)
        self.branches += [self.branch] * len(ids)
        self.sets += [-1] * len(ids)
