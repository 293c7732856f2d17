"""Qwen3.5's Gated DeltaNet layer over the runner's flat batch, with per-request state.

One fused projection gives the conv input q|k|v, the output gate z, beta's logits b and the
decay's input a. q|k|v go through a depthwise causal conv (SiLU, no bias) after the request's
stored inputs; q and k are L2-normalised; the gated delta rule (`kernels.gated_delta`) runs
from the request's stored matrix state with `g = -exp(A_log) softplus(a + dt_bias)` and
`beta = sigmoid(b)`; the output is RMS-normalised per value head, times the norm's weight and
`silu(z)`, and projected back. Decoding requests share one batched step; each prompt chunk
runs the chunked rule on its own, split where the step saves snapshots of the state
(`RecurrentMetadata.captures`). Both states stay float32 (the cache group says so).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.models.matmul import ProjectingModule, linear, scale_of
from stillcut.engine.models.qwen3_5.config import Qwen35TextConfig
from stillcut.engine.models.weights import fused_weight, set_weight
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.conv_scan import conv_scan_chunk, conv_scan_steps
from stillcut.kernels.cpu.stack import GatedDelta
from stillcut.kernels.gated_delta import gated_delta_step, gated_delta_with_states, normalized_qk

CHUNK_SIZE = 64  # tokens per chunk of the prompt form, as transformers' default


class GatedDeltaNet(ProjectingModule):
    """One Gated DeltaNet mixer; its states are `metadata.recurrent.states[layer_id]`."""

    projections = ("in_proj", "out_proj")

    def __init__(self, stored: nn.Module, config: Qwen35TextConfig, layer_id: int) -> None:
        """From a checkpoint-named `linear_attn` module (`stored_delta_net`)."""
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        parts = [stored.in_proj_qkv, stored.in_proj_z, stored.in_proj_b, stored.in_proj_a]
        set_weight(self, "in_proj", *fused_weight(parts))  # [hidden, conv_dim + value_dim + 2 Hv]
        set_weight(self, "out_proj", *fused_weight([stored.out_proj]))  # [value_dim, hidden]
        frozen = {"requires_grad": False}
        self.conv_weight = nn.Parameter(stored.conv1d.weight[:, 0], **frozen)  # [conv_dim, K]
        self.dt_bias = nn.Parameter(stored.dt_bias, **frozen)  # [Hv]
        self.A = nn.Parameter(-stored.A_log.float().exp(), **frozen)  # [Hv], float32
        self.gate_norm = nn.Parameter(stored.norm.weight, **frozen)  # [Dv]
        self.eps = config.rms_norm_eps

    def forward(
        self,
        normed: torch.Tensor,
        residual: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`residual` + the mixer's output for the normed input `normed` `[N, hidden]`."""
        config, recurrent = self.config, metadata.recurrent
        assert recurrent is not None, "a Gated DeltaNet layer needs the runner's recurrent metadata"
        num_v_heads = config.linear_num_value_heads
        projected = linear(normed, self.matrix("in_proj"))
        conv_in, gate, b, a = projected.split(
            (config.conv_dim, config.value_dim, num_v_heads, num_v_heads), dim=-1
        )
        decay = self.A * F.softplus(a.float() + self.dt_bias)  # [N, Hv] float32, <= 0
        beta = b.sigmoid().float()  # [N, Hv]
        rule_out = normed.new_empty(
            normed.shape[0], num_v_heads, config.linear_value_head_dim, dtype=torch.float32
        )  # [N, Hv, Dv]
        self._step(recurrent, conv_in, decay, beta, rule_out)
        for request in recurrent.one_token_steps[2]:
            self._chunk(request, recurrent, conv_in, decay, beta, rule_out)
        gated = self._gated_norm(rule_out, gate).to(normed.dtype)  # [N, value_dim]
        return linear(gated, self.matrix("out_proj"), residual)

    def native_mixer(self) -> GatedDelta:
        """The mixer as the native CPU decode step reads it."""
        config = self.config
        return GatedDelta(
            self.in_proj,
            self.out_proj,
            self.conv_weight,
            self.dt_bias,
            self.A,
            self.gate_norm,
            num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            k_dim=config.linear_key_head_dim,
            state=self.layer_id,
            in_proj_scale=scale_of(self, "in_proj"),
            out_proj_scale=scale_of(self, "out_proj"),
        )

    def _heads(self, conv_out: torch.Tensor):
        """The conv output `[n, conv_dim]` -> q, k `[n, Hv, Dk]` (normalised, float32) and v
        `[n, Hv, Dv]`."""
        config = self.config
        query, key, value = conv_out.split((config.key_dim, config.key_dim, config.value_dim), -1)
        key_heads = (-1, config.linear_num_key_heads, config.linear_key_head_dim)
        query, key = normalized_qk(
            query.reshape(key_heads), key.reshape(key_heads), config.linear_num_value_heads
        )
        value = value.reshape(-1, config.linear_num_value_heads, config.linear_value_head_dim)
        return query, key, value

    def _step(self, recurrent, conv_in, decay, beta, rule_out) -> None:
        """The requests that advance a token at a time: decodes, and drafts verified
        (`conv_scan_steps`)."""

        def step(tokens, conv_out, states):
            query, key, value = self._heads(conv_out)
            return gated_delta_step(states, query, key, value, decay[tokens], beta[tokens])

        conv_scan_steps(recurrent, self.layer_id, conv_in, self.conv_weight, None, step, rule_out)

    def _chunk(self, request, recurrent, conv_in, decay, beta, rule_out) -> None:
        """A prompt chunk (or a fresh request's tokens) through the chunked rule, split where
        its state is saved (`conv_scan_chunk`)."""

        def scan(tokens, conv_out, state, ends):
            query, key, value = self._heads(conv_out)
            return gated_delta_with_states(
                query, key, value, decay[tokens], beta[tokens], CHUNK_SIZE, state, ends
            )

        tokens, y = conv_scan_chunk(
            recurrent, self.layer_id, request, conv_in, self.conv_weight, None, scan
        )
        rule_out[tokens] = y

    def _gated_norm(self, rule_out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Each value head's output RMS-normalised (float32), times the weight in the model's
        dtype and `silu(gate)` (float32), as transformers' `Qwen3_5RMSNormGated`:
        `[N, Hv, Dv]` -> `[N, value_dim]`."""
        normed = rule_out * torch.rsqrt(rule_out.pow(2).mean(-1, keepdim=True) + self.eps)
        weighted = self.gate_norm * normed.to(self.gate_norm.dtype)
        gated = weighted * F.silu(gate.float().view_as(rule_out))
        return gated.flatten(1)


def stored_delta_net(config: Qwen35TextConfig) -> nn.Module:
    """A meta-device `linear_attn` module named as the checkpoint names it."""
    hidden, num_v_heads = config.hidden_size, config.linear_num_value_heads
    with torch.device("meta"):
        mixer = nn.Module()
        mixer.in_proj_qkv = nn.Linear(hidden, config.conv_dim, bias=False)
        mixer.in_proj_z = nn.Linear(hidden, config.value_dim, bias=False)
        mixer.in_proj_b = nn.Linear(hidden, num_v_heads, bias=False)
        mixer.in_proj_a = nn.Linear(hidden, num_v_heads, bias=False)
        mixer.conv1d = nn.Conv1d(
            config.conv_dim,
            config.conv_dim,
            config.conv_kernel,
            groups=config.conv_dim,
            bias=False,
        )
        mixer.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        mixer.A_log = nn.Parameter(torch.empty(num_v_heads))
        mixer.norm = nn.RMSNorm(config.linear_value_head_dim)
        mixer.out_proj = nn.Linear(config.value_dim, hidden, bias=False)
    return mixer
