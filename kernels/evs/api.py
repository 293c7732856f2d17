"""`prune`: EVS on one whole clip, in either mode."""

from __future__ import annotations

import torch

from stillcut.kernels.evs.config import EVSConfig
from stillcut.kernels.evs.ops import Backend, check_embeds, check_grid
from stillcut.kernels.evs.rate import prune_rate
from stillcut.kernels.evs.result import EVSResult
from stillcut.kernels.evs.threshold import ThresholdPruner


def prune(
    embeds: torch.Tensor,
    grid: tuple[int, int, int],
    config: EVSConfig,
    *,
    backend: Backend = "auto",
) -> EVSResult:
    """Prune a clip's video tokens.

    `embeds` is `[t*h*w, dim]` in flat (t, h, w) order and `grid` the post-merge `(t, h, w)`.
    Rate mode reproduces vLLM's retention mask; threshold mode is a fresh `ThresholdPruner`
    pushed the whole clip. `backend` forces "torch" or "triton"; "auto" runs Triton on CUDA.
    """
    if not isinstance(config, EVSConfig):
        raise TypeError(f"config must be an EVSConfig, got {type(config).__name__}")
    num_tubelets, h, w = check_grid(grid, 3, "grid")
    if check_embeds(embeds, h * w) != num_tubelets:
        raise ValueError(
            f"embeds has {embeds.shape[0]} tokens; grid={grid} needs {num_tubelets * h * w}"
        )
    if config.mode == "rate":
        return prune_rate(embeds.contiguous(), (num_tubelets, h, w), config.rate, backend)
    pruner = ThresholdPruner(
        config, (h, w), embeds.shape[1], embeds.device, embeds.dtype, backend=backend
    )
    return pruner.push(embeds)
