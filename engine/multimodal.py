"""Multimodal items: what the vision side hands the language runner.

An item is one video or image after encoding (and, for videos, EVS pruning). It carries only
the kept embeddings, the post-merge (t, h, w) coordinates of each, and the two identities the
caches use; when the engine speculates with a draft model, also the draft's own tower's
embeddings of the same media, kept at the same coordinates (`draft_embeds`). This module
imports nothing beyond torch so the engine never pulls in PyAV.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch


@dataclass(frozen=True)
class MultiModalItem:
    """One encoded image or video, ready to be placed in a prompt.

    `grid_thw` is the pre-merge patch grid as Hugging Face reports it; `coords` index the
    post-merge grid `(t, h // merge_size, w // merge_size)` that the language model sees.
    `draft_embeds` (None: not encoded for a draft) row i is the draft model's embedding of the
    token `embeds` row i is the target's, at `coords[i]`; its width is the draft's hidden size.
    """

    kind: Literal["video", "image"]
    embeds: torch.Tensor  # [num_tokens, hidden]
    coords: torch.Tensor  # [num_tokens, 3] long, (t, h, w) in the post-merge grid
    grid_thw: tuple[int, int, int]
    merge_size: int = 2
    second_per_grid_ts: float = 1.0
    timestamps: tuple[float, ...] = ()
    # each sampled frame's index in its source video, and the source's frame rate (a video's
    # prompt may label its frames with them); empty / None when unknown
    source_indices: tuple[int, ...] = ()
    source_fps: float | None = None
    media_key: str = ""
    identifier: str = ""
    bidirectional: bool = False
    kept_per_tubelet: tuple[int, ...] = ()
    stats: dict = field(default_factory=dict)
    draft_embeds: torch.Tensor | None = None  # [num_tokens, draft hidden]

    def __post_init__(self) -> None:
        assert self.embeds.dim() == 2, self.embeds.shape
        assert self.coords.shape == (self.embeds.shape[0], 3), (
            self.coords.shape,
            self.embeds.shape,
        )
        if self.draft_embeds is not None:
            assert self.draft_embeds.dim() == 2, self.draft_embeds.shape
            assert self.draft_embeds.shape[0] == self.embeds.shape[0], (
                self.draft_embeds.shape,
                self.embeds.shape,
            )

    def for_draft(self) -> MultiModalItem:
        """This item as the draft model places it: its `embeds` are the draft's."""
        assert self.draft_embeds is not None, "the item was not encoded for a draft"
        return replace(self, embeds=self.draft_embeds, draft_embeds=None)

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens this item occupies in the prompt (kept tokens only)."""
        return self.embeds.shape[0]

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        """The dense post-merge grid `(t, h, w)` before any pruning."""
        t, h, w = self.grid_thw
        return t, h // self.merge_size, w // self.merge_size

    @property
    def num_dense_tokens(self) -> int:
        t, h, w = self.llm_grid
        return t * h * w


def dense_coords(t: int, h: int, w: int) -> torch.Tensor:
    """All (t, h, w) of a post-merge grid in row-major order: the token order of the merged
    vision embeddings. Returns [t * h * w, 3] long."""
    grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid, dim=-1).reshape(-1, 3)  # [t*h*w, 3]
