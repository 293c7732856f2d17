"""The Qwen3-MoE language model of Qwen3-VL-MoE: the dense Qwen3 model (`model`) whose
`sparse_layers` replace the SwiGLU MLP by the softmax-routed mixture of experts
(`engine.models.softmax_moe`); the others (`mlp_only_layers`, or off the
`decoder_sparse_step`) keep the dense MLP. Experts stay in the compute dtype under every weight
format; int8 formats quantize the attention and dense projections only.
"""

from __future__ import annotations

import torch
from torch import nn

from stillcut.engine.models.qwen3_vl.config import Qwen3TextConfig
from stillcut.engine.models.qwen3_vl.model import Qwen3DecoderLayer, Qwen3LanguageModel
from stillcut.engine.models.softmax_moe import SoftmaxMoE, stored_experts


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """A Qwen3 layer whose MLP is `moe` (a `SoftmaxMoE`) once `use_experts` gave it the
    checkpoint's experts; a dense layer keeps the SwiGLU MLP."""

    def __init__(
        self, config: Qwen3TextConfig, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__(config, dtype, device)
        self.top_k = config.num_experts_per_tok
        self.moe: SoftmaxMoE | None = None

    def use_experts(self, stored: nn.Module) -> None:
        """Route through the experts of a checkpoint-named MoE MLP (`stored_experts`)."""
        self.projections = ("qkv_weight", "o_weight")  # no dense MLP to prepare
        self.gate_up_weight = self.down_weight = None
        self.moe = SoftmaxMoE(stored, self.top_k)

    def feed_forward(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.moe is None:
            return super().feed_forward(normed, residual)
        return self.moe(normed, residual)


class Qwen3MoeLanguageModel(Qwen3LanguageModel):
    """Qwen3-MoE decoder with DeepStack; build with `from_checkpoint`."""

    layer_class = Qwen3MoeDecoderLayer

    @staticmethod
    def checkpoint_layout(config: Qwen3TextConfig) -> nn.Module:
        """The dense layout with each sparse layer's `mlp` the experts' (`stored_experts`)."""
        root = Qwen3LanguageModel.checkpoint_layout(config)
        for index in config.sparse_layers:
            root.layers[index].mlp = stored_experts(
                config.num_experts, config.hidden_size, config.moe_intermediate_size
            )
        return root
