"""A designed starting point for the vision tower's patch embedding: thumbnails and motion.

A transformer tower trained from scratch on a few thousand clips learns colour at once but
shape and motion slowly: its patch embedding starts as random projections of each 2x14x14 RGB
tubelet patch. The trainer instead starts most output channels as fixed, readable filters, and
trains them like every other weight: per-channel means and 2x2 thumbnails (colour and layout),
even and odd gratings at four orientations in each colour channel (edges, bars and curves:
what tells the shapes apart), and the change from the first frame to the second in each
quadrant and along each axis, in brightness and in each colour channel (motion). The remaining
channels keep their random start. Every filter has unit norm, like the random ones scaled up.
"""

from __future__ import annotations

import math

import torch

_PATCH = 14


def designed_filters(temporal: int = 2, patch: int = _PATCH) -> torch.Tensor:
    """[num_filters, 3, temporal, patch, patch] unit-norm filters (see the module docstring)."""
    ys, xs = torch.meshgrid(torch.arange(patch), torch.arange(patch), indexing="ij")
    both = torch.ones(temporal) / temporal  # average over the tubelet's frames
    change = torch.linspace(-1.0, 1.0, temporal)  # second frame minus the first
    channels = [torch.eye(3)[c] for c in range(3)]
    brightness = torch.ones(3) / 3
    filters = [_filter(c, both, torch.ones(patch, patch)) for c in channels]
    filters += [
        _filter(c, both, _cell(ys, xs, 2, i, j))
        for c in channels
        for i in range(2)
        for j in range(2)
    ]
    filters += [_filter(c, both, grating) for c in channels for grating in _gratings(ys, xs)]
    filters += [
        _filter(brightness, change, _cell(ys, xs, 2, i, j)) for i in range(2) for j in range(2)
    ]
    ramp = torch.linspace(-1.0, 1.0, patch)
    along_x, along_y = ramp[None, :].expand(patch, patch), ramp[:, None].expand(patch, patch)
    filters += [_filter(brightness, change, along_x), _filter(brightness, change, along_y)]
    # The same changes in each colour channel: a saturated shape on a muted ground of the same
    # brightness changes no brightness as it moves (with these, the tower learned each token's
    # motion in about 300 steps; with brightness alone, not in 600).
    filters += [
        _filter(c, change, space)
        for c in channels
        for space in (along_x, along_y, torch.ones(patch, patch))
    ]
    return torch.stack(filters)


def init_patch_embedding(weight: torch.Tensor) -> None:
    """Overwrite the first channels of a patch-embedding weight [hidden, 3, t, p, p] in place
    with `designed_filters`, scaled to the norm of the random channels they replace."""
    filters = designed_filters(weight.shape[2], weight.shape[3])
    count = min(len(filters), weight.shape[0])
    with torch.no_grad():
        scale = weight[:count].flatten(1).norm(dim=1).mean()
        weight[:count] = filters[:count] * scale


def _gratings(ys: torch.Tensor, xs: torch.Tensor) -> list[torch.Tensor]:
    """Even and odd gratings of one cycle per patch at 0, 45, 90 and 135 degrees: [p, p] each.
    Straight edges, thin bars and curves light them up in different proportions."""
    size = ys.shape[0]
    centred_y, centred_x = ys - (size - 1) / 2, xs - (size - 1) / 2
    gratings = []
    for angle in (0.0, math.pi / 4, math.pi / 2, 3 * math.pi / 4):
        phase = 2 * math.pi / size * (centred_x * math.cos(angle) + centred_y * math.sin(angle))
        gratings += [torch.cos(phase), torch.sin(phase)]
    return gratings


def _cell(ys: torch.Tensor, xs: torch.Tensor, cells: int, i: int, j: int) -> torch.Tensor:
    """[p, p] indicator of cell (i, j) when the patch is cut into cells x cells."""
    size = ys.shape[0]
    return ((ys * cells // size == i) & (xs * cells // size == j)).float()


def _filter(colour: torch.Tensor, time: torch.Tensor, space: torch.Tensor) -> torch.Tensor:
    """The unit-norm outer product colour [3] x time [t] x space [p, p]."""
    kernel = colour[:, None, None, None] * time[None, :, None, None] * space[None, None]
    return kernel / kernel.norm()
