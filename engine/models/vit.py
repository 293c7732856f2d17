"""Vision-transformer blocks that several families' towers share.

A tower is a model like any other: it lives with its family in `engine/models/<family>/`, and
what more than one tower uses stands here (the activation names configs give, the plain MLP,
cutting images into flattened patches). Attention over packed segments is
`kernels.vision_attention.varlen_attention`, which every tower calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """The sigmoid approximation of GELU used by CLIP-style towers."""
    return x * torch.sigmoid(1.702 * x)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function a config's `hidden_act` names."""
    functions = {
        "silu": F.silu,
        "quick_gelu": quick_gelu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    }
    if name not in functions:
        raise ValueError(f"hidden_act={name!r}; allowed: {', '.join(functions)}")
    return functions[name]


def image_patches(pixel_values: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Non-overlapping patches in row-major order: [B, C, H, W] -> [B, H*W / P^2, C*P*P].

    Each patch is flattened channel-major, the layout of a Conv2d weight's `flatten(1)`.
    """
    batch, channels, height, width = pixel_values.shape
    rows, cols = height // patch_size, width // patch_size
    grid = pixel_values.reshape(batch, channels, rows, patch_size, cols, patch_size)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(batch, rows * cols, -1)


class VisionMLP(nn.Module):
    """fc1 -> activation -> fc2; `config` has `hidden_size`, `intermediate_size` and
    `hidden_act`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
