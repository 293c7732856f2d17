"""The Qwen3-MoE language model of Qwen3-VL-MoE: the dense Qwen3 model (`model`) whose
`sparse_layers` replace the SwiGLU MLP by the softmax-routed mixture of experts
(`engine.models.softmax_moe`); the others (`mlp_only_layers`, or off the
`decoder_sparse_step`) keep the dense MLP. Experts are stored as the weight format says
(bfloat16, or int8 per expert and output channel) and decode in the native step's softmax-routed
kind.
"""

from __future__ import annotations

import torch
from torch import nn

from stillcut.engine.models.qwen3_vl.config import Qwen3TextConfig
from stillcut.engine.models.qwen3_vl.model import Qwen3DecoderLayer, Qwen3LanguageModel
from stillcut.engine.models.softmax_moe import SoftmaxMoE, expert_stacks, stored_experts
from stillcut.kernels.cpu.stack import Mixer


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

    def prepare_projections(self, arithmetic: torch.dtype | None = None) -> None:
        """The attention's projections, and the MLP's or every expert's, prepared for `linear`."""
        super().prepare_projections(arithmetic)
        if self.moe is not None:
            self.moe.prepare_projections(arithmetic)

    def feed_forward(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.moe is None:
            return super().feed_forward(normed, residual)
        return self.moe(normed, residual)

    def native_mlp(self) -> Mixer:
        """The dense MLP's block, or the experts' (`SoftmaxMoE.native_mixer`)."""
        return super().native_mlp() if self.moe is None else self.moe.native_mixer()


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

    @staticmethod
    def stacked_matmuls(stored: nn.Module) -> dict[str, int]:
        """The sparse layers' stacked experts (`softmax_moe.expert_stacks`)."""
        return expert_stacks(stored)
