"""The pixel stage's metric: what EVS compares before the vision tower runs.

A token of a tower that merges patches 2x2 is one merge group (2x2 patches of a tubelet), which
the preprocessing lays out as `merge**2` consecutive rows of normalised pixels (channel, frame,
y, x). Its feature is that group's pixels less their frame's mean colour (per channel, over the
whole frame), flattened, plus one constant coordinate `PIXEL_FLOOR * sqrt(dim)`; the existing
EVS kernels then compare features with `1 - cos` exactly as they compare embeddings, in both
modes, on torch or Triton.

Why so (bench/evs_pixels.py measures the candidates against the tower's own EVS decisions):
normalised pixels need no weights, cost no matmul, and mean the same on every checkpoint with
the same normalisation, so one threshold serves them all, where the patch embedding's output
depends on trained weights like the embeddings' tau. The frame's mean colour goes because a
camera's brightness flicker moves every pixel of a frame: on static footage it made the whole
frame look changed, and rate mode spent its tokens on one flickering tubelet. A group close to
its frame's mean colour then has pixels near zero, where a plain cosine compares noise
directions: the constant coordinate makes such a group's dissimilarity about its mean squared
pixel change over `2 * PIXEL_FLOOR**2` instead. The floor is large (4 normalised-pixel RMS
units), so for most groups the metric is in effect that squared change: on static clips, where
every change is noise, it keeps the later tokens on the objects as the tower's own EVS does,
which the demo model, trained on the tower's choices, counts by (figures: `bench/RESULTS.md`,
"EVS before the tower").
The dissimilarity stays in [0, 2]. Each tubelet is centred on its own frames, so streaming a
clip tubelet by tubelet gives the features of the whole clip.
"""

from __future__ import annotations

import torch

# Normalised-pixel RMS (per value) at which a group's own magnitude counts as much as the floor:
# four standard deviations of the normalisation.
PIXEL_FLOOR = 4.0
# The pixel stage's default threshold (live sessions): on 200 training clips of the demo task it
# keeps what the embeddings' default 0.1 keeps there with the shipped checkpoint's tower
# (`bench/evs_accuracy.py --stage pixels` calibrates it: 0.0071, 21.0 % of the tokens). Its
# values are small because the floor is large: for a group near its frame's mean colour, a mean
# squared change of about 0.23 per value (in units of the normalisation's variance).
PIXEL_THRESHOLD = 0.0071


def group_features(
    patches: torch.Tensor,
    group_size: int,
    num_tubelets: int,
    num_channels: int,
    num_frames: int,
    floor: float = PIXEL_FLOOR,
) -> torch.Tensor:
    """Features of every merge group of `num_tubelets` tubelets: `patches`
    `[num_groups * group_size, patch_dim]`, each group `group_size` consecutive rows and each
    row `num_channels` x `num_frames` x pixels -> `[num_groups, group_size * patch_dim + 1]`
    float32 (`floor`: the stage's own unless a bench compares others)."""
    num_patches, patch_dim = patches.shape
    assert num_patches % (group_size * num_tubelets) == 0, (patches.shape, group_size)
    assert patch_dim % (num_channels * num_frames) == 0, (patch_dim, num_channels, num_frames)
    shape = (num_tubelets, -1, num_channels, num_frames, patch_dim // (num_channels * num_frames))
    frames = patches.float().reshape(shape)  # [t, patches, channels, frames, pixels]
    centred = frames - frames.mean(dim=(1, 4), keepdim=True)  # less [t, 1, C, F, 1]
    grouped = centred.reshape(num_patches // group_size, group_size * patch_dim)
    constant = grouped.new_full((grouped.shape[0], 1), floor * grouped.shape[1] ** 0.5)
    return torch.cat((grouped, constant), dim=1)
