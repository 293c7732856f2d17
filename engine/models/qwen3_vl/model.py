"""The Qwen3 language model of Qwen3-VL (dense), for the runner's flat token batches.

Qwen2's decoder (`qwen2_vl.model`) with what Qwen3 changes: an RMSNorm over each q and k head
before the rotary embedding, no q/k/v bias, an explicit `head_dim`, interleaved M-RoPE (the
(t, h, w) rows take turns across the rotary frequencies instead of holding contiguous
sections), and DeepStack: after each of the first `num_deepstack` layers, the tower's feature
set `deepstack.k` is added to the hidden states at the visual positions. The runner hands those
rows in `mm_features` for exactly the item tokens a step computes (`PagedLanguageModel`).

Decode steps run in the native CPU decode step (its attention kind has the per-head q/k norm;
M-RoPE's interleaving is its section table; the MoE model's experts are their own kind).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.model_config import ModelConfig
from stillcut.engine.models.qwen2_vl.model import MRoPE, Qwen2DecoderLayer, Qwen2LanguageModel
from stillcut.engine.models.qwen3_vl.config import Qwen3TextConfig, text_config
from stillcut.engine.models.qwen3_vl.tower import deepstack_names
from stillcut.engine.models.weights import (
    checkpoint_layer,
    checkpoint_layout,
    empty_weight,
    fuse_projections,
    set_weight,
)
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu.stack import Stack


class InterleavedMRoPE(MRoPE):
    """M-RoPE whose rotary frequency j turns with h when j % 3 == 1 and j < 3 * h_section, with
    w when j % 3 == 2 and j < 3 * w_section, else with t (transformers' Qwen3-VL layout)."""

    def __init__(self, config: Qwen3TextConfig, device: torch.device | str = "cpu") -> None:
        super().__init__(config, device)
        _, h_section, w_section = config.mrope_section
        rows = torch.zeros(config.head_dim // 2, dtype=torch.long, device=device)  # [D/2]
        rows[1 : 3 * h_section : 3] = 1
        rows[2 : 3 * w_section : 3] = 2
        self.section = nn.Buffer(rows, persistent=False)


class Qwen3DecoderLayer(Qwen2DecoderLayer):
    """Qwen2's layer without q/k/v bias, with RMSNorm scales `qk_norm` [Hq + Hkv, D] (the
    checkpoint's `q_norm` for every q head, then its `k_norm` for every k head)."""

    def __init__(
        self, config: Qwen3TextConfig, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__(config, dtype, device)
        self.qkv_bias = None
        heads = config.num_heads + config.num_kv_heads
        self.qk_norm = empty_weight(heads, config.head_dim, dtype=dtype, device=device)

    def qk_transform(self, qk: torch.Tensor) -> torch.Tensor:
        """The q heads then the k heads [N, Hq + Hkv, D], each RMS-normed with its scales."""
        return F.rms_norm(qk, qk.shape[-1:], None, self.eps) * self.qk_norm


class Qwen3LanguageModel(Qwen2LanguageModel):
    """Qwen3 decoder with DeepStack over a flat batch of tokens with paged KV; build with
    `from_checkpoint`. `mm_feature_names` are the DeepStack sets, in layer order."""

    layer_class = Qwen3DecoderLayer
    rotary_class = InterleavedMRoPE

    def __init__(self, config: Qwen3TextConfig, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.mm_feature_names = deepstack_names(config.num_deepstack)

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        mm_mask: torch.Tensor | None = None,
        mm_features: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The decoder over input embeddings `hidden` [N, hidden] -> final-normed [N, hidden].

        `positions` [3, N] are M-RoPE (t, h, w) positions; `mm_features[deepstack.k]` [M,
        hidden] is added at the M rows `mm_mask` [N] marks after layer k.
        """
        cos, sin = self.rotary(positions, hidden.dtype)  # [N, 1, D] each
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, cos, sin, kv_cache, metadata)
            if mm_features is not None and index < len(self.mm_feature_names):
                feature = mm_features[self.mm_feature_names[index]]
                hidden[mm_mask] += feature.to(hidden.dtype)
        return F.rms_norm(hidden, hidden.shape[-1:], self.norm, self.config.rms_norm_eps)

    @staticmethod
    def read_text_config(model_config: ModelConfig) -> Qwen3TextConfig:
        """Qwen3's text config (see `config.text_config`)."""
        return text_config(model_config)

    @staticmethod
    def checkpoint_layout(config: Qwen3TextConfig) -> nn.Module:
        """Meta-device modules named like the checkpoint's `language_model.*` tensors: Qwen2's
        without q/k/v bias, with `self_attn.q_norm` / `k_norm`."""
        layers = []
        for _ in range(config.num_layers):
            layer = checkpoint_layer(
                config.hidden_size,
                config.intermediate_size,
                config.num_heads * config.head_dim,
                config.num_kv_heads * config.head_dim,
                qkv_bias=False,
                norms=("input_layernorm", "post_attention_layernorm"),
            )
            with torch.device("meta"):
                layer.self_attn.q_norm = nn.RMSNorm(config.head_dim)
                layer.self_attn.k_norm = nn.RMSNorm(config.head_dim)
            layers.append(layer)
        return checkpoint_layout(config.vocab_size, config.hidden_size, layers)

    @staticmethod
    def fill_layer(layer: nn.Module, stored: nn.Module) -> None:
        """Fused projections, the two layer norms and the q / k head norms; a layer whose
        checkpoint MLP is experts (Qwen3-MoE) takes them with `use_experts`."""
        sparse = hasattr(stored.mlp, "experts")
        fuse_projections(layer, stored, mlp=not sparse)
        if sparse:
            layer.use_experts(stored.mlp)
        for name in ("input_layernorm", "post_attention_layernorm"):
            set_weight(layer, name, getattr(stored, name).weight)
        attn = stored.self_attn
        qk_norm = torch.cat(
            [
                attn.q_norm.weight.expand(layer.num_heads, -1),
                attn.k_norm.weight.expand(layer.num_kv_heads, -1),
            ]
        )  # [Hq + Hkv, D]
        set_weight(layer, "qk_norm", qk_norm)

    def native_stack(self) -> Stack | None:
        """Qwen2's stack with each attention's q / k head norms (a sparse layer's MLP is its
        experts' block); the interleaved section table is the rotary's own."""
        stack = super().native_stack()
        blocks = list(stack.blocks)
        for index, layer in enumerate(self.layers):
            attention = blocks[2 * index]  # each layer is an attention block, then its MLP's
            blocks[2 * index] = replace(
                attention, mixer=replace(attention.mixer, qk_norm=layer.qk_norm)
            )
        return replace(stack, blocks=blocks)
