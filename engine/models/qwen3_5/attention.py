"""Qwen3.5's full-attention layer: gated, partial-rotary GQA over the paged K/V cache.

Qwen3's attention (an RMSNorm over each q and k head) with two changes: `q_proj` gives each
head its query and an output gate, and the attended heads are multiplied by `sigmoid(gate)`
before `o_proj`; and interleaved M-RoPE turns only the first `rotary_dim` dims of each head
(`rotate_half` pairs dim i with i + rotary_dim / 2 there), the rest pass unrotated.

The partial rotation is computed as a full-width one: q and k are only ever multiplied with
each other, so their head dims may be permuted (the same way in both) without changing a
score. In the permuted order (`rotary_order`) rotary dim i sits at i and its partner at
i + head_dim / 2, and the dims that pass unrotated take frequency 0 (cos 1, sin 0): the
shared full-width rotation (`rotary.fused_qkv_attention`) and the native decode step's
attention kind then rotate exactly the pairs transformers rotates. q_proj's query rows,
k_proj's rows and both head norms are permuted once at load; values are not.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from stillcut.engine.models.matmul import ProjectingModule, linear, scale_of
from stillcut.engine.models.qwen2_vl.model import MRoPE
from stillcut.engine.models.qwen3_5.config import Qwen35TextConfig
from stillcut.engine.models.rotary import fused_qkv_attention
from stillcut.engine.models.weights import fused_weight, set_weight
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu.stack import Attention


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The head dim each place of the permuted order holds `[head_dim]`: the rotary dims'
    first half, half of the unrotated dims, the rotary dims' second half, the other half."""
    half, passed = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat(
        [
            torch.arange(half),
            torch.arange(rotary_dim, rotary_dim + passed),
            torch.arange(half, rotary_dim),
            torch.arange(rotary_dim + passed, head_dim),
        ]
    )


class PartialMRoPE(nn.Module):
    """Full-width cos/sin tables of interleaved M-RoPE over the first `rotary_dim` dims, in the
    permuted head order (module docstring): frequency j < rotary_dim / 2 turns with h when
    j % 3 == 1 and j < 3 * h_section, with w when j % 3 == 2 and j < 3 * w_section, else with
    t (transformers' Qwen3.5 layout); the other head_dim / 2 - rotary_dim / 2 are zero."""

    forward = MRoPE.forward

    def __init__(self, config: Qwen35TextConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        half = config.rotary_dim // 2
        # The same float32 ops as transformers: the angles must match to the last bit.
        exponent = torch.arange(0, config.rotary_dim, 2, device=device).float() / config.rotary_dim
        inv_freq = torch.zeros(config.head_dim // 2, device=device)  # [D/2]
        inv_freq[:half] = 1.0 / config.rope_theta**exponent
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        _, h_section, w_section = config.mrope_section
        rows = torch.zeros(config.head_dim // 2, dtype=torch.long, device=device)  # [D/2]
        rows[1 : 3 * h_section : 3] = 1
        rows[2 : 3 * w_section : 3] = 2
        self.section = nn.Buffer(rows, persistent=False)


class GatedAttention(ProjectingModule):
    """The attention mixer; `qkv_weight` `[hidden, (2 Hq + 2 Hkv) D]` holds the q, k, v columns
    then the output gate's, `qk_norm` `[Hq + Hkv, D]` the head norms' `1 + w` (permuted)."""

    projections = ("qkv_weight", "o_weight")

    def __init__(self, stored: nn.Module, config: Qwen35TextConfig) -> None:
        """From a checkpoint-named `self_attn` module (`stored_attention`)."""
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = head_dim = config.head_dim
        self.scale = head_dim**-0.5
        self.eps = config.rms_norm_eps
        order = rotary_order(head_dim, config.rotary_dim)
        q_rows = stored.q_proj.weight.shape[0]
        # q_proj's rows: per head its query's D, then its gate's D
        per_head = torch.arange(q_rows).view(self.num_heads, 2, head_dim)
        query_rows = per_head[:, 0, order].flatten()
        key_rows = (torch.arange(self.num_kv_heads)[:, None] * head_dim + order).flatten()
        parts = [
            _rows(stored.q_proj, query_rows),
            _rows(stored.k_proj, key_rows),
            stored.v_proj,
            _rows(stored.q_proj, per_head[:, 1].flatten()),
        ]
        set_weight(self, "qkv_weight", *fused_weight(parts))
        set_weight(self, "o_weight", *fused_weight([stored.o_proj]))
        norms = [
            (1 + stored.q_norm.weight.float())[order].expand(self.num_heads, -1),
            (1 + stored.k_norm.weight.float())[order].expand(self.num_kv_heads, -1),
        ]
        dtype = stored.q_norm.weight.dtype
        self.qk_norm = nn.Parameter(torch.cat(norms).to(dtype), requires_grad=False)

    def forward(
        self,
        normed: torch.Tensor,
        residual: torch.Tensor,
        metadata: AttentionMetadata,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """`residual` + the gated attention of `normed` `[N, hidden]`; `rotary` the step's
        cos and signed sin `[N, 1, D]` (`PartialMRoPE`)."""
        projected = linear(normed, self.matrix("qkv_weight"))
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        qkv, gate = projected.split((qkv_width, self.num_heads * self.head_dim), dim=-1)
        attended = fused_qkv_attention(
            qkv,
            self.num_heads,
            self.num_kv_heads,
            *rotary,
            kv_cache,
            metadata,
            qk_transform=self.qk_transform,
            scale=self.scale,
        )  # [N, Hq D]
        return linear(attended * torch.sigmoid(gate), self.matrix("o_weight"), residual)

    def native_mixer(self, cache: int) -> Attention:
        """The mixer as the native CPU decode step reads it (`cache`: the step's KV cache it
        uses): its q / k head norms, the gate, the one rotary table (`PartialMRoPE`)."""
        return Attention(
            self.qkv_weight,
            self.o_weight,
            self.num_heads,
            self.num_kv_heads,
            cache=cache,
            scale=self.scale,
            qk_norm=self.qk_norm,
            qkv_scale=scale_of(self, "qkv_weight"),
            o_scale=scale_of(self, "o_weight"),
            gated=True,
        )

    def qk_transform(self, qk: torch.Tensor) -> torch.Tensor:
        """The q heads then the k heads `[N, Hq + Hkv, D]`, each RMS-normed (float32) times
        its `1 + w`."""
        normed = torch.nn.functional.rms_norm(qk.float(), qk.shape[-1:], None, self.eps)
        return (normed * self.qk_norm.float()).to(qk.dtype)


def _rows(linear_module: nn.Module, rows: torch.Tensor) -> SimpleNamespace:
    """Rows `rows` of a checkpoint `nn.Linear` (and of its int8 per-row scales), named as
    `fused_weight` reads a linear."""
    picked = SimpleNamespace(weight=linear_module.weight[rows])
    scale = getattr(linear_module, "weight_scale", None)
    if scale is not None:
        picked.weight_scale = scale[rows]
    return picked


def stored_attention(config: Qwen35TextConfig) -> nn.Module:
    """A meta-device `self_attn` module named as the checkpoint names it."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_width, kv_width = config.num_heads * head_dim, config.num_kv_heads * head_dim
    with torch.device("meta"):
        attn = nn.Module()
        attn.q_proj = nn.Linear(hidden, 2 * q_width, bias=False)
        attn.k_proj = nn.Linear(hidden, kv_width, bias=False)
        attn.v_proj = nn.Linear(hidden, kv_width, bias=False)
        attn.o_proj = nn.Linear(q_width, hidden, bias=False)
        attn.q_norm = nn.RMSNorm(head_dim)
        attn.k_norm = nn.RMSNorm(head_dim)
    return attn
