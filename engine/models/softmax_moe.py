"""A softmax-routed SwiGLU mixture of experts, as several families' MoE language models have it.

Routing as transformers' top-k routers of that kind: router logits `x @ W.T` in the compute
dtype, a float32 softmax over all experts, the top `num_experts_per_tok` taken and renormalised
to sum 1 over the chosen ones, then cast back to the compute dtype. Each expert is a SwiGLU MLP,
`down(silu(gate(x)) * up(x))`; there is no shared expert (unlike the sigmoid-routed, group-
limited relu² kind a hybrid family keeps in its own folder). Checkpoints store the experts as
3-D tensors, `gate_up_proj` `[E, 2I, H]` (gate rows then up rows) and `down_proj` `[E, H, I]`;
they are kept here in their stored format as `[in, out]` per expert for `linear` (int8 per
expert and output channel: `expert_stacks` names them to the loader). Tokens are grouped by
expert once per step, so each expert runs one product over all of its tokens and only routed
experts' weights are read; the native CPU decode step has the kind (`native_mixer`).
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.models.matmul import expert_matrices, linear, scale_of
from stillcut.kernels.cpu import stack
from stillcut.kernels.cpu.packing import pack_matrices
from stillcut.kernels.cpu.stack import Activation

# each stacked tensor of a `StoredExperts` -> the axis of its matrices' output channels
EXPERT_STACKS = MappingProxyType({"experts.gate_up_proj": 1, "experts.down_proj": 1})


class StoredExperts(nn.Module):
    """A MoE MLP as a checkpoint names it (see `stored_experts`)."""


def stored_experts(num_experts: int, hidden: int, intermediate: int) -> nn.Module:
    """A meta-device MoE MLP named as the checkpoint names it: `gate.weight` `[E, H]`,
    `experts.gate_up_proj` `[E, 2I, H]` and `experts.down_proj` `[E, H, I]`."""
    with torch.device("meta"):
        mlp = StoredExperts()
        mlp.gate = nn.Module()
        mlp.gate.weight = nn.Parameter(torch.empty(num_experts, hidden))
        mlp.experts = nn.Module()
        mlp.experts.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        mlp.experts.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
    return mlp


def expert_stacks(root: nn.Module) -> dict[str, int]:
    """State name -> output axis of each stacked experts' tensor of the `stored_experts` MLPs
    under `root`: matrices a model multiplies by, stored and quantized expert by expert."""
    return {
        f"{name}.{leaf}": axis
        for name, module in root.named_modules()
        if isinstance(module, StoredExperts)
        for leaf, axis in EXPERT_STACKS.items()
    }


class SoftmaxMoE(nn.Module):
    """One MoE MLP built from a checkpoint-named one (`stored_experts`): `router` `[E, H]` in
    the compute dtype; `experts_gate_up` `[E, H, 2I]` and `experts_down` `[E, I, H]`, each
    expert's `[in, out]` matrix as stored (packed where it packs, see `pack_matrices`; int8 with
    scales `[E, 2I]` and `[E, H]`, one per expert and output channel)."""

    def __init__(self, stored: nn.Module, top_k: int) -> None:
        super().__init__()
        num_experts = stored.gate.weight.shape[0]
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must lie in [1, {num_experts}]")
        self.top_k = top_k
        frozen = {"requires_grad": False}
        self.router = nn.Parameter(stored.gate.weight, **frozen)
        for name, leaf in (("experts_gate_up", "gate_up_proj"), ("experts_down", "down_proj")):
            stack = getattr(stored.experts, leaf)  # [E, out, in]
            setattr(self, name, nn.Parameter(pack_matrices([m.T for m in stack]), **frozen))
            scale = scale_of(stored.experts, leaf)
            if scale is not None:
                setattr(self, f"{name}_scale", nn.Parameter(scale, **frozen))
        self.prepare_projections()

    def prepare_projections(self, arithmetic: torch.dtype | None = None) -> None:
        """Every expert's pair of matrices prepared for `linear`, long batches computing in
        `arithmetic`."""
        names = ("experts_gate_up", "experts_down")
        self.expert_matrices = expert_matrices(self, names, arithmetic)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids `[N, k]` and their weights `[N, k]` (x's dtype) for `x` `[N, H]`."""
        logits = F.linear(x, self.router)  # [N, E]
        probabilities = logits.softmax(dim=-1, dtype=torch.float32)
        weights, expert_ids = probabilities.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual` + the weighted sum over each token's experts of expert(x): `x` `[N, H]`."""
        expert_ids, weights = self.route(x)
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.reshape(-1)  # [N k]
        order = flat_ids.argsort(stable=True)
        token_of = order // top_k  # the token of each (token, expert) pair, grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.router.shape[0]).tolist()
        inputs = x[token_of]  # [N k, H]
        outputs = torch.empty_like(inputs)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                gate_up, down = self.expert_matrices[expert]
                gate, up = linear(inputs[rows], gate_up).chunk(2, dim=-1)
                outputs[rows] = linear(F.silu(gate) * up, down)
                start += count
        weighted = outputs * weights.reshape(-1)[order, None]  # [N k, H]
        routed = torch.zeros_like(x).index_add_(0, token_of, weighted)  # as transformers sums
        return residual + routed.to(residual.dtype)

    def native_mixer(self) -> stack.SoftmaxMoe:
        """This MLP as a block of the native CPU decode step."""
        return stack.SoftmaxMoe(
            self.router.T,  # [H, E]
            self.experts_gate_up,
            self.experts_down,
            self.top_k,
            Activation.SILU,
            experts_gate_up_scale=scale_of(self, "experts_gate_up"),
            experts_down_scale=scale_of(self, "experts_down"),
        )
