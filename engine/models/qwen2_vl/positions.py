"""M-RoPE positions for prompts whose video items may have been pruned by EVS.

Qwen2-VL and Qwen2.5-VL give every token three position ids (temporal, height, width). Text
tokens count up with all three rows equal. A vision item's tokens sit at the item's start plus
their own (t, h, w), read from the kept coordinates, so a kept token has the position it would
have had without pruning. Where positions resume after an item depends only on the item's dense
grid, never on what was kept, so the text and decode positions of a pruned prompt equal those of
the unpruned one. Work is vectorized per item: a 16k-token video costs a few tensor ops.

Positions are a fold over the sequence: `extend_mrope` places tokens appended after an
`MRopeCursor` and returns the cursor after them, so a streaming request's appended input costs
O(its tokens), and a video tubelet appended right after the previous one joins its logical video.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    video_token_id: int | None  # None: the family writes videos as images
    tokens_per_second: float | None = None
    text_after_vision: TextAfterVision = "spatial_extent"

    def __post_init__(self) -> None:
        for name in ("image_token_id", "video_token_id"):
            value = getattr(self, name)
            if (value is None and name == "image_token_id") or (value is not None and value < 0):
                raise ValueError(f"{name}={value} must be >= 0")
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


@dataclass(frozen=True)
class _OpenVideo:
    """The logical video a sequence ends with: a video item appended right after joins it."""

    start: int  # position its coordinates count from
    grid_t: int  # tubelets of its dense grid so far
    first: MultiModalItem  # its first member: frame size, frame rate


@dataclass(frozen=True)
class MRopeCursor:
    """Where M-RoPE positions stand after a sequence: the next text token's position, one past
    the largest position so far, and the video the sequence ends with (None after text)."""

    next_text: int = 0
    end: int = 0
    open_video: _OpenVideo | None = None

    @property
    def next_position(self) -> int:
        """Where a generated token goes: after every position so far (transformers' deltas)."""
        return max(self.end, self.next_text)

    def after_decoded(self, num_tokens: int) -> MRopeCursor:
        """The cursor after `num_tokens` generated tokens at `next_position` onwards."""
        end = self.next_position + num_tokens
        return MRopeCursor(end, end)


def mrope_positions(
    token_ids: Sequence[int] | torch.Tensor,
    items: Sequence[MultiModalItem],
    spec: MRopeSpec,
    placements: Sequence[tuple[int, int]] | None = None,
) -> MRopePositions:
    """M-RoPE positions of a prompt, on the CPU.

    `placements[i] = (offset, length)` places `items[i]`; by default each maximal run of
    `<|image_pad|>` / `<|video_pad|>` tokens holds the next items, in order, filling it exactly.
    Items whose placements touch form one logical video (a live stream's tubelets): they share
    one start, their coordinates count tubelets from that start, and the logical video's dense
    grid is the largest of theirs.
    """
    positions, cursor = extend_mrope(MRopeCursor(), token_ids, items, spec, placements)
    return MRopePositions(positions, cursor.next_position)


def extend_mrope(
    cursor: MRopeCursor,
    token_ids: Sequence[int] | torch.Tensor,
    items: Sequence[MultiModalItem],
    spec: MRopeSpec,
    placements: Sequence[tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, MRopeCursor]:
    """Positions [3, len(token_ids)] of tokens that follow `cursor`, and the cursor after them.

    As `mrope_positions`, placements relative to `token_ids`; a video item at offset 0 joins
    the cursor's open video."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device="cpu")  # [num_tokens]
    if ids.dim() != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tuple(ids.shape)}")
    if placements is None:
        placements = _placements_from_runs(_placeholder_runs(ids, spec), items)
    groups = _logical_items(ids, items, placements, spec)

    positions = torch.empty(3, ids.numel(), dtype=torch.long)  # [3, num_tokens]
    text_from = 0  # index of the first token not yet placed
    for group_start, group_end, members in groups:
        cursor = _place_text(positions, text_from, group_start, cursor)
        cursor = _place_group(positions, members, cursor, spec)
        text_from = group_end
    return positions, _place_text(positions, text_from, ids.numel(), cursor)


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


def _placements_from_runs(
    runs: list[tuple[int, int, int]], items: Sequence[MultiModalItem]
) -> list[tuple[int, int]]:
    """Fill each run with the next items, in order; their token counts must add up to it."""
    placements, index = [], 0
    for run_number, (run_start, run_length, _) in enumerate(runs):
        filled = 0
        while filled < run_length and index < len(items):
            placements.append((run_start + filled, items[index].num_tokens))
            filled += items[index].num_tokens
            index += 1
        if filled != run_length:
            raise ValueError(
                f"placeholder run {run_number} has {run_length} tokens but its items have "
                f"{filled}; the two counts must be equal"
            )
    if index != len(items):
        raise ValueError(
            f"the prompt has placeholder runs for {index} items but {len(items)} items were given"
        )
    return placements


def _logical_items(
    ids: torch.Tensor,
    items: Sequence[MultiModalItem],
    placements: Sequence[tuple[int, int]],
    spec: MRopeSpec,
) -> list[tuple[int, int, list[tuple[int, MultiModalItem]]]]:
    """Group items whose placements touch: (first index, end index, [(offset, item)])."""
    if len(placements) != len(items):
        raise ValueError(f"{len(placements)} placements given for {len(items)} items")
    groups: list[tuple[int, int, list[tuple[int, MultiModalItem]]]] = []
    for index, (item, (offset, length)) in enumerate(zip(items, placements, strict=True)):
        if length != item.num_tokens:
            raise ValueError(
                f"item {index} ({item.kind}) has {item.num_tokens} tokens but its placeholder "
                f"run has {length}; the two counts must be equal"
            )
        # a family without a video token writes a video's frames on image placeholders
        is_video = item.kind == "video" and spec.video_token_id is not None
        expected = spec.video_token_id if is_video else spec.image_token_id
        if not bool((ids[offset : offset + length] == expected).all()):
            raise ValueError(
                f"item {index} ({item.kind}) must sit on {length} tokens of its placeholder "
                f"{expected} from index {offset}"
            )
        if groups and groups[-1][1] == offset and item.kind == "video" == groups[-1][2][-1][1].kind:
            first, _, members = groups[-1]
            groups[-1] = (first, offset + length, [*members, (offset, item)])
        else:
            if groups and offset < groups[-1][1]:
                raise ValueError(f"item {index} overlaps the item before it")
            groups.append((offset, offset + length, [(offset, item)]))
    return groups


def _place_text(positions: torch.Tensor, begin: int, stop: int, cursor: MRopeCursor) -> MRopeCursor:
    """Write consecutive positions for tokens [begin, stop); return the cursor after them."""
    if stop == begin:
        return cursor
    next_text = cursor.next_text + stop - begin
    positions[:, begin:stop] = torch.arange(cursor.next_text, next_text)  # [3, num_text]
    return MRopeCursor(next_text, max(cursor.end, next_text))


def _place_group(
    positions: torch.Tensor,
    members: list[tuple[int, MultiModalItem]],
    cursor: MRopeCursor,
    spec: MRopeSpec,
) -> MRopeCursor:
    """Write the positions of one logical item from its members' kept coordinates; a video
    at offset 0 continues the cursor's open video. Returns the cursor after it."""
    video = cursor.open_video
    if video is None or members[0][0] != 0 or members[0][1].kind != "video":
        video = _OpenVideo(cursor.next_text, 0, members[0][1])
    first = video.first
    grid_h, grid_w = first.llm_grid[1:]
    grid_t = max(video.grid_t, *(item.llm_grid[0] for _, item in members))
    for offset, item in members:
        assert item.llm_grid[1:] == (grid_h, grid_w), "one logical video has one frame size"
        assert item.second_per_grid_ts == first.second_per_grid_ts, "and one frame rate"
        kept = item.coords.to("cpu", torch.long)  # [num_kept, 3]
        assert bool((kept >= 0).all()) and bool((kept < kept.new_tensor(item.llm_grid)).all()), (
            f"coords outside the post-merge grid {item.llm_grid}"
        )
        temporal = _temporal_positions(first, item.llm_grid[0], spec)  # [item grid_t]
        relative = kept.T.clone()  # [3, num_kept]
        relative[0] = temporal[kept[:, 0]]
        positions[:, offset : offset + item.num_tokens] = relative + video.start
    # temporal positions do not decrease, so the last is the dense grid's temporal maximum
    last_temporal = int(_temporal_positions(first, grid_t, spec)[-1])
    dense_end = video.start + max(last_temporal + 1, grid_h, grid_w)
    next_text = (
        dense_end if spec.text_after_vision == "grid_max" else video.start + max(grid_h, grid_w)
    )
    open_video = replace(video, grid_t=grid_t) if first.kind == "video" else None
    return MRopeCursor(next_text, max(cursor.end, dense_end), open_video)


def _temporal_positions(item: MultiModalItem, grid_t: int, spec: MRopeSpec) -> torch.Tensor:
    """Relative temporal position of each tubelet of the dense grid: [grid_t] long."""
    steps = torch.arange(grid_t)  # [grid_t]
    if item.kind == "image" or spec.tokens_per_second is None:
        return steps
    # transformers scales in float32 (the processor hands `second_per_grid_ts` over as float32)
    # and truncates only after multiplying by the step; the same ops give the same rounding,
    # e.g. step 3 at 2/3 s and 25 tokens/s is 50 here but 49 in float64.
    interval = spec.tokens_per_second * torch.tensor(item.second_per_grid_ts, dtype=torch.float32)
    return (steps * interval).long()
