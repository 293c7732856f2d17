"""Rotary position embedding and attention from a fused q/k/v projection.

Rotary tables come as cos and a signed sin, `[N, 1, D]`, so that rotating q and k heads is one
fused op; attention writes the new k/v into the paged cache before attending.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stillcut.kernels.attention import paged_attention, write_kv
from stillcut.kernels.attention_metadata import AttentionMetadata


def rotary_tables(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary angles [N, D/2] (float32) -> cos and signed sin `[N, 1, D]` in `dtype`.

    The sin table is negated on its first half so that rotating is
    `x * cos + roll(x, D/2) * sin` (roll swaps the halves), transformers' `rotate_half` form.
    """
    cos, sin = angles.cos(), angles.sin()
    cos = torch.cat((cos, cos), dim=-1)  # [N, D]
    sin = torch.cat((-sin, sin), dim=-1)  # [N, D]
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` [N, heads, D] with `rotary_tables`' [N, 1, D] tables."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def fused_qkv_attention(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    qk_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **attention_options,
) -> torch.Tensor:
    """Attention from a fused projection `qkv` [N, (Hq + 2 Hkv) * D] -> [N, Hq * D].

    q and k heads are adjacent columns, so one `qk_transform` (e.g. a per-head norm) and one
    rotation cover both; the new k/v go into the paged cache before attending.
    """
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    num_qk_heads = num_heads + num_kv_heads
    qk = qkv[:, : num_qk_heads * head_dim].view(num_tokens, num_qk_heads, head_dim)
    if qk_transform is not None:
        qk = qk_transform(qk)
    query, key = rotate(qk, cos, sin).split((num_heads, num_kv_heads), dim=1)
    value = qkv[:, num_qk_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    write_kv(key, value, kv_cache, metadata.slot_mapping)
    attended = paged_attention(query, kv_cache, metadata, **attention_options)  # [N, Hq, D]
    return attended.reshape(num_tokens, -1)
