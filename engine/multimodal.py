"""Multimodal items: what the vision side hands the language runner.

An item is one video or image after encoding (and, for videos, EVS pruning). It carries only
the kept embeddings, the post-merge (t, h, w) coordinates of each, and the two identities the
caches use. This module imports nothing beyond torch so the engine never pulls in PyAV.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass(frozen=True)
class MultiModalItem:
    """One encoded image or video, ready to be placed in a prompt.

    `grid_thw` is the pre-merge patch grid as Hugging Face reports it; `coords` index the
    post-merge grid `(t, h // merge_size, w // merge_size)` that the language model sees.
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

    def __post_init__(self) -> None:
        assert self.embeds.dim() == 2, self.embeds.shape
        assert self.coords.shape == (self.embeds.shape[0], 3), (
            self.coords.shape,
            self.embeds.shape,
        )

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
