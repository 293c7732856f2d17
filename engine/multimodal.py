"""Multimodal items: what the vision side hands the language runner.

An item is one video or image after encoding (and, for videos, EVS pruning). It carries only
the kept embeddings, the post-merge (t, h, w) coordinates of each, the two identities the caches
use, and named extra feature sets of the same tokens (`features`): what a tower hands the
language model beside the embeddings (DeepStack: one set per injected decoder layer)
and, when the engine speculates with a draft model, the draft's own tower's embeddings (`DRAFT`)
and extra features (`DRAFT/<name>`). Every feature set is kept by the same EVS mask as the
embeddings, row for row, so it sits at the same coordinates and prompt positions. This module
imports nothing beyond torch so the engine never pulls in PyAV.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

# the draft model's tower's embeddings among an item's features; its extra ones are "draft/<name>"
DRAFT = "draft"


@dataclass(frozen=True)
class TowerOutput:
    """What a tower makes of one input when it gives more than embeddings: the embeddings and
    named extra feature sets, each `[num_tokens, width]` row for row with them. A media class's
    `encode` returns, per input, either a plain embeddings tensor or one of these."""

    embeds: torch.Tensor  # [num_tokens, hidden]
    features: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, output: torch.Tensor | TowerOutput) -> TowerOutput:
        """A media class's output for one input, as a `TowerOutput`."""
        return output if isinstance(output, TowerOutput) else cls(output)

    def to(self, dtype: torch.dtype) -> TowerOutput:
        """The embeddings and every feature set in `dtype`."""
        features = {name: tensor.to(dtype) for name, tensor in self.features.items()}
        return TowerOutput(self.embeds.to(dtype), features)

    def with_draft(self, draft: TowerOutput) -> TowerOutput:
        """This output with the draft tower's output of the same input among its features."""
        assert draft.embeds.shape[0] == self.embeds.shape[0], "check_draft keeps the grids equal"
        drafted = {f"{DRAFT}/{name}": tensor for name, tensor in draft.features.items()}
        return TowerOutput(self.embeds, {**self.features, DRAFT: draft.embeds, **drafted})


def select_rows(features: Mapping[str, torch.Tensor], rows) -> dict[str, torch.Tensor]:
    """Each feature set's `rows` (an index or a slice): the tokens EVS kept, or one tubelet's."""
    return {name: tensor[rows] for name, tensor in features.items()}


@dataclass(frozen=True)
class MultiModalItem:
    """One encoded image or video, ready to be placed in a prompt.

    `grid_thw` is the pre-merge patch grid as Hugging Face reports it; `coords` index the
    post-merge grid `(t, h // merge_size, w // merge_size)` that the language model sees.
    `features` maps a name to `[num_tokens, width]`: row i belongs to the token `embeds` row i
    is, at `coords[i]` (see the module docstring; `DRAFT`'s width is the draft's hidden size).
    A language model that consumes feature sets names them in `mm_feature_names`.
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
    features: Mapping[str, torch.Tensor] = field(default_factory=dict)  # name -> [num_tokens, w]

    def __post_init__(self) -> None:
        assert self.embeds.dim() == 2, self.embeds.shape
        assert self.coords.shape == (self.embeds.shape[0], 3), (
            self.coords.shape,
            self.embeds.shape,
        )
        for name, tensor in self.features.items():
            assert tensor.dim() == 2 and tensor.shape[0] == self.embeds.shape[0], (
                name,
                tensor.shape,
                self.embeds.shape,
            )

    def for_draft(self) -> MultiModalItem:
        """This item as the draft model places it: its `embeds` and features are the draft's."""
        assert DRAFT in self.features, "the item was not encoded for a draft"
        prefix = DRAFT + "/"
        draft_features = {
            name.removeprefix(prefix): tensor
            for name, tensor in self.features.items()
            if name.startswith(prefix)
        }
        return replace(self, embeds=self.features[DRAFT], features=draft_features)

    def check_features(self, names: Sequence[str]) -> None:
        """Raise ValueError unless this item carries every feature set in `names` (those a
        language model consumes)."""
        missing = [name for name in names if name not in self.features]
        if missing:
            raise ValueError(
                f"a {self.kind} item lacks the feature sets {missing} the model consumes "
                f"(it has {sorted(self.features)}): encode it with this model's pipeline"
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


def dense_coords(t: int, h: int, w: int) -> torch.Tensor:
    """All (t, h, w) of a post-merge grid in row-major order: the token order of the merged
    vision embeddings. Returns [t * h * w, 3] long."""
    grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid, dim=-1).reshape(-1, 3)  # [t*h*w, 3]
