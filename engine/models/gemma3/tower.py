"""Gemma 3's vision encoder: a SigLIP ViT and the pooling projector into the language model.

Every image is one `image_size` square (a video's frames are images too). SigLIP's Conv2d patch
embedding runs as one matmul over flattened patches, learned absolute positions are added, and
`num_layers` pre-LayerNorm blocks (biased multi-head attention, GELU-tanh MLP) end in a final
LayerNorm; Gemma 3 reads these patch states, never SigLIP's pooling head. All images have the
same length, so each layer's attention is one batched call over the packed images. The
projector averages each `pool_kernel` square of patches into one token, applies Gemma's RMSNorm
(scale `1 + weight`, computed in float32) and projects to the language model's width.

Parameter names equal the checkpoint's under the canonical `visual.` prefix
(`vision_tower.*`, `multi_modal_projector.*`), so weights load without a mapping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.models.gemma3.config import SiglipVisionConfig
from stillcut.engine.models.vit import VisionMLP, image_patches
from stillcut.engine.quantization import widened
from stillcut.kernels.vision_attention import varlen_attention


class SiglipEmbeddings(nn.Module):
    """Patch embedding plus one learned position embedding per patch."""

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        # A Conv2d only so the weight keeps the checkpoint's shape [hidden, C, P, P].
        self.patch_embedding = nn.Conv2d(
            config.in_channels, config.hidden_size, config.patch_size, config.patch_size
        )
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = widened(self.patch_embedding).flatten(1)  # [hidden, C*P*P]
        patches = image_patches(pixel_values.to(weight.device, weight.dtype), self.patch_size)
        embeds = F.linear(patches, weight, self.patch_embedding.bias)  # [B, N, hidden]
        return embeds + self.position_embedding.weight  # [B, N, hidden]


class SiglipAttention(nn.Module):
    """Bidirectional multi-head attention within each image of a packed batch."""

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            proj(x).unflatten(-1, (self.num_heads, -1))  # [B*N, heads, head_dim]
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        return self.out_proj(varlen_attention(q, k, v, cu_seqlens).flatten(1))  # [B*N, hidden]


class SiglipEncoderLayer(nn.Module):
    """Pre-LayerNorm block: attention then MLP, each added to the residual."""

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cu_seqlens)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    """The stack of encoder layers."""

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_layers))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return x


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer without a pooling head: images -> patch states."""

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, C, S, S] -> last hidden states [B, N, hidden], N = (S / P)^2."""
        embeds = self.embeddings(pixel_values)  # [B, N, hidden]
        batch, num_patches, _ = embeds.shape
        # One segment per image: all equal, so attention is one batched call on views.
        cu_seqlens = torch.arange(0, (batch + 1) * num_patches, num_patches, dtype=torch.int32)
        states = self.encoder(embeds.flatten(0, 1), cu_seqlens)  # [B*N, hidden]
        return self.post_layernorm(states).unflatten(0, (batch, num_patches))


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scale by `1 + weight` (zero-initialised), computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3Projector(nn.Module):
    """Average-pool the patch grid to `mm_tokens_per_image`, RMS-normalise, project."""

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.config = config
        # [vision hidden, text hidden]: applied as `x @ W`, the checkpoint's own layout.
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(config.hidden_size, config.out_hidden_size)
        )
        self.mm_soft_emb_norm = GemmaRMSNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """Patch states [B, N, vision hidden] -> image tokens [B, mm_tokens, text hidden]."""
        config = self.config
        side, kernel = config.tokens_per_side, config.pool_kernel
        grid = states.view(states.shape[0], side, kernel, side, kernel, states.shape[-1])
        pooled = grid.mean(dim=(2, 4)).flatten(1, 2)  # [B, mm_tokens, vision hidden]
        normed = self.mm_soft_emb_norm(pooled)
        projection = widened(self, "mm_input_projection_weight", axis=1)  # [in, out]
        return (normed @ projection).type_as(states)


class Gemma3VisionEncoder(nn.Module):
    """Gemma 3's vision side: images in, language-model embeddings out."""

    # `encode` is device work only, its shapes fixed by the batch's (see `encoder_graphs`)
    capturable_per_shape = True

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = SiglipVisionTower(config)
        self.multi_modal_projector = Gemma3Projector(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, C, S, S] -> [B, mm_tokens_per_image, out_hidden_size]."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def matmul_parameters(self) -> dict[str, int]:
        """The projector's bare `[in, out]` weight: a matrix with output channels on axis 1."""
        return {"multi_modal_projector.mm_input_projection_weight": 1}

    def unused_tensors(self) -> tuple[str, ...]:
        """SigLIP's pooling head, when the checkpoint stores one: Gemma 3 (in transformers too)
        reads the patch states, never the head."""
        return ("vision_tower.head.",) if self.config.has_pooling_head else ()

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Encode a batch of preprocessed images (or frames) in one forward pass.

        `pixel_values` is [B, C, image_size, image_size], as `gemma3_preprocess` makes them;
        returns [B, mm_tokens_per_image, out_hidden_size] in the weights' dtype.
        """
        config = self.config
        expected = (config.in_channels, config.image_size, config.image_size)
        shape = tuple(pixel_values.shape)
        if len(shape) != 4 or shape[0] < 1 or shape[1:] != expected:
            raise ValueError(f"pixel_values shape {shape}; expected (B, *{expected}) with B >= 1")
        return self.forward(pixel_values)
