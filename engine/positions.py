"""M-RoPE positions for prompts whose video items may have been pruned by EVS.

Qwen2-VL and Qwen2.5-VL give every token three position ids (temporal, height, width). Text
tokens count up with all three rows equal. A vision item's tokens sit at the item's start plus
their own (t, h, w), read from the kept coordinates, so a kept token has the position it would
have had without pruning. Where positions resume after an item depends only on the item's dense
grid, never on what was kept, so the text and decode positions of a pruned prompt equal those of
the unpruned one. Work is vectorized per item: a 16k-token video costs a few tensor ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch

from stillcut.engine.multimodal import MultiModalItem

TextAfterVision = Literal["spatial_extent", "grid_max"]


@dataclass(frozen=True)
class MRopeSpec:
    """The model-config facts that M-RoPE positions depend on.

    `tokens_per_second` scales video time as Qwen2.5-VL does; None means Qwen2-VL, whose temporal
    position is the tubelet index. `text_after_vision` says where positions resume after a vision
    item: "spatial_extent" at start + max(h, w) of the merged grid (transformers >= 5.3, the
    pinned reference), "grid_max" at the dense grid's maximum + 1 (transformers < 5.3 and the
    original Qwen code). They differ only when a video's temporal extent exceeds its spatial one.
    """

    image_token_id: int
    video_token_id: int
    tokens_per_second: float | None = None
    text_after_vision: TextAfterVision = "spatial_extent"

    def __post_init__(self) -> None:
        for name in ("image_token_id", "video_token_id"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.image_token_id == self.video_token_id:
            raise ValueError(
                f"image_token_id and video_token_id must differ, both are {self.image_token_id}"
            )
        if self.tokens_per_second is not None and not self.tokens_per_second > 0:
            raise ValueError(f"tokens_per_second={self.tokens_per_second} must be > 0 or None")
        if self.text_after_vision not in get_args(TextAfterVision):
            raise ValueError(
                f"text_after_vision={self.text_after_vision!r} must be one of "
                f"{get_args(TextAfterVision)}"
            )


class MRopePositions(NamedTuple):
    """Positions of a prompt and where the tokens after it continue."""

    positions: torch.Tensor  # [3, num_tokens] long
    next_position: int  # position of the first token after the prompt, in all three rows

    @property
    def delta(self) -> int:
        """`mrope_position_delta`: a token at sequence index j >= num_tokens sits at j + delta.

        This is transformers' `rope_deltas`; for a pruned prompt it is larger than for the
        unpruned one by exactly the number of dropped tokens.
        """
        return self.next_position - self.positions.shape[1]


def dense_coords(t: int, h: int, w: int) -> torch.Tensor:
    """All (t, h, w) of a post-merge grid in row-major order: the token order of the merged
    vision embeddings. Returns [t * h * w, 3] long."""
    grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid, dim=-1).reshape(-1, 3)  # [t*h*w, 3]


def mrope_positions(
    token_ids: Sequence[int] | torch.Tensor,
    items: Sequence[MultiModalItem],
    spec: MRopeSpec,
) -> MRopePositions:
    """M-RoPE positions of a prompt, on the CPU.

    Each maximal run of `<|image_pad|>` / `<|video_pad|>` tokens in `token_ids` stands for the next
    item of `items`, in order, and must hold exactly `item.num_tokens` placeholders.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long, device="cpu")  # [num_tokens]
    if ids.dim() != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tuple(ids.shape)}")
    runs = _placeholder_runs(ids, spec)
    _check_runs(runs, items, spec)

    positions = torch.empty(3, ids.numel(), dtype=torch.long)  # [3, num_tokens]
    cursor = 0  # index of the first token not yet placed
    next_pos = 0  # position the next text token gets
    end = 0  # one past the largest position so far
    for item, (run_start, run_length, _) in zip(items, runs, strict=True):
        next_pos = _place_text(positions, cursor, run_start, next_pos)
        next_pos, item_end = _place_item(positions, run_start, item, next_pos, spec)
        end = max(end, item_end)
        cursor = run_start + run_length
    next_pos = _place_text(positions, cursor, ids.numel(), next_pos)
    return MRopePositions(positions, max(end, next_pos))


def _placeholder_runs(ids: torch.Tensor, spec: MRopeSpec) -> list[tuple[int, int, int]]:
    """(start index, length, token id) of each maximal run of one placeholder token."""
    is_placeholder = (ids == spec.image_token_id) | (ids == spec.video_token_id)
    index = torch.nonzero(is_placeholder).flatten()  # [num_placeholders]
    if index.numel() == 0:
        return []
    run_ids = ids[index]  # [num_placeholders]
    breaks = (index[1:] != index[:-1] + 1) | (run_ids[1:] != run_ids[:-1])  # [num_placeholders-1]
    firsts = torch.cat([index.new_zeros(1), torch.nonzero(breaks).flatten() + 1])  # [num_runs]
    lengths = torch.diff(firsts, append=index.new_tensor([index.numel()]))  # [num_runs]
    return list(
        zip(index[firsts].tolist(), lengths.tolist(), run_ids[firsts].tolist(), strict=True)
    )


def _check_runs(
    runs: list[tuple[int, int, int]], items: Sequence[MultiModalItem], spec: MRopeSpec
) -> None:
    if len(runs) != len(items):
        raise ValueError(
            f"the prompt has {len(runs)} placeholder runs but {len(items)} items were given; "
            "each item needs its own run (runs of one placeholder must be separated by text)"
        )
    for index, (item, (_, length, token_id)) in enumerate(zip(items, runs, strict=True)):
        expected = spec.video_token_id if item.kind == "video" else spec.image_token_id
        if token_id != expected:
            raise ValueError(
                f"item {index} ({item.kind}) sits in a run of token {token_id}; "
                f"its placeholder token is {expected}"
            )
        if length != item.num_tokens:
            raise ValueError(
                f"item {index} ({item.kind}) has {item.num_tokens} tokens but its placeholder "
                f"run has {length}; the two counts must be equal"
            )


def _place_text(positions: torch.Tensor, begin: int, stop: int, next_pos: int) -> int:
    """Write consecutive positions for tokens [begin, stop); return the next text position."""
    num_text = stop - begin
    positions[:, begin:stop] = torch.arange(next_pos, next_pos + num_text)  # [3, num_text]
    return next_pos + num_text


def _place_item(
    positions: torch.Tensor, begin: int, item: MultiModalItem, start: int, spec: MRopeSpec
) -> tuple[int, int]:
    """Write an item's positions from its kept coordinates.

    Returns the next text position and one past the dense grid's largest position.
    """
    grid_t, grid_h, grid_w = item.llm_grid
    kept = item.coords.to("cpu", torch.long)  # [num_kept, 3]
    assert bool((kept >= 0).all()) and bool((kept < kept.new_tensor(item.llm_grid)).all()), (
        f"coords outside the post-merge grid {item.llm_grid}"
    )
    temporal = _temporal_positions(item, spec)  # [grid_t]
    relative = kept.T.clone()  # [3, num_kept]
    relative[0] = temporal[kept[:, 0]]
    positions[:, begin : begin + item.num_tokens] = relative + start
    # temporal is non-decreasing, so its last entry is the dense grid's temporal maximum
    dense_extent = max(int(temporal[-1]) + 1, grid_h, grid_w)
    if spec.text_after_vision == "grid_max":
        return start + dense_extent, start + dense_extent
    return start + max(grid_h, grid_w), start + dense_extent


def _temporal_positions(item: MultiModalItem, spec: MRopeSpec) -> torch.Tensor:
    """Relative temporal position of each tubelet of the dense grid: [grid_t] long."""
    steps = torch.arange(item.llm_grid[0])  # [grid_t]
    if item.kind == "image" or spec.tokens_per_second is None:
        return steps
    # transformers scales in float32 (the processor hands `second_per_grid_ts` over as float32)
    # and truncates only after multiplying by the step; the same ops give the same rounding,
    # e.g. step 3 at 2/3 s and 25 tokens/s is 50 here but 49 in float64.
    interval = spec.tokens_per_second * torch.tensor(item.second_per_grid_ts, dtype=torch.float32)
    return (steps * interval).long()
