"""NemotronH's mixture-of-experts block: sigmoid routing, relu² experts, a shared expert.

Routing is DeepSeek-V3's, as transformers' `NemotronHTopkRouter` computes it in float32:
scores are `sigmoid(x @ W)`; `scores + e_score_correction_bias` choose the experts (each of
`n_group` groups is rated by its two best, the best `topk_group` groups stay eligible, the top
`num_experts_per_tok` of those are taken) while the unbiased scores weight them, normalised to
sum 1 when `norm_topk_prob`, times `routed_scaling_factor`. The routed experts work in
`moe_latent_size` when the config has one (projections in and out around them); the shared
expert always sees the block's normed input. Tokens are grouped by expert once per step, so
each expert runs one matmul over all of its tokens and only routed experts' weights are read.
"""

from __future__ import annotations

import torch
from torch import nn

from stillcut.engine.models.matmul import StoredMatrix, expert_matrices, linear, scale_of
from stillcut.engine.models.nemotron_omni.blocks import (
    NemotronBlock,
    frozen,
    native_relu2_mlp,
    relu2_mlp,
    rms_norm,
    set_projection,
    stored_mlp,
)
from stillcut.engine.models.nemotron_omni.text_config import NemotronTextConfig
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu.packing import pack_matrices
from stillcut.kernels.cpu.stack import Moe


class MoEBlock(NemotronBlock):
    """One MoE layer; expert weights stacked `[E, in, mid]` and `[E, mid, in]` (int8: scales
    `[E, mid]` and `[E, in]`, one per expert and output channel)."""

    projections = ("shared_up", "shared_down")

    def __init__(self, stored: nn.Module, config: NemotronTextConfig) -> None:
        super().__init__(stored.norm.weight, config.layer_norm_epsilon)
        mixer = stored.mixer
        self.config = config
        self.router = frozen(mixer.gate.weight.float())  # [E, hidden], float32 as transformers
        self.correction_bias = frozen(mixer.gate.e_score_correction_bias.float())  # [E]
        for name in ("up", "down"):
            linears = [getattr(expert, f"{name}_proj") for expert in mixer.experts]
            stacked = pack_matrices([p.weight.T for p in linears])  # packed where they pack
            setattr(self, f"experts_{name}", frozen(stacked))
            scales = [scale_of(p, "weight") for p in linears]
            if scales[0] is not None:
                setattr(self, f"experts_{name}_scale", frozen(torch.stack(scales)))
        self.expert_matrices: list[tuple[StoredMatrix, StoredMatrix]] = []
        shared = mixer.shared_experts
        set_projection(self, "shared_up", [shared.up_proj])
        set_projection(self, "shared_down", [shared.down_proj])
        self.shared_up_bias = frozen(shared.up_proj.bias)
        self.shared_down_bias = frozen(shared.down_proj.bias)
        self.latent_in = self.latent_out = None
        if config.moe_latent_size is not None:
            self.projections = (*self.projections, "latent_in", "latent_out")
            set_projection(self, "latent_in", [mixer.fc1_latent_proj])
            set_projection(self, "latent_out", [mixer.fc2_latent_proj])
            self.latent_in_bias = frozen(mixer.fc1_latent_proj.bias)
            self.latent_out_bias = frozen(mixer.fc2_latent_proj.bias)

    def prepare_projections(self, arithmetic: torch.dtype | None = None) -> None:
        """The shared projections and every expert's pair, prepared for `linear`, long
        batches computing in `arithmetic`."""
        super().prepare_projections(arithmetic)
        self.expert_matrices = expert_matrices(self, ("experts_up", "experts_down"), arithmetic)

    def forward(
        self, hidden: torch.Tensor, metadata: AttentionMetadata, kv_cache: torch.Tensor | None
    ) -> torch.Tensor:
        normed = rms_norm(hidden, self.norm, self.eps)  # [N, hidden]
        expert_ids, weights = self.route(normed)  # [N, k] each
        routed_in = normed
        if self.latent_in is not None:
            routed_in = linear(normed, self.matrix("latent_in"), self.latent_in_bias)
        routed = self.run_experts(routed_in, expert_ids, weights)  # [N, latent or hidden]
        if self.latent_out is not None:
            routed = linear(routed, self.matrix("latent_out"), self.latent_out_bias)
        shared = relu2_mlp(
            normed,
            self.matrix("shared_up"),
            self.matrix("shared_down"),
            self.shared_up_bias,
            self.shared_down_bias,
        )
        return hidden + routed + shared

    def native_mixer(self, cache: int) -> Moe:
        config, latent = self.config, self.latent_in is not None
        return Moe(
            self.router.T,  # [hidden, E]
            self.correction_bias,
            self.experts_up,
            self.experts_down,
            native_relu2_mlp(
                self, "shared_up", "shared_down", self.shared_up_bias, self.shared_down_bias
            ),
            top_k=config.num_experts_per_tok,
            num_groups=config.n_group,
            kept_groups=config.topk_group,
            normalize=config.norm_topk_prob,
            scaling=config.routed_scaling_factor,
            experts_up_scale=scale_of(self, "experts_up"),
            experts_down_scale=scale_of(self, "experts_down"),
            latent_in_weight=self.latent_in if latent else None,
            latent_out_weight=self.latent_out if latent else None,
            latent_in_bias=self.latent_in_bias if latent else None,
            latent_out_bias=self.latent_out_bias if latent else None,
            latent_in_scale=scale_of(self, "latent_in") if latent else None,
            latent_out_scale=scale_of(self, "latent_out") if latent else None,
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids `[N, k]` and their float32 weights `[N, k]` for `x` `[N, hidden]`."""
        config = self.config
        scores = (x.float() @ self.router.T).sigmoid()  # [N, E]
        choice = scores + self.correction_bias
        if config.n_group > 1:
            grouped = choice.view(-1, config.n_group, config.num_experts // config.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, n_group]
            kept_groups = group_scores.topk(config.topk_group, dim=-1, sorted=False).indices
            eligible = torch.zeros_like(group_scores, dtype=torch.bool)
            eligible.scatter_(1, kept_groups, True)
            eligible = eligible[:, :, None].expand_as(grouped).reshape_as(choice)
            choice = choice.masked_fill(~eligible, -torch.inf)
        expert_ids = choice.topk(config.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)  # [N, k]
        if config.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return expert_ids, weights * config.routed_scaling_factor

    def run_experts(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(x): `x` `[N, in]` -> `[N, in]`,
        accumulated in float32 (as transformers does)."""
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.reshape(-1)  # [N k]
        order = flat_ids.argsort(stable=True)
        token_of = order // top_k  # which token each sorted (token, expert) pair is
        counts = torch.bincount(flat_ids, minlength=self.experts_up.shape[0]).tolist()
        inputs = x[token_of]  # [N k, in], grouped by expert
        outputs = torch.empty_like(inputs)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                outputs[rows] = relu2_mlp(inputs[rows], *self._expert(expert))
                start += count
        weighted = outputs.float() * weights.reshape(-1)[order, None]  # [N k, in]
        total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return total.index_add_(0, token_of, weighted).to(x.dtype)

    def _expert(self, expert: int) -> tuple[StoredMatrix, StoredMatrix]:
        """Expert `expert`'s up and down matrices, prepared if `prepare_projections` ran."""
        if self.expert_matrices:
            return self.expert_matrices[expert]
        up, down = self.experts_up[expert], self.experts_down[expert]
        up_scale, down_scale = scale_of(self, "experts_up"), scale_of(self, "experts_down")
        return (
            StoredMatrix(up, None if up_scale is None else up_scale[expert]),
            StoredMatrix(down, None if down_scale is None else down_scale[expert]),
        )


def stored_moe(config: NemotronTextConfig) -> nn.Module:
    """A meta-device MoE mixer named as the checkpoint names it: `experts.{e}.up_proj`,
    `gate.weight`, `gate.e_score_correction_bias`, `shared_experts`, the latent projections."""
    hidden, latent = config.hidden_size, config.moe_latent_size
    expert_in = latent or hidden
    with torch.device("meta"):
        mixer = nn.Module()
        mixer.experts = nn.ModuleList(
            stored_mlp(expert_in, config.moe_intermediate_size, bias=False)
            for _ in range(config.num_experts)
        )
        mixer.gate = nn.Module()
        mixer.gate.weight = nn.Parameter(torch.empty(config.num_experts, hidden))
        mixer.gate.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts))
        mixer.shared_experts = stored_mlp(
            hidden, config.moe_shared_expert_intermediate_size, bias=config.mlp_bias
        )
        if latent is not None:
            mixer.fc1_latent_proj = nn.Linear(hidden, latent, bias=config.mlp_bias)
            mixer.fc2_latent_proj = nn.Linear(latent, hidden, bias=config.mlp_bias)
    return mixer
