"""The pixel stage's metric: what EVS compares before the vision tower runs.

A token of a Qwen-style tower is one merge group (2x2 patches of a tubelet), which the
preprocessing lays out as `merge**2` consecutive rows of normalised pixels. Its feature is that
group's pixels, flattened (`[group * patch_dim]`), plus one constant coordinate
`PIXEL_FLOOR * sqrt(dim)`; the existing EVS kernels then compare features with `1 - cos`
exactly as they compare embeddings, in both modes, on torch or Triton.

Why pixels and why the floor (bench/evs_pixel_metric.py measures both candidates against the
tower's own EVS decisions): normalised pixels need no weights, cost no matmul, and mean the same
on every checkpoint with the same normalisation, so one threshold serves them all; the patch
embedding's output depends on trained weights, like the embeddings' tau. A group close to the
normalisation mean has pixels near zero, where a plain cosine compares noise directions: the
constant coordinate makes such a group's dissimilarity about its squared pixel difference over
`2 * PIXEL_FLOOR**2` (per value) instead, while a group far from zero keeps its cosine. The
dissimilarity stays in [0, 2].
"""

from __future__ import annotations

import torch

# Normalised-pixel RMS (per value) at which a group's own magnitude counts as much as the floor:
# about one standard deviation of the normalisation, twice a demo clip's median group RMS.
PIXEL_FLOOR = 1.0
# The pixel stage's default threshold (live sessions): on 200 training clips of the demo task it
# keeps what the embeddings' default 0.1 keeps there, 21.3 % (bench/evs_pixels.py `calibrate`).
PIXEL_THRESHOLD = 0.067


def group_features(patches: torch.Tensor, group_size: int) -> torch.Tensor:
    """Features of every merge group: `patches` `[num_groups * group_size, patch_dim]`, each
    group `group_size` consecutive rows -> `[num_groups, group_size * patch_dim + 1]` float32."""
    assert patches.dim() == 2 and patches.shape[0] % group_size == 0, (patches.shape, group_size)
    grouped = patches.reshape(-1, group_size * patches.shape[1])  # [num_groups, dim]
    features = grouped.new_empty((grouped.shape[0], grouped.shape[1] + 1), dtype=torch.float32)
    features[:, :-1] = grouped
    features[:, -1] = PIXEL_FLOOR * grouped.shape[1] ** 0.5
    return features
