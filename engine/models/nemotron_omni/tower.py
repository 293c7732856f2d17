"""Nemotron 3 Nano Omni's vision tower: a RADIO ViT, pixel shuffle and the MLP projector.

An image is cut into 16-pixel patches projected by `embedder`; a video tubelet (two frames
stacked on the channels) by `video_embedder`. The learned position table (a square grid for
the largest image) is resized bilinearly to a square of the longer side and cropped to the
patch grid, as transformers' `RadioPatchEmbeddings` does; learned cls and register tokens lead
each sequence through the pre-LayerNorm blocks (biased attention, GELU MLP, layer scales) and
are dropped after. `merge_size` x `merge_size` neighbouring patches are then pixel-shuffled
into one token (channels in row-major order of the square) and projected (RMSNorm, linear,
relu², linear) to the language model's width. Checkpoints whose language model has MTP layers
LayerNorm the features first. Every tubelet of a video, and every image, is its own sequence.

Parameter names equal the checkpoint's under the canonical `visual.` prefix
(`radio_model.model.*`, `mlp1.*`, `vision_projector.*`), so weights load without a mapping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.models.nemotron_omni.config import RadioVisionConfig
from stillcut.engine.models.vit import image_patches
from stillcut.engine.quantization import widened
from stillcut.kernels.vision_attention import varlen_attention


class _Token(nn.Module):
    def __init__(self, num_tokens: int, hidden_size: int) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.empty(num_tokens, hidden_size))


class RadioPatchGenerator(nn.Module):
    """Patch (or tubelet) embedding, the cropped position table, and the prefix tokens."""

    def __init__(self, config: RadioVisionConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.num_channels = config.num_channels
        self.table_side = config.max_img_size // config.patch_size
        patch_dim = config.num_channels * config.patch_size**2
        self.embedder = nn.Linear(patch_dim, config.hidden_size, bias=False)
        self.video_embedder = nn.Linear(
            config.temporal_patch_size * patch_dim, config.hidden_size, bias=False
        )
        self.pos_embed = nn.Parameter(torch.empty(1, self.table_side**2, config.hidden_size))
        self.cls_token = _Token(config.num_prefix_tokens, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] (C = 3: images; a multiple of 3: tubelets) -> [B, prefix + HW/P², D]."""
        video = pixel_values.shape[1] != self.num_channels
        projection = self.video_embedder if video else self.embedder
        weight = widened(projection)  # [D, patch_dim]
        patches = image_patches(pixel_values.to(weight.device, weight.dtype), self.patch_size)
        embeds = F.linear(patches, weight)  # [B, N, D]
        rows, cols = (side // self.patch_size for side in pixel_values.shape[-2:])
        embeds = embeds + self.positions(rows, cols, embeds.dtype)
        prefix = self.cls_token.token.expand(embeds.shape[0], -1, -1)
        return torch.cat([prefix, embeds], dim=1)

    def positions(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """Position embeddings of a `rows` x `cols` patch grid: [1, rows * cols, D]."""
        table = self.pos_embed.reshape(1, self.table_side, self.table_side, -1)
        table = table.permute(0, 3, 1, 2).float()  # [1, D, side, side]
        side = max(rows, cols)
        square = F.interpolate(table, size=(side, side), mode="bilinear", align_corners=False)
        return square[..., :rows, :cols].to(dtype).flatten(2).transpose(1, 2)


class LayerScale(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.lambda1 = nn.Parameter(torch.empty(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.lambda1


class RadioAttention(nn.Module):
    """Bidirectional attention within each sequence; q, k, v stored fused as `qkv`."""

    def __init__(self, config: RadioVisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.qkv_bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, -1))  # [T, 3, heads, head_dim]
        out = varlen_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens)
        return self.proj(out.flatten(1))  # [T, D]


class RadioMLP(nn.Module):
    def __init__(self, config: RadioVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.mlp_size)
        self.fc2 = nn.Linear(config.mlp_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class RadioBlock(nn.Module):
    """Pre-LayerNorm attention and MLP, each scaled per channel before the residual."""

    def __init__(self, config: RadioVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = RadioAttention(config)
        self.layer_scale1 = LayerScale(config.hidden_size)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = RadioMLP(config)
        self.layer_scale2 = LayerScale(config.hidden_size)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.layer_scale1(self.attn(self.norm1(x), cu_seqlens))
        return x + self.layer_scale2(self.mlp(self.norm2(x)))


class RadioViT(nn.Module):
    def __init__(self, config: RadioVisionConfig) -> None:
        super().__init__()
        self.patch_generator = RadioPatchGenerator(config)
        self.blocks = nn.ModuleList(RadioBlock(config) for _ in range(config.num_layers))


class ProjectorNorm(nn.Module):
    """The projector's RMSNorm, in float32 (weight included), as transformers computes it."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps)
        return normed.to(x.dtype)


class ReLU2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()


class RadioVisionTower(nn.Module):
    """RADIO, pixel shuffle and the projector: pixels -> language-model embeddings."""

    def __init__(self, config: RadioVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.radio_model = nn.Module()
        self.radio_model.model = RadioViT(config)
        self.mlp1 = nn.Sequential(
            ProjectorNorm(config.projector_input_size),
            nn.Linear(config.projector_input_size, config.projector_hidden_size, bias=False),
            ReLU2(),
            nn.Linear(config.projector_hidden_size, config.text_hidden_size, bias=False),
        )
        if config.final_layernorm:
            self.vision_projector = nn.Module()
            self.vision_projector.vision_final_layernorm = nn.LayerNorm(
                config.hidden_size, eps=config.layer_norm_eps
            )

    def unused_tensors(self) -> tuple[str, ...]:
        """Stored parts transformers' model never reads (its processor normalises pixels)."""
        return ("radio_model.summary_idxs", "radio_model.input_conditioner.")

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images or tubelets of one size `[B, C, H, W]` -> `[B * tokens, text_hidden]`,
        `tokens = (H / P / merge) * (W / P / merge)` in row-major order per input."""
        config = self.config
        vit = self.radio_model.model
        embeds = vit.patch_generator(pixel_values)  # [B, prefix + N, D]
        batch, length, _ = embeds.shape
        cu_seqlens = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32)
        states = embeds.flatten(0, 1)  # [B * (prefix + N), D]
        for block in vit.blocks:
            states = block(states, cu_seqlens)
        features = states.unflatten(0, (batch, length))[:, config.num_prefix_tokens :]
        if config.final_layernorm:
            features = self.vision_projector.vision_final_layernorm(features)
        rows, cols = (side // config.patch_size for side in pixel_values.shape[-2:])
        return self.mlp1(pixel_shuffle(features, rows, cols, config.merge_size)).flatten(0, 1)


def pixel_shuffle(features: torch.Tensor, rows: int, cols: int, merge: int) -> torch.Tensor:
    """[B, rows * cols, D] patches -> [B, rows/m * cols/m, m² D] tokens: each m x m square of
    patches, concatenated in row-major order, as transformers' `pixel_shuffle` lays it out."""
    batch, _, channels = features.shape
    grid = features.reshape(batch, rows // merge, merge, cols // merge, merge, channels)
    merged = grid.permute(0, 1, 3, 2, 4, 5)  # [B, rows/m, cols/m, m, m, D]
    return merged.reshape(batch, (rows // merge) * (cols // merge), merge * merge * channels)
