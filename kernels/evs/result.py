"""What EVS hands back: the retention mask and everything derived from it.

Kept tokens keep their original (t, h, w) coordinates so that positions are computed from
them later, never re-derived from a dense grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EVSResult:
    """The outcome of pruning `num_tubelets * h * w` tokens.

    `mask` and `dissimilarity` are indexed by flat (t, h, w) position; `kept_index` lists the
    kept positions in ascending order and `kept_coords` their (t, h, w). The first tubelet of
    a clip or stream reports dissimilarity 2.0, the largest cosine dissimilarity there is.
    """

    mask: torch.Tensor  # [num_tokens] bool
    kept_index: torch.Tensor  # [num_kept_tokens] long, ascending
    kept_coords: torch.Tensor  # [num_kept_tokens, 3] long, (t, h, w)
    kept_per_tubelet: torch.Tensor  # [num_tubelets] long
    dissimilarity: torch.Tensor  # [num_tokens] float32

    @property
    def num_kept_tokens(self) -> int:
        """How many tokens survive."""
        return self.kept_index.numel()


def result_from_mask(
    mask: torch.Tensor, dissimilarity: torch.Tensor, grid_hw: tuple[int, int], first_t: int = 0
) -> EVSResult:
    """Derive indices, coordinates and counts from a flat retention mask.

    `first_t` is the temporal coordinate of the mask's first tubelet (streams count on).
    """
    h, w = grid_hw
    tokens_per_tubelet = h * w
    assert mask.dtype == torch.bool and mask.dim() == 1, (mask.dtype, mask.shape)
    assert mask.numel() % tokens_per_tubelet == 0, (mask.numel(), grid_hw)
    assert dissimilarity.shape == mask.shape, (dissimilarity.shape, mask.shape)
    kept_index = mask.nonzero().squeeze(1)  # [K]
    spatial = kept_index % tokens_per_tubelet
    kept_coords = torch.stack(
        (kept_index // tokens_per_tubelet + first_t, spatial // w, spatial % w), dim=1
    )  # [K, 3]
    kept_per_tubelet = mask.view(-1, tokens_per_tubelet).sum(dim=1)  # [num_tubelets]
    return EVSResult(mask, kept_index, kept_coords, kept_per_tubelet, dissimilarity)
