"""NemotronH's Mamba2 block over the runner's flat batch, with per-request state.

`in_proj` gives the gate z, the conv input (x, B, C) and dt; the depthwise causal conv (SiLU)
and the selective scan run per request from its stored state (`kernels.mamba2`), then a gated
RMSNorm per group (`x * silu(z)`, normalised over each `inner / n_groups` slice) and
`out_proj`. dt is `softplus(dt + dt_bias)`, clamped below at `time_step_min` for prompt tokens
only: transformers clamps it in its chunked (prefill) scan and not in its one-token update,
and a request recomputed after preemption reruns its generated tokens without the clamp, so
it gets back the values they were generated with. Decoding requests share one batched step;
each prompt chunk runs the chunked scan on its own, split where the step saves snapshots of
the state (`RecurrentMetadata.captures`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.models.matmul import linear, scale_of
from stillcut.engine.models.nemotron_omni.blocks import (
    NemotronBlock,
    frozen,
    rms_norm,
    set_projection,
)
from stillcut.engine.models.nemotron_omni.text_config import NemotronTextConfig
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.conv_scan import conv_scan_chunk, conv_scan_steps
from stillcut.kernels.cpu.stack import Mamba2
from stillcut.kernels.mamba2 import selective_state_step, ssd_scan_with_states


class Mamba2Block(NemotronBlock):
    """One Mamba2 layer; its states are `metadata.recurrent.states[layer_id]`."""

    projections = ("in_proj", "out_proj")

    def __init__(self, stored: nn.Module, config: NemotronTextConfig, layer_id: int) -> None:
        super().__init__(stored.norm.weight, config.layer_norm_epsilon)
        mixer = stored.mixer
        self.layer_id = layer_id
        self.config = config
        set_projection(self, "in_proj", [mixer.in_proj])
        self.in_proj_bias = frozen(mixer.in_proj.bias)
        self.conv_weight = frozen(mixer.conv1d.weight[:, 0])  # [conv_dim, K]
        self.conv_bias = frozen(mixer.conv1d.bias)
        self.dt_bias = frozen(mixer.dt_bias)  # [heads]
        self.A = frozen(-torch.exp(mixer.A_log.float()))  # [heads], float32 as transformers
        self.D = frozen(mixer.D)  # [heads]
        self.gate_norm = frozen(mixer.norm.weight)  # [inner]
        set_projection(self, "out_proj", [mixer.out_proj])
        self.out_proj_bias = frozen(mixer.out_proj.bias)

    def forward(
        self, hidden: torch.Tensor, metadata: AttentionMetadata, kv_cache: torch.Tensor | None
    ) -> torch.Tensor:
        config = self.config
        recurrent = metadata.recurrent
        assert recurrent is not None, "a Mamba2 layer needs the runner's recurrent metadata"
        normed = rms_norm(hidden, self.norm, self.eps)
        projected = linear(normed, self.matrix("in_proj"), self.in_proj_bias)
        gate, conv_in, dt = projected.split(
            (config.mamba_inner_size, config.conv_dim, config.mamba_num_heads), dim=-1
        )
        dt = F.softplus(dt + self.dt_bias)  # [N, heads]
        dt = torch.where(
            recurrent.prompt_token_mask[:, None], dt.clamp(min=config.time_step_min), dt
        )
        scanned = torch.empty(
            hidden.shape[0], config.mamba_num_heads, config.mamba_head_dim, device=hidden.device
        )  # [N, heads, head_dim] float32
        self._step(recurrent, conv_in, dt, scanned)
        for request in recurrent.one_token_steps[2]:
            self._chunk(request, recurrent, conv_in, dt, scanned)
        y = self._gated_norm(scanned.flatten(1), gate).to(hidden.dtype)  # [N, inner]
        out = linear(y, self.matrix("out_proj"), self.out_proj_bias)
        return hidden + out

    def native_mixer(self, cache: int) -> Mamba2:
        config = self.config
        return Mamba2(
            self.in_proj,
            self.out_proj,
            self.conv_weight,
            self.dt_bias,
            self.A,
            self.D,
            self.gate_norm,
            num_heads=config.mamba_num_heads,
            num_groups=config.n_groups,
            state_size=config.ssm_state_size,
            state=self.layer_id,
            time_step_min=config.time_step_min,
            conv_bias=self.conv_bias,
            in_proj_bias=self.in_proj_bias,
            out_proj_bias=self.out_proj_bias,
            in_proj_scale=scale_of(self, "in_proj"),
            out_proj_scale=scale_of(self, "out_proj"),
        )

    def _split_xbc(self, conv_out: torch.Tensor):
        """conv output `[n, conv_dim]` -> x `[n, heads, head_dim]`, B and C `[n, G, N]`."""
        config = self.config
        group_width = config.n_groups * config.ssm_state_size
        x, B, C = conv_out.split((config.mamba_inner_size, group_width, group_width), dim=-1)
        groups = (-1, config.n_groups, config.ssm_state_size)
        heads = (-1, config.mamba_num_heads, config.mamba_head_dim)
        return x.reshape(heads), B.reshape(groups), C.reshape(groups)

    def _step(self, recurrent, conv_in, dt, scanned) -> None:
        """The requests that advance a token at a time: decodes, and drafts verified
        (`conv_scan_steps`)."""

        def step(tokens, conv_out, states):
            x, B, C = self._split_xbc(conv_out)
            return selective_state_step(states, x, dt[tokens], self.A, B, C, self.D)

        conv_scan_steps(
            recurrent, self.layer_id, conv_in, self.conv_weight, self.conv_bias, step, scanned
        )

    def _chunk(self, request, recurrent, conv_in, dt, scanned) -> None:
        """A prompt chunk (or a fresh request's tokens) through the chunked scan, split where
        its state is saved (`conv_scan_chunk`)."""

        def scan(tokens, conv_out, state, ends):
            x, B, C = self._split_xbc(conv_out)
            chunk_size = self.config.chunk_size
            return ssd_scan_with_states(
                x, dt[tokens], self.A, B, C, self.D, chunk_size, state, ends
            )

        tokens, y = conv_scan_chunk(
            recurrent, self.layer_id, request, conv_in, self.conv_weight, self.conv_bias, scan
        )
        scanned[tokens] = y

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """`y * silu(gate)` RMS-normalised over each of `n_groups` slices, times the weight;
        float32, as transformers' `NemotronHRMSNormGated`."""
        groups = self.config.n_groups
        gated = y.float() * F.silu(gate.float())  # [N, inner]
        grouped = gated.view(gated.shape[0], groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.gate_norm.float() * grouped.view_as(gated)


def stored_mamba(config: NemotronTextConfig) -> nn.Module:
    """A meta-device Mamba2 mixer named as the checkpoint names it."""
    inner, conv_dim, heads = config.mamba_inner_size, config.conv_dim, config.mamba_num_heads
    with torch.device("meta"):
        mixer = nn.Module()
        mixer.in_proj = nn.Linear(
            config.hidden_size, inner + conv_dim + heads, bias=config.mamba_proj_bias
        )
        mixer.conv1d = nn.Conv1d(
            conv_dim, conv_dim, config.conv_kernel, groups=conv_dim, bias=config.use_conv_bias
        )
        for name in ("dt_bias", "A_log", "D"):
            setattr(mixer, name, nn.Parameter(torch.empty(heads)))
        mixer.norm = nn.RMSNorm(inner)
        mixer.out_proj = nn.Linear(inner, config.hidden_size, bias=config.mamba_proj_bias)
    return mixer
