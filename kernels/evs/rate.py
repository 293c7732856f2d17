"""Rate-mode EVS: vLLM's published retention rule, reproduced mask for mask.

vLLM ranks every token by `1 - cos` to the same location one tubelet earlier, puts the first
tubelet on top with a sentinel, takes one stable descending order over the flat (t, h, w) clip
and keeps the first `max(h*w, int(t*h*w*(1 - q)))`. The first tubelet sorts first and sits at
the lowest indices, so it is simply kept and only the later tubelets are sorted for the
remaining slots; the stable sort gives ties to the lower index, as vLLM's does.
"""

from __future__ import annotations

import torch

from stillcut.kernels.evs.config import MAX_DISSIMILARITY, num_retained_tokens
from stillcut.kernels.evs.ops import Backend, pair_dissimilarity
from stillcut.kernels.evs.result import EVSResult, result_from_mask


def prune_rate(
    embeds: torch.Tensor, grid: tuple[int, int, int], rate: float, backend: Backend = "auto"
) -> EVSResult:
    """Keep vLLM's share of `embeds` (`[t*h*w, dim]`, contiguous) for pruning rate `rate`."""
    num_tubelets, h, w = grid
    tokens_per_tubelet = h * w
    num_tokens = num_tubelets * tokens_per_tubelet
    dissimilarity = torch.empty(num_tokens, dtype=torch.float32, device=embeds.device)
    dissimilarity[:tokens_per_tubelet] = MAX_DISSIMILARITY
    later = dissimilarity[tokens_per_tubelet:]  # [(t-1)*h*w], a view filled in place
    # Row i of the later tubelets against row i one tubelet earlier: both contiguous slices.
    pair_dissimilarity(
        embeds[tokens_per_tubelet:], embeds[:-tokens_per_tubelet], out=later, backend=backend
    )
    num_later_kept = num_retained_tokens(num_tubelets, tokens_per_tubelet, rate)
    num_later_kept -= tokens_per_tubelet
    order = torch.sort(later, descending=True, stable=True).indices  # [(t-1)*h*w]
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=embeds.device)
    mask[:tokens_per_tubelet] = True
    mask[order[:num_later_kept] + tokens_per_tubelet] = True
    return result_from_mask(mask, dissimilarity, (h, w))
