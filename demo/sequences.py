"""Training sequences: one clip's embeddings, pruned by EVS, in the prompt stillcut builds.

Each sequence is exactly what the engine would run for one question: the prompt processor
expands the chat template around the kept video tokens, M-RoPE positions come from the kept
tokens' coordinates (`mrope_positions`), and the answer continues from the prompt's next
position as generated tokens would. Training sees pruned inputs: most sequences prune their
clip with EVS rate mode at a random rate (each sequence afresh, on the current embeddings, as
the pipeline would), the rest keep every token, so one model serves every EVS setting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stillcut.engine.models.qwen2_vl.positions import MRopeSpec, mrope_positions
from stillcut.engine.multimodal import MultiModalItem, dense_coords
from stillcut.engine.processor import PromptProcessor
from stillcut.kernels.evs import EVSConfig, prune

END_OF_TURN = "<|im_end|>"  # how the chat template ends the assistant's turn
MERGE_SIZE = 2  # Qwen merges 2x2 patches into one language-model token


@dataclass(frozen=True)
class EVSSchedule:
    """How training prunes: a share of sequences unpruned, the rest at rate q ~ U[0, max)."""

    unpruned_share: float = 0.3
    max_rate: float = 0.95

    def __post_init__(self) -> None:
        if not 0.0 <= self.unpruned_share <= 1.0:
            raise ValueError(f"unpruned_share={self.unpruned_share}: allowed [0, 1]")
        if not 0.0 <= self.max_rate < 1.0:
            raise ValueError(f"max_rate={self.max_rate}: allowed [0, 1)")

    def draw(self, rng: np.random.Generator) -> EVSConfig | None:
        """One sequence's setting (None: every token kept)."""
        if rng.random() < self.unpruned_share:
            return None
        return EVSConfig(mode="rate", rate=float(rng.uniform(0.0, self.max_rate)))


@dataclass(frozen=True)
class Sequence:
    """One training sequence: inputs, where its video tokens go, what it must predict."""

    input_ids: list[int]  # prompt + answer without its last token
    positions: torch.Tensor  # [3, len(input_ids)] long
    video_embeds: torch.Tensor  # [num_kept, hidden], the rows of the video placeholders
    num_prompt_tokens: int
    targets: list[int]  # the answer and its end token, predicted from the last prompt token on


def build_sequence(
    processor: PromptProcessor,
    rope_spec: MRopeSpec,
    embeds: torch.Tensor,
    grid_thw: tuple[int, int, int],
    second_per_grid_ts: float,
    question: str,
    answer: str,
    evs: EVSConfig | None,
) -> Sequence:
    """The sequence asking `question` about a clip whose dense embeddings are `embeds`
    [t*h*w, hidden] (post-merge grid of the patch grid `grid_thw`), pruned by `evs`."""
    t, h, w = grid_thw
    llm_grid = (t, h // MERGE_SIZE, w // MERGE_SIZE)
    kept_embeds, coords = embeds, dense_coords(*llm_grid)
    if evs is not None:
        kept = prune(embeds.detach(), llm_grid, evs)
        kept_embeds, coords = embeds[kept.kept_index], kept.kept_coords
    item = MultiModalItem(
        "video", kept_embeds, coords, grid_thw, second_per_grid_ts=second_per_grid_ts
    )
    prompt = processor.build_text(question, [item])
    prompt_positions = mrope_positions(prompt.token_ids, [item], rope_spec)
    targets = processor.encode(answer + END_OF_TURN)
    answer_positions = prompt_positions.next_position + torch.arange(len(targets) - 1)
    positions = torch.cat([prompt_positions.positions, answer_positions.expand(3, -1)], dim=1)
    return Sequence(
        input_ids=prompt.token_ids + targets[:-1],
        positions=positions,
        video_embeds=kept_embeds,
        num_prompt_tokens=len(prompt.token_ids),
        targets=targets,
    )
