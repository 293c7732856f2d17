"""Threshold-mode EVS: causal, content-adaptive pruning that works on live streams.

Each spatial location remembers its last kept embedding (the reference). The first tubelet of
a stream is kept whole; after that a token is a candidate when its dissimilarity to the
reference is >= tau, so slow drift accumulates until it is caught. Within a tubelet a cap keeps
the most dissimilar candidates and a floor tops up with the most dissimilar others (ties to
the lower index); kept tokens become the new references. Decisions depend only on the past,
so pushing a clip whole or tubelet by tubelet gives the same result.

Without cap or floor, locations are independent and the Triton path runs the whole push in
one kernel. With them, a tubelet's locations compete: the kernel computes the dissimilarity,
torch selects and updates the reference, one tubelet at a time.
"""

from __future__ import annotations

import torch

from stillcut.kernels.evs.config import MAX_DISSIMILARITY, EVSConfig
from stillcut.kernels.evs.ops import (
    Backend,
    check_embeds,
    check_grid,
    pair_dissimilarity,
    triton_kernels,
)
from stillcut.kernels.evs.reference import SUPPORTED_DTYPES
from stillcut.kernels.evs.result import EVSResult, result_from_mask


def retain_in_tubelet(dissimilarity: torch.Tensor, config: EVSConfig) -> torch.Tensor:
    """Keep mask for one tubelet's `[h*w]` dissimilarities under tau, cap and floor."""
    candidates = dissimilarity >= config.threshold  # [h*w]
    if config.max_per_tubelet is None and config.floor == 0:
        return candidates
    num_locations = dissimilarity.numel()
    # Candidates are exactly a prefix of the descending order, so cap and floor only move
    # where that prefix ends; the count stays a tensor to avoid a device sync.
    most = num_locations if config.max_per_tubelet is None else config.max_per_tubelet
    num_kept = candidates.sum().clamp(min(config.floor, num_locations), min(most, num_locations))
    order = torch.sort(dissimilarity, descending=True, stable=True).indices  # [h*w]
    positions = torch.arange(num_locations, device=dissimilarity.device)
    rank = torch.empty_like(order).scatter_(0, order, positions)  # [h*w]
    return rank < num_kept


class ThresholdPruner:
    """Carries per-location references between pushes of a stream (threshold mode).

    `push` takes `[n*h*w, dim]` embeddings of `n >= 1` new tubelets; the result's `kept_index`
    is relative to that push while `kept_coords` count tubelets since the stream began.
    """

    def __init__(
        self,
        config: EVSConfig,
        grid_hw: tuple[int, int],
        dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        backend: Backend = "auto",
    ) -> None:
        if not isinstance(config, EVSConfig) or config.mode != "threshold":
            raise ValueError(
                f"ThresholdPruner needs an EVSConfig with mode='threshold', got {config!r}"
            )
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={dtype} is not one of {SUPPORTED_DTYPES}")
        self.config = config
        self.grid_hw = check_grid(grid_hw, 2, "grid_hw")
        (self.dim,) = check_grid((dim,), 1, "dim")
        self.backend = backend
        h, w = self.grid_hw
        self._reference = torch.zeros(h * w, self.dim, dtype=dtype, device=device)  # [h*w, dim]
        self._num_tubelets = 0
        triton_kernels(backend, self._reference.device)  # reject a bad backend now, not mid-stream

    @property
    def num_tubelets(self) -> int:
        """Tubelets pushed since the stream began (or since `reset`)."""
        return self._num_tubelets

    def reset(self) -> None:
        """Start a new stream: the next tubelet is kept whole."""
        self._num_tubelets = 0

    def push(self, embeds: torch.Tensor) -> EVSResult:
        """Prune the next `n` tubelets of the stream."""
        h, w = self.grid_hw
        num_new = check_embeds(embeds, h * w, self.dim)
        reference = self._reference
        if embeds.dtype != reference.dtype or embeds.device != reference.device:
            raise ValueError(
                f"embeds are {embeds.dtype} on {embeds.device}; this pruner holds "
                f"{reference.dtype} on {reference.device}"
            )
        embeds = embeds.contiguous()
        kernels = triton_kernels(self.backend, embeds.device)
        uncapped = self.config.max_per_tubelet is None and self.config.floor == 0
        if kernels is not None and uncapped:
            dissimilarity, mask = kernels.threshold_stream_triton(
                embeds, reference, self.config.threshold, keep_first=self._num_tubelets == 0
            )
        else:
            dissimilarity, mask = self._push_per_tubelet(embeds, num_new)
        first_t = self._num_tubelets
        self._num_tubelets += num_new
        return result_from_mask(mask, dissimilarity, self.grid_hw, first_t)

    def _push_per_tubelet(
        self, embeds: torch.Tensor, num_new: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        locations = self._reference.shape[0]
        dissimilarity = torch.empty(num_new * locations, dtype=torch.float32, device=embeds.device)
        mask = torch.empty(num_new * locations, dtype=torch.bool, device=embeds.device)
        for j in range(num_new):
            rows = slice(j * locations, (j + 1) * locations)
            tubelet = embeds[rows]  # [h*w, dim]
            if self._num_tubelets == 0 and j == 0:
                dissimilarity[rows] = MAX_DISSIMILARITY
                mask[rows] = True
                self._reference.copy_(tubelet)
                continue
            pair_dissimilarity(
                tubelet, self._reference, out=dissimilarity[rows], backend=self.backend
            )
            keep = retain_in_tubelet(dissimilarity[rows], self.config)  # [h*w]
            mask[rows] = keep
            self._reference[keep] = tubelet[keep]
        return dissimilarity, mask
