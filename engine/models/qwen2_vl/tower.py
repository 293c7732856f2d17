"""Qwen2-VL vision tower, and the parts every Qwen vision tower shares.

Input: flattened 3-D patches (channels x 2 frames x 14 x 14 px), in the processor's order, where
each 2x2 group of neighbouring patches is four consecutive rows. The tower embeds them with
the Conv3d weight applied as one matmul, runs `depth` pre-norm blocks of 2-D rotary attention
confined to each frame (tubelet), then merges each 2x2 group into one embedding of the language
model's width. Several images and videos run in one forward pass: their tokens are packed and
attention is kept within each frame by `cu_seqlens`, so there is no padding.

Given a `kept` mask of merge groups (EVS before the tower), only those groups are embedded and
encoded: each keeps its own (h, w) rotary position and its segment (its frame, or its window),
a segment holds only its kept groups (an emptied one adds no rows), and the output is the kept
tokens in input order. That equals the whole input with the dropped groups masked out as
attention keys, to float rounding.

Qwen2-VL uses LayerNorm and a QuickGELU MLP. `qwen2_5_vl.py` subclasses this tower with
RMSNorm, a SwiGLU MLP and window attention. Parameter names equal the checkpoint's `visual.*`
names, so weights load without a mapping.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.models.qwen2_vl.config import VisionConfig
from stillcut.engine.models.qwen2_vl.kept_groups import (
    Grid,
    keep_in_layout,
    kept_rows,
    output_sizes,
    pack_kept,
)
from stillcut.engine.models.vit import VisionMLP
from stillcut.engine.quantization import widened
from stillcut.kernels.vision_attention import varlen_attention

NORM_EPS = 1e-6


def patch_positions(grids: list[Grid], merge_size: int) -> torch.Tensor:
    """(h, w) patch coordinates of every input row, in the merge-grouped row order: [N, 2]."""
    positions = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")  # [h, w]
        grouped = torch.stack([rows, cols], dim=-1)  # [h, w, 2]
        grouped = grouped.view(h // merge_size, merge_size, w // merge_size, merge_size, 2)
        frame = grouped.transpose(1, 2).reshape(h * w, 2)  # [h*w, 2] merge groups contiguous
        positions.append(frame.repeat(t, 1))
    return torch.cat(positions)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D rotary tables: the first half of each head rotates with h, the second with w.

    `positions` [N, 2] -> cos, sin [N, head_dim], laid out for `apply_rotary`.
    """
    exponents = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
    inv_freq = 1.0 / theta**exponents  # [head_dim / 4]
    angles = (positions[:, :, None].float() * inv_freq).flatten(1)  # [N, head_dim / 2] h | w
    angles = torch.cat([angles, angles], dim=-1)  # [N, head_dim]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of `x` [..., head_dim] by angles broadcast from cos/sin."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def frame_cu_seqlens(grids: list[Grid]) -> torch.Tensor:
    """Segment boundaries with one segment per frame (tubelet) of every input: [frames + 1]."""
    lengths = torch.tensor([h * w for t, h, w in grids for _ in range(t)], dtype=torch.int32)
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def check_patches(config: VisionConfig, patches: torch.Tensor, grids: list[Grid]) -> None:
    """Raise ValueError unless `patches` are the flattened patches of `grids` for `config`."""
    merge = config.spatial_merge_size
    if any(t < 1 or h < 1 or w < 1 or h % merge or w % merge for t, h, w in grids):
        raise ValueError(f"grids {grids}: t, h, w must be >= 1, h and w multiples of {merge}")
    num_patches = sum(t * h * w for t, h, w in grids)
    if patches.shape != (num_patches, config.patch_dim):
        raise ValueError(
            f"patches shape {tuple(patches.shape)}; the grids need "
            f"({num_patches}, {config.patch_dim})"
        )


class PatchEmbed(nn.Module):
    """A Conv3d whose stride equals its kernel, applied as one matmul over flattened patches."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        # Kept as a Conv3d so the weight has the checkpoint's shape [hidden, C, 2, 14, 14].
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = widened(self.proj).flatten(1)  # [hidden, C*2*14*14]
        return F.linear(patches.to(weight.device, weight.dtype), weight)  # [N, hidden]


class VisionAttention(nn.Module):
    """Multi-head self-attention with 2-D rotary positions over packed segments."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, -1))  # [N, 3, heads, head_dim]
        qk = apply_rotary(qkv[:, :2], cos, sin)  # [N, 2, heads, head_dim], q and k at once
        out = varlen_attention(qk[:, 0], qk[:, 1], qkv[:, 2], cu_seqlens)  # [N, heads, head_dim]
        return self.proj(out.flatten(1))


class VisionBlock(nn.Module):
    """Pre-norm transformer block; the tower chooses the norm and the MLP."""

    def __init__(self, config: VisionConfig, norm: Callable[[int], nn.Module], mlp: nn.Module):
        super().__init__()
        self.norm1 = norm(config.hidden_size)
        self.attn = VisionAttention(config)
        self.norm2 = norm(config.hidden_size)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, concatenate each 2x2 group of patches, project to the language model's width."""

    def __init__(self, config: VisionConfig, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.merged_width = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = norm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_width, self.merged_width),
            nn.GELU(),
            nn.Linear(self.merged_width, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_width))  # [N / 4, out_hidden]


class Qwen2VLVisionTower(nn.Module):
    """The Qwen2-VL vision encoder: full attention within each frame in every block."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(
            VisionBlock(config, self.make_norm, self.make_mlp(config)) for _ in range(config.depth)
        )
        self.merger = PatchMerger(config, self.make_norm)

    @staticmethod
    def make_norm(dim: int) -> nn.Module:
        """The norm used in blocks and merger."""
        return nn.LayerNorm(dim, eps=NORM_EPS)

    @staticmethod
    def make_mlp(config: VisionConfig) -> nn.Module:
        """The MLP of one block."""
        return VisionMLP(config)

    def attention_layout(self, grids: list[Grid]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """How tokens are ordered and segmented for attention.

        Returns the order of merged tokens the blocks see (None: input order) and, per block,
        the `cu_seqlens` of its attention segments in that order.
        """
        return None, [frame_cu_seqlens(grids)] * self.config.depth

    def forward(
        self, patches: torch.Tensor, grid_thw: torch.Tensor, kept: torch.Tensor | None = None
    ) -> torch.Tensor:
        """transformers' signature: patches [N, patch_dim], grid_thw [num_inputs, 3]; `kept`
        [N / 4] bool (None: all) picks the merge groups to encode (see the module docstring).

        Returns the merged embeddings of all inputs' kept groups, concatenated, in input order:
        [num_kept, out_hidden_size] (N / 4 rows without `kept`).
        """
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        check_patches(self.config, patches, grids)
        group = self.config.spatial_merge_size**2
        order, block_cu_seqlens = self.attention_layout(grids)
        positions = patch_positions(grids, self.config.spatial_merge_size)  # [N, 2]
        if kept is not None:
            order, block_cu_seqlens = keep_in_layout(order, block_cu_seqlens, kept, group)
            patches, positions = kept_rows(patches, kept), kept_rows(positions, kept)
        x = self.patch_embed(patches)  # [num_kept * 4, hidden]
        if order is not None:
            positions = positions.view(-1, group, 2)[order].flatten(0, 1)
            order = order.to(x.device)
            x = x.view(-1, group, x.shape[-1])[order].flatten(0, 1)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        # [N, 1, 1, head_dim]: broadcast over (q | k) and heads; device and dtype of the weights.
        cos, sin = (table[:, None, None].to(x.device, x.dtype) for table in (cos, sin))
        for block, cu_seqlens in zip(self.blocks, block_cu_seqlens, strict=True):
            x = block(x, cos, sin, cu_seqlens)
        merged = self.merger(x)  # [num_kept, out_hidden]
        if order is None:
            return merged
        restored = torch.empty_like(merged)
        restored[order] = merged
        return restored

    def encode(
        self,
        patches_list: list[torch.Tensor],
        grids: list[Grid],
        kept: list[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """Encode several images/videos in one forward pass; one [t*h*w/4, out_hidden] each,
        or with `kept` (per input a [t*h*w/4] bool mask of merge groups, or None: all) the
        kept groups' [num_kept, out_hidden]."""
        if len(patches_list) != len(grids) or not grids:
            raise ValueError(f"got {len(patches_list)} patch tensors for {len(grids)} grids")
        patches = patches_list[0] if len(patches_list) == 1 else torch.cat(patches_list)
        merge = self.config.spatial_merge_size
        merged = self.forward(patches, torch.tensor(grids), pack_kept(kept, grids, merge))
        return list(merged.split(output_sizes(grids, kept, merge)))
