"""Qwen3-VL vision tower: Qwen2-VL's blocks with a learned position table and DeepStack.

Input: flattened 3-D patches (channels x 2 frames x 16 x 16 px) in the processor's order, each
2x2 merge group four consecutive rows. The Conv3d (with bias) embeds them; the learned square
position table is resampled bilinearly (corners aligned) to each frame's patch grid and added;
`depth` pre-norm blocks of 2-D rotary attention confined to each frame follow (no windows).
The merger turns each 2x2 group into one embedding of the language model's width; each block
in `deepstack_visual_indexes` also feeds its own merger (normed after the 2x2 concatenation),
whose outputs are the item's DeepStack feature sets `deepstack.k`, row for row with the
embeddings. Given a `kept` mask of merge groups (EVS before the tower: `kept_groups`), only
those are encoded: each takes the position table at its own (h, w), and the DeepStack sets hold
the kept groups only. Parameter names equal the checkpoint's `visual.*` names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.models.qwen2_vl.kept_groups import (
    kept_rows,
    kept_segments,
    output_sizes,
    pack_kept,
)
from stillcut.engine.models.qwen2_vl.tower import (
    NORM_EPS,
    Grid,
    VisionBlock,
    check_patches,
    frame_cu_seqlens,
    patch_positions,
    rotary_cos_sin,
)
from stillcut.engine.models.qwen3_vl.config import Qwen3VisionConfig
from stillcut.engine.models.vit import activation
from stillcut.engine.multimodal import TowerOutput
from stillcut.engine.quantization import widened


def deepstack_names(count: int) -> tuple[str, ...]:
    """The feature-set names of `count` DeepStack mergers, in decoder-layer order."""
    return tuple(f"deepstack.{k}" for k in range(count))


class PatchEmbed(nn.Module):
    """A biased Conv3d whose stride equals its kernel, applied as one matmul."""

    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = widened(self.proj).flatten(1)  # [hidden, C*2*16*16]
        bias = self.proj.bias.to(weight.dtype)
        return F.linear(patches.to(weight.device, weight.dtype), weight, bias)  # [N, hidden]


class VisionMLP(nn.Module):
    """linear_fc1 -> activation -> linear_fc2, as the checkpoint names them."""

    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """LayerNorm (per patch, or over the concatenated 2x2 group when `after_concat`), then
    linear_fc1, GELU, linear_fc2 to the language model's width."""

    def __init__(self, config: Qwen3VisionConfig, after_concat: bool) -> None:
        super().__init__()
        self.merged_width = config.hidden_size * config.spatial_merge_size**2
        self.after_concat = after_concat
        self.norm = nn.LayerNorm(self.merged_width if after_concat else config.hidden_size, 1e-6)
        self.linear_fc1 = nn.Linear(self.merged_width, self.merged_width)
        self.linear_fc2 = nn.Linear(self.merged_width, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.after_concat:
            normed = self.norm(x.view(-1, self.merged_width))
        else:
            normed = self.norm(x).view(-1, self.merged_width)
        return self.linear_fc2(F.gelu(self.linear_fc1(normed)))  # [N / 4, out_hidden]


def layer_norm(dim: int) -> nn.Module:
    """The blocks' norm."""
    return nn.LayerNorm(dim, eps=NORM_EPS)


def position_table(table: torch.Tensor, grids: list[Grid], merge_size: int) -> torch.Tensor:
    """The learned `[side * side, hidden]` position table resampled to every input's patch
    grid, in the merge-grouped row order of the patches: [N, hidden]."""
    side = int(table.shape[0] ** 0.5)
    square = table.T.reshape(1, -1, side, side)  # [1, hidden, side, side]
    rows = []
    for t, h, w in grids:
        grid = F.interpolate(square.float(), (h, w), mode="bilinear", align_corners=True)
        frame = grid[0].permute(1, 2, 0)  # [h, w, hidden]
        grouped = frame.reshape(h // merge_size, merge_size, w // merge_size, merge_size, -1)
        rows.append(grouped.transpose(1, 2).reshape(h * w, -1).repeat(t, 1))
    return torch.cat(rows).to(table.dtype)


class Qwen3VLVisionTower(nn.Module):
    """The Qwen3-VL vision encoder; `encode` gives each input's embeddings and DeepStack sets."""

    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(
            VisionBlock(config, layer_norm, VisionMLP(config)) for _ in range(config.depth)
        )
        self.merger = PatchMerger(config, after_concat=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, after_concat=True) for _ in config.deepstack_visual_indexes
        )
        self.feature_names = deepstack_names(len(config.deepstack_visual_indexes))

    def forward(
        self, patches: torch.Tensor, grid_thw: torch.Tensor, kept: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """patches [N, patch_dim], grid_thw [num_inputs, 3], `kept` [N / 4] bool (None: all)
        -> the merged embeddings of all inputs' kept groups [num_kept, out_hidden] and the
        DeepStack features, one [num_kept, out_hidden] each."""
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        check_patches(self.config, patches, grids)
        merge = self.config.spatial_merge_size
        learned = position_table(self.pos_embed.weight, grids, merge)  # [N, hidden]
        positions = patch_positions(grids, merge)  # [N, 2]
        cu_seqlens = frame_cu_seqlens(grids)
        if kept is not None:
            patches, learned, positions = (
                kept_rows(x, kept) for x in (patches, learned, positions)
            )
            cu_seqlens = kept_segments(cu_seqlens, kept, merge**2)
        x = self.patch_embed(patches)  # [num_kept * 4, hidden]
        x = x + learned.to(x.dtype)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        # [num_kept * 4, 1, 1, head_dim]: broadcast over (q | k) and heads
        cos, sin = (table[:, None, None].to(x.device, x.dtype) for table in (cos, sin))
        mergers = dict(
            zip(self.config.deepstack_visual_indexes, self.deepstack_merger_list, strict=True)
        )
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu_seqlens)
            if index in mergers:
                deepstack.append(mergers[index](x))
        return self.merger(x), deepstack

    def encode(
        self,
        patches_list: list[torch.Tensor],
        grids: list[Grid],
        kept: list[torch.Tensor | None] | None = None,
    ) -> list[TowerOutput]:
        """Encode several images/videos in one pass: per input its embeddings
        [t*h*w/4, out_hidden] and its DeepStack feature sets of the same rows; with `kept`
        (per input a [t*h*w/4] bool mask of merge groups, or None: all) the kept rows only."""
        if len(patches_list) != len(grids) or not grids:
            raise ValueError(f"got {len(patches_list)} patch tensors for {len(grids)} grids")
        patches = patches_list[0] if len(patches_list) == 1 else torch.cat(patches_list)
        merge = self.config.spatial_merge_size
        merged, deepstack = self.forward(
            patches, torch.tensor(grids), pack_kept(kept, grids, merge)
        )
        sizes = output_sizes(grids, kept, merge)
        per_input = [tensor.split(sizes) for tensor in (merged, *deepstack)]
        return [
            TowerOutput(parts[0], dict(zip(self.feature_names, parts[1:], strict=True)))
            for parts in zip(*per_input, strict=True)
        ]
