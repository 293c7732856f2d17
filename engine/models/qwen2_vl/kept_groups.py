"""EVS before the tower: which merge groups a Qwen tower encodes, and where they go.

A tower given a `kept` mask of merge groups embeds and encodes only those. Every kept group
keeps its (h, w) (rotary positions, a learned position table) and its attention segment (its
frame, or its window), and a segment holds only its kept groups: an emptied window or tubelet
adds no rows to any block. These helpers restrict the tower's inputs and attention layout to
the kept groups and size each input's output; the towers call them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Grid = tuple[int, int, int]  # (t, h, w) in patches, t counted in tubelets


def kept_rows(rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The rows of the kept merge groups: `rows` `[num_groups * group, ...]`, each group's rows
    consecutive, and `kept` `[num_groups]` bool -> `[num_kept * group, ...]`."""
    return rows.unflatten(0, (kept.shape[0], -1))[kept].flatten(0, 1)


def kept_segments(
    cu_seqlens: torch.Tensor, kept_in_order: torch.Tensor, group: int
) -> torch.Tensor:
    """The same attention segments holding only the kept groups: `cu_seqlens` (in patches) over
    groups in the order of `kept_in_order` ([num_groups] bool) -> the kept segments' bounds."""
    kept_before = F.pad(kept_in_order.cumsum(0, dtype=torch.int32), (1, 0))  # [num_groups + 1]
    return kept_before[cu_seqlens.long() // group] * group


def keep_in_layout(
    order: torch.Tensor | None, block_cu_seqlens: list[torch.Tensor], kept: torch.Tensor, group: int
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """`attention_layout`'s order and segments restricted to the kept groups: the order now
    ranks kept groups (their index among the kept ones), every segment keeps its kept groups."""
    in_order = kept if order is None else kept[order]  # [num_groups] in the blocks' order
    restricted: dict[int, torch.Tensor] = {}  # blocks share segment tensors: restrict each once
    for cu_seqlens in block_cu_seqlens:
        if id(cu_seqlens) not in restricted:
            restricted[id(cu_seqlens)] = kept_segments(cu_seqlens, in_order, group)
    segments = [restricted[id(cu_seqlens)] for cu_seqlens in block_cu_seqlens]
    if order is None:
        return None, segments
    rank = kept.cumsum(0) - 1  # [num_groups]: each kept group's index among the kept
    return rank[order[in_order]], segments


def pack_kept(
    kept: list[torch.Tensor | None] | None, grids: list[Grid], merge: int
) -> torch.Tensor | None:
    """Per-input kept masks (None: every group) as one mask over the packed groups, or None
    when every group of every input is kept (the tower then runs as without masks, bit for
    bit); ValueError for a mask of the wrong shape."""
    if kept is None:
        return None
    if len(kept) != len(grids):
        raise ValueError(f"got {len(kept)} kept masks for {len(grids)} grids")
    masks = []
    for mask, (t, h, w) in zip(kept, grids, strict=True):
        num_groups = t * h * w // merge**2
        if mask is None:
            mask = torch.ones(num_groups, dtype=torch.bool)
        elif mask.dtype != torch.bool or mask.shape != (num_groups,):
            raise ValueError(
                f"a kept mask must be bool [{num_groups}] for grid {(t, h, w)}, got "
                f"{mask.dtype} {list(mask.shape)}"
            )
        masks.append(mask.cpu())
    packed = torch.cat(masks)
    return None if bool(packed.all()) else packed


def output_sizes(
    grids: list[Grid], kept: list[torch.Tensor | None] | None, merge: int
) -> list[int]:
    """Each input's number of output tokens: its kept groups (all, without a mask)."""
    kept = kept or [None] * len(grids)
    return [
        t * h * w // merge**2 if mask is None else int(mask.sum())
        for (t, h, w), mask in zip(grids, kept, strict=True)
    ]
