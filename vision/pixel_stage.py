"""EVS before the tower (`EVSConfig(stage="pixels")`): choose the tokens, then encode only them.

Each token's merge group of normalised pixels is compared (`kernels.evs.pixels`) with the same
group one tubelet earlier (rate mode) or with the last kept group at its location (threshold
mode), by the same rules as EVS after the tower; the tower then encodes the kept groups only
(`kept` masks, see `engine.models.qwen2_vl.kept_groups`). A setting that keeps every token
takes the ordinary path. A family whose tower cannot encode a subset of its tokens refuses the
stage by its registry entry's `pixel_stage_refusal`.

Rate mode ranks the whole clip, so a clip that streams through the tower a window at a time is
read twice: first its groups are scored (pixels only, no tower; `clip_pixel_mask`), then the
kept ones are encoded. Threshold mode is causal and decides window by window.
"""

from __future__ import annotations

import torch

from stillcut.engine.models.registry import ModelFamily
from stillcut.kernels.evs import EVSConfig, EVSResult, ThresholdPruner, prune
from stillcut.kernels.evs.clip_pruner import ClipPruner
from stillcut.kernels.evs.result import result_from_mask


def pixel_evs(evs: EVSConfig | None) -> EVSConfig | None:
    """`evs` when it prunes before the tower and may drop a token, else None (the ordinary
    tower pass serves it)."""
    if evs is None or not evs.before_tower or evs.keeps_all:
        return None
    return evs


def check_pixel_stage(family: ModelFamily, evs: EVSConfig | None) -> None:
    """Raise ValueError when `evs` asks for EVS before the tower and `family` cannot do it."""
    if evs is not None and evs.before_tower and family.pixel_stage_refusal is not None:
        raise ValueError(
            f"EVS stage 'pixels' (before the vision tower) does not apply to "
            f"{family.model_type} checkpoints: {family.pixel_stage_refusal}; use stage "
            "'embeddings' (EVS after the tower)"
        )


def merged_grid(grid_thw: tuple[int, int, int], merge: int) -> tuple[int, int, int]:
    """The token grid (t, h, w) of a pre-merge patch grid."""
    t, h, w = grid_thw
    return t, h // merge, w // merge


def prune_pixels(media, prepared, evs: EVSConfig) -> EVSResult:
    """Which tokens of one preprocessed clip EVS keeps, measured on their pixels."""
    grid = merged_grid(prepared.grid_thw, media.merge_size)
    return prune(media.pixel_features(prepared), grid, evs)


class PixelScores:
    """Rate mode over a clip pushed a window at a time: the tokens to keep, from pixels alone
    (`ClipPruner` holding scores, not rows). `grid` is the clip's token grid (t, h, w)."""

    def __init__(self, evs: EVSConfig, grid: tuple[int, int, int]) -> None:
        num_tubelets, h, w = grid
        self._pruner = ClipPruner(evs, (h, w), num_tubelets, hold_rows=False)
        self._grid = grid

    def push(self, media, prepared) -> None:
        """Score the next window's tokens."""
        self._pruner.push(media.pixel_features(prepared))

    def mask(self) -> torch.Tensor:
        """[clip tokens] bool, flat (t, h, w) order: the tokens rate mode keeps."""
        num_tubelets, h, w = self._grid
        t, row, col = self._pruner.finish().kept_coords.cpu().unbind(1)
        mask = torch.zeros(num_tubelets * h * w, dtype=torch.bool)
        mask[(t * h + row) * w + col] = True
        return mask


class WindowPixels:
    """Which tokens of each window of a clip the tower encodes: decided causally (threshold
    mode) or read off the whole clip's `clip_mask` (rate mode, from `PixelScores`)."""

    def __init__(self, evs: EVSConfig, clip_mask: torch.Tensor | None = None) -> None:
        self.evs = evs
        self._clip_mask = clip_mask
        self._pruner: ThresholdPruner | None = None
        self._num_tubelets = 0  # pushed so far

    def push(self, media, prepared) -> EVSResult:
        """The next window's choice: mask over its tokens, coordinates counting on in t."""
        num_tubelets, h, w = merged_grid(prepared.grid_thw, media.merge_size)
        first_t, self._num_tubelets = self._num_tubelets, self._num_tubelets + num_tubelets
        if self._clip_mask is not None:
            mask = self._clip_mask[first_t * h * w : self._num_tubelets * h * w]
            return result_from_mask(mask, torch.zeros(mask.shape), (h, w), first_t)
        features = media.pixel_features(prepared)
        if self._pruner is None:
            self._pruner = ThresholdPruner(self.evs, (h, w), features.shape[1])
        return self._pruner.push(features)
