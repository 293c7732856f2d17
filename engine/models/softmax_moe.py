"""A softmax-routed SwiGLU mixture of experts, as several families' MoE language models have it.

Routing as transformers' top-k routers of that kind: router logits `x @ W.T` in the compute
dtype, a float32 softmax over all experts, the top `num_experts_per_tok` taken and renormalised
to sum 1 over the chosen ones, then cast back to the compute dtype. Each expert is a SwiGLU MLP,
`down(silu(gate(x)) * up(x))`; there is no shared expert (unlike the sigmoid-routed, group-
limited relu² kind a hybrid family keeps in its own folder). Checkpoints store the experts as
3-D tensors, `gate_up_proj` `[E, 2I, H]` (gate rows then up rows) and `down_proj` `[E, H, I]`;
they are kept here as `[in, out]` per expert for `linear`. Tokens are grouped by expert once per
step, so each expert runs one product over all of its tokens and only routed experts' weights
are read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.models.matmul import linear


def stored_experts(num_experts: int, hidden: int, intermediate: int) -> nn.Module:
    """A meta-device MoE MLP named as the checkpoint names it: `gate.weight` `[E, H]`,
    `experts.gate_up_proj` `[E, 2I, H]` and `experts.down_proj` `[E, H, I]`."""
    with torch.device("meta"):
        mlp = nn.Module()
        mlp.gate = nn.Module()
        mlp.gate.weight = nn.Parameter(torch.empty(num_experts, hidden))
        mlp.experts = nn.Module()
        mlp.experts.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        mlp.experts.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
    return mlp


class SoftmaxMoE(nn.Module):
    """One MoE MLP built from a checkpoint-named one (`stored_experts`): `router` `[E, H]`,
    `experts_gate_up` `[E, H, 2I]` and `experts_down` `[E, I, H]`, in the compute dtype."""

    def __init__(self, stored: nn.Module, top_k: int) -> None:
        super().__init__()
        num_experts = stored.gate.weight.shape[0]
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must lie in [1, {num_experts}]")
        self.top_k = top_k
        frozen = {"requires_grad": False}
        self.router = nn.Parameter(stored.gate.weight, **frozen)
        gate_up = stored.experts.gate_up_proj.transpose(1, 2).contiguous()
        self.experts_gate_up = nn.Parameter(gate_up, **frozen)
        down = stored.experts.down_proj.transpose(1, 2).contiguous()
        self.experts_down = nn.Parameter(down, **frozen)

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
                gate, up = linear(inputs[rows], self.experts_gate_up[expert]).chunk(2, dim=-1)
                outputs[rows] = linear(F.silu(gate) * up, self.experts_down[expert])
                start += count
        weighted = outputs * weights.reshape(-1)[order, None]  # [N k, H]
        routed = torch.zeros_like(x).index_add_(0, token_of, weighted)  # as transformers sums
        return residual + routed.to(residual.dtype)
