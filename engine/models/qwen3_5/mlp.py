"""Qwen3.5's MLPs: the dense SwiGLU, and Qwen3.5-MoE's mixture with a shared expert.

The mixture routes as Qwen3-MoE does (`engine.models.softmax_moe`: softmax over the experts,
the top `num_experts_per_tok` renormalised) and adds a shared SwiGLU expert that every token
takes, scaled by `sigmoid(x . shared_expert_gate)`: `routed + sigmoid(gate) * shared`, summed
in transformers' order. Checkpoints store each expert as its own `gate_proj`, `up_proj` and
`down_proj` (transformers stacks them at load, and unstacks them when it saves); they are
stacked here once. The experts stay in the compute dtype under every weight format
(`EXPERTS` names them for `plan_formats`); the shared expert's projections are prepared like
any dense MLP's. The native CPU decode step reads the mixture as its softmax-routed kind with
the shared expert and its gate (`native_mixer`).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from torch import nn

from stillcut.engine.models.matmul import ProjectingModule, linear, scale_of
from stillcut.engine.models.qwen2_vl.model import Qwen2DecoderLayer
from stillcut.engine.models.softmax_moe import SoftmaxMoE
from stillcut.engine.models.weights import fused_weight, set_weight
from stillcut.kernels.cpu.stack import Activation, GatedMlp, SoftmaxMoe


class SwiGLU(ProjectingModule):
    """`down(silu(gate(x)) * up(x))`, gate and up fused side by side `[hidden, 2 I]`."""

    projections = ("gate_up_weight", "down_weight")
    feed_forward = Qwen2DecoderLayer.feed_forward

    def __init__(self, stored: nn.Module) -> None:
        """From a checkpoint-named MLP (`gate_proj`, `up_proj`, `down_proj`)."""
        super().__init__()
        set_weight(self, "gate_up_weight", *fused_weight([stored.gate_proj, stored.up_proj]))
        set_weight(self, "down_weight", *fused_weight([stored.down_proj]))

    def forward(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual` + the MLP of `normed` `[N, hidden]`."""
        return self.feed_forward(normed, residual)

    def native_mixer(self) -> GatedMlp:
        """The MLP as the native CPU decode step reads it."""
        return GatedMlp(
            self.gate_up_weight,
            self.down_weight,
            Activation.SILU,
            gate_up_scale=scale_of(self, "gate_up_weight"),
            down_scale=scale_of(self, "down_weight"),
        )


EXPERTS = ".mlp.experts."  # in the names of the routed experts' tensors


class SharedExpertMoE(ProjectingModule):
    """The routed experts (`SoftmaxMoE`) plus the gated shared expert (its projections are
    this module's)."""

    projections = SwiGLU.projections
    feed_forward = SwiGLU.feed_forward

    def __init__(self, stored: nn.Module, top_k: int) -> None:
        """From a checkpoint-named MoE MLP (`stored_shared_expert_moe`)."""
        super().__init__()
        experts = stored.experts
        stacked = SimpleNamespace(
            gate=stored.gate,
            experts=SimpleNamespace(
                gate_up_proj=torch.stack(
                    [torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts]
                ),  # [E, 2 I, H]
                down_proj=torch.stack([e.down_proj.weight for e in experts]),  # [E, H, I]
            ),
        )
        self.routed = SoftmaxMoE(stacked, top_k)
        shared = stored.shared_expert
        set_weight(self, "gate_up_weight", *fused_weight([shared.gate_proj, shared.up_proj]))
        set_weight(self, "down_weight", *fused_weight([shared.down_proj]))
        set_weight(self, "shared_gate", *fused_weight([stored.shared_expert_gate]))  # [hidden, 1]

    def forward(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual` + the mixture's output for `normed` `[N, hidden]`."""
        shared = self.feed_forward(normed, None)  # [N, hidden]
        weight = torch.sigmoid(linear(normed, self.matrix("shared_gate")))  # [N, 1]
        return residual + self.routed(normed, weight * shared)

    def native_mixer(self) -> SoftmaxMoe:
        """The mixture as the native CPU decode step reads it: the routed experts' kind with
        the shared expert and its gate."""
        return dataclasses.replace(
            self.routed.native_mixer(),
            shared=SwiGLU.native_mixer(self),
            shared_gate_weight=self.shared_gate,
            shared_gate_scale=scale_of(self, "shared_gate"),
        )


def stored_shared_expert_moe(config) -> nn.Module:
    """A meta-device MoE MLP named as a Qwen3.5-MoE checkpoint names it: the router
    `gate.weight` `[E, H]`, `experts.{e}.{gate,up,down}_proj`, `shared_expert.*` and
    `shared_expert_gate`."""
    hidden, intermediate = config.hidden_size, config.moe_intermediate_size
    with torch.device("meta"):
        mlp = nn.Module()
        mlp.gate = nn.Module()
        mlp.gate.weight = nn.Parameter(torch.empty(config.num_experts, hidden))
        mlp.experts = nn.ModuleList(
            stored_swiglu(hidden, intermediate) for _ in range(config.num_experts)
        )
        mlp.shared_expert = stored_swiglu(hidden, config.shared_expert_intermediate_size)
        mlp.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
    return mlp


def stored_swiglu(hidden: int, intermediate: int) -> nn.Module:
    """A meta-device SwiGLU MLP named as the checkpoint names it."""
    with torch.device("meta"):
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
        mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)
    return mlp
