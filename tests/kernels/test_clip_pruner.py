"""`ClipPruner` fed a clip window by window keeps exactly what `prune` keeps on the whole clip,
in both modes, with the extra row sets following the same selection."""

import pytest
import torch

from stillcut.kernels.evs import EVSConfig, prune
from stillcut.kernels.evs.clip_pruner import ClipPruner

GRID = (11, 3, 4)  # tubelets, h, w


def _clip(seed: int, static: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    t, h, w = GRID
    embeds = torch.randn(t * h * w, 16, generator=generator)
    if static:  # repeated tubelets: many exact ties at dissimilarity 0
        embeds = embeds.view(t, h * w, 16)[:, :, :].clone()
        embeds[1::2] = embeds[0::2][: embeds[1::2].shape[0]]
        embeds = embeds.view(-1, 16)
    return embeds


@pytest.mark.parametrize(
    "config",
    [
        EVSConfig(mode="rate", rate=0.75),
        EVSConfig(mode="rate", rate=0.3),
        EVSConfig(mode="rate", rate=0.0),
        EVSConfig(mode="threshold", threshold=1.0),
        EVSConfig(mode="threshold", threshold=0.9, floor=2, max_per_tubelet=5),
        None,
    ],
)
@pytest.mark.parametrize("window", [1, 2, 4, 11])
@pytest.mark.parametrize("static", [False, True])
def test_windows_keep_what_the_whole_clip_keeps(config, window, static):
    embeds = _clip(7, static)
    draft = embeds[:, :5] * 3
    t, h, w = GRID
    pruner = ClipPruner(config, (h, w), t)
    for first in range(0, t, window):
        rows = slice(first * h * w, min(t, first + window) * h * w)
        pruner.push(embeds[rows], draft[rows])
    kept = pruner.finish()
    if config is None:
        index = torch.arange(t * h * w)
        per_tubelet = torch.full((t,), h * w)
    else:
        whole = prune(embeds, GRID, config)
        index, per_tubelet = whole.kept_index, whole.kept_per_tubelet
        torch.testing.assert_close(kept.kept_coords, whole.kept_coords, rtol=0, atol=0)
    torch.testing.assert_close(kept.rows[0], embeds[index], rtol=0, atol=0)
    torch.testing.assert_close(kept.rows[1], draft[index], rtol=0, atol=0)
    assert kept.kept_per_tubelet.tolist() == per_tubelet.tolist()
