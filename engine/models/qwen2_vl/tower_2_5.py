"""Qwen2.5-VL vision tower: the Qwen2-VL tower with RMSNorm, SwiGLU and window attention.

Most blocks attend only within square windows of `window_size` px (112 px = 4 x 4 merged tokens
= 64 patches); the blocks in `fullatt_block_indexes` attend over the whole frame. Windows tile
each frame from the top-left, so frames whose merged width or height is not a multiple of the
window end in narrower windows. To make every window a contiguous segment, the merged tokens
(each a 2x2 group of patches) are reordered once after the patch embedding: frame by frame,
window by window in row-major order, row-major inside a window. That order keeps frames
contiguous for the full-attention blocks, and is undone after the merger. It equals
transformers' `get_vision_window_index`, so the results match to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.models.qwen2_vl.config import VisionConfig
from stillcut.engine.models.qwen2_vl.tower import (
    NORM_EPS,
    Grid,
    Qwen2VLVisionTower,
    frame_cu_seqlens,
)
from stillcut.engine.models.vit import activation


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias."""

    def __init__(self, dim: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class GatedMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)), with biases as in the Qwen2.5-VL tower."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def window_layout(
    grids: list[Grid], merge_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window order of merged tokens and the window segments, for every input.

    `window` is the window side in merged tokens. Returns `order` [num_merged_tokens] (long:
    position i of the window order holds merged token order[i] of the input) and
    `cu_seqlens` [num_windows + 1] (int32, in patches, i.e. merged tokens * merge_size**2).
    """
    orders, window_lengths = [], []
    offset = 0
    for t, h, w in grids:
        rows, cols = h // merge_size, w // merge_size
        windows_per_row = -(-cols // window)
        window_id = (torch.arange(rows)[:, None] // window) * windows_per_row + (
            torch.arange(cols)[None, :] // window
        )  # [rows, cols]
        # A stable sort by window keeps row-major order inside each window.
        frame_order = torch.argsort(window_id.flatten(), stable=True)  # [rows * cols]
        frame_starts = offset + torch.arange(t)[:, None] * (rows * cols)  # [t, 1]
        orders.append((frame_starts + frame_order).flatten())
        window_lengths.append(torch.bincount(window_id.flatten()).repeat(t))
        offset += t * rows * cols
    lengths = torch.cat(window_lengths) * merge_size**2
    return torch.cat(orders), F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


class Qwen2_5_VLVisionTower(Qwen2VLVisionTower):
    """The Qwen2.5-VL vision encoder."""

    @staticmethod
    def make_norm(dim: int) -> nn.Module:
        """RMSNorm in blocks and merger."""
        return RMSNorm(dim)

    @staticmethod
    def make_mlp(config: VisionConfig) -> nn.Module:
        """SwiGLU MLP."""
        return GatedMLP(config)

    def attention_layout(self, grids: list[Grid]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Window order; per block, frame segments (full attention) or window segments."""
        config = self.config
        if not config.has_windows:
            return super().attention_layout(grids)
        order, windows = window_layout(
            grids, config.spatial_merge_size, config.window_merged_tokens
        )
        frames = frame_cu_seqlens(grids)
        full = set(config.fullatt_block_indexes)
        return order, [frames if i in full else windows for i in range(config.depth)]
