"""1-D positions of Gemma 3 prompts whose image items EVS may have pruned.

Unpruned, a token's position is its sequence index. A kept image token takes its item's start
plus its index in the unpruned item (read from its coordinates), and every token after an item
moves on by the tokens the item dropped, so text and decode positions equal those of the
unpruned prompt. Only positions change: the sliding window still counts sequence slots, as
transformers' mask does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stillcut.engine.multimodal import MultiModalItem


def gemma3_positions(
    token_ids: Sequence[int] | torch.Tensor,
    items: Sequence[MultiModalItem],
    placements: Sequence[tuple[int, int]] | None,
    *,
    image_token_id: int,
    boi_token_id: int,
) -> tuple[torch.Tensor, int]:
    """Positions [1, prompt_len] long and the position of the token after the prompt.

    `placements` (offset, length) per item, in prompt order; None places each item right
    after the next `<start_of_image>` (`boi_token_id`), where Gemma 3 prompts put it, which
    also places items EVS emptied. Items must sit on `image_token_id` tokens.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long, device="cpu")  # [L]
    if placements is None:
        placements = _placements_after_boi(ids, items, boi_token_id)
    if len(placements) != len(items):
        raise ValueError(f"{len(placements)} placements given for {len(items)} items")
    num_dropped = torch.zeros(ids.numel() + 1, dtype=torch.long)  # [L + 1], at item ends
    kept = []
    cursor = 0
    for index, (item, (offset, length)) in enumerate(zip(items, placements, strict=True)):
        _check_placement(ids, index, item, offset, length, cursor, image_token_id)
        kept.append((offset, offset + _dense_index(item)))
        num_dropped[offset + length] += item.num_dense_tokens - length
        cursor = offset + length
    shift = num_dropped.cumsum(0)  # [L + 1]: tokens dropped before each index
    positions = torch.arange(ids.numel()) + shift[:-1]  # [L]
    for offset, relative in kept:
        # an item's tokens all take the shift from before the item
        positions[offset : offset + relative.numel()] = relative + shift[offset]
    return positions[None], ids.numel() + int(shift[-1])


def _placements_after_boi(
    ids: torch.Tensor, items: Sequence[MultiModalItem], boi_token_id: int
) -> list[tuple[int, int]]:
    starts = (torch.nonzero(ids == boi_token_id).flatten() + 1).tolist()
    if len(starts) != len(items):
        raise ValueError(
            f"the prompt has {len(starts)} <start_of_image> tokens but {len(items)} items were "
            "given; each item follows its own"
        )
    return [(start, item.num_tokens) for start, item in zip(starts, items, strict=True)]


def _check_placement(ids, index, item, offset, length, cursor, image_token_id) -> None:
    if length != item.num_tokens:
        raise ValueError(
            f"item {index} has {item.num_tokens} tokens but its placement has {length}"
        )
    if offset < cursor or offset + length > ids.numel():
        raise ValueError(f"item {index} at ({offset}, {length}) overlaps or leaves the prompt")
    if not bool((ids[offset : offset + length] == image_token_id).all()):
        raise ValueError(
            f"item {index} must sit on {length} image tokens {image_token_id} from index {offset}"
        )


def _dense_index(item: MultiModalItem) -> torch.Tensor:
    """Each kept token's index in its unpruned item: [num_tokens] long, strictly increasing."""
    _, grid_h, grid_w = item.llm_grid
    coords = item.coords.to("cpu", torch.long)  # [num_tokens, 3]
    index = (coords[:, 0] * grid_h + coords[:, 1]) * grid_w + coords[:, 2]  # [num_tokens]
    assert bool((index >= 0).all()) and bool((index < item.num_dense_tokens).all()), (
        f"coords outside the item's grid {item.llm_grid}"
    )
    assert bool((index[1:] > index[:-1]).all()), "kept tokens stay in their unpruned order"
    return index
