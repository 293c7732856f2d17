"""Qwen3.5 configs: the Qwen3-VL tower without DeepStack, the media token ids, the hybrid text
model and its cache groups.

The text section (`text_config`, transformers' `Qwen3_5TextConfig` / `Qwen3_5MoeTextConfig`)
lists each layer's kind in `layer_types`: `linear_attention` (Gated DeltaNet) or
`full_attention`; older saves give `full_attention_interval` instead (every n-th layer full).
Missing optional fields take transformers' defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stillcut.engine.cache_groups import AttentionGroup, CacheGroup, RecurrentGroup
from stillcut.engine.model_config import CheckpointError, FamilyConfig, MediaTokenIds, ModelConfig
from stillcut.engine.models.qwen3_vl.config import read_qwen3_vl, supported_rope

LINEAR, FULL = "linear_attention", "full_attention"
# Qwen3.5's own ids (its 248k vocabulary), for a config.json that leaves them out
_TOKEN_ID_DEFAULTS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}
_POSITIVE = (
    "vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "rotary_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim",
)  # fmt: skip


def read_qwen3_5(raw: Mapping[str, Any]) -> FamilyConfig:
    """The tower's config (Qwen3-VL's, no DeepStack mergers) and the media token ids."""
    vision = {**raw["vision_config"], "deepstack_visual_indexes": ()}
    read = read_qwen3_vl({**raw, "vision_config": vision})
    ids = {name: int(raw.get(name, default)) for name, default in _TOKEN_ID_DEFAULTS.items()}
    return FamilyConfig(read.vision, MediaTokenIds(**ids))


@dataclass(frozen=True)
class Qwen35TextConfig:
    """The Qwen3.5 language model: `layer_kinds[i]` is `LINEAR` or `FULL`.

    Full-attention layers: GQA with a sigmoid output gate per head (q_proj twice as wide), an
    RMSNorm over each q and k head, interleaved M-RoPE over the first `rotary_dim` dims of
    each head only (`mrope_section` counts its `rotary_dim / 2` frequencies per axis).
    Gated DeltaNet layers: `linear_num_key_heads` q/k heads of `linear_key_head_dim`,
    `linear_num_value_heads` value heads of `linear_value_head_dim`, a depthwise causal conv
    of `conv_kernel` taps over q|k|v. Every RMSNorm but the DeltaNet's gated one scales by
    `1 + w`. MLPs are SwiGLU; with `num_experts`, every layer's is instead a softmax-routed
    mixture of `num_experts_per_tok` experts plus a shared expert behind a sigmoid gate.
    """

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    mrope_section: tuple[int, int, int]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int = 4
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.layer_kinds or set(self.layer_kinds) - {LINEAR, FULL}:
            raise ValueError(f"layer_kinds={self.layer_kinds}: each must be {LINEAR} or {FULL}")
        if FULL not in self.layer_kinds:
            raise ValueError("a Qwen3.5 stack needs at least one full_attention layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide {self.num_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_key_heads={self.linear_num_key_heads} must divide "
                f"linear_num_value_heads={self.linear_num_value_heads}"
            )
        if self.rotary_dim % 2 or self.head_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_dim={self.rotary_dim} must be even and at most head_dim={self.head_dim} "
                "(even)"
            )
        if len(self.mrope_section) != 3 or 2 * sum(self.mrope_section) != self.rotary_dim:
            raise ValueError(
                f"mrope_section={self.mrope_section} must be three sizes summing to "
                f"rotary_dim / 2 = {self.rotary_dim // 2}"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel={self.conv_kernel} must be >= 2")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(
                f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0"
            )
        self._check_mlp()

    def _check_mlp(self) -> None:
        if not self.num_experts:
            if self.intermediate_size < 1:
                raise ValueError(f"intermediate_size={self.intermediate_size} must be >= 1")
            return
        sizes = (self.moe_intermediate_size, self.shared_expert_intermediate_size)
        if not 1 <= self.num_experts_per_tok <= self.num_experts or min(sizes) < 1:
            raise ValueError(
                f"num_experts={self.num_experts}, num_experts_per_tok="
                f"{self.num_experts_per_tok}, moe_intermediate_size={sizes[0]}, "
                f"shared_expert_intermediate_size={sizes[1]}: need 1 <= num_experts_per_tok "
                "<= num_experts and both sizes >= 1"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def layer_ids(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)

    @property
    def key_dim(self) -> int:
        """Width of q (and of k) in a DeltaNet layer."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of v (and of the output gate z) in a DeltaNet layer."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim


def text_config(config: ModelConfig) -> Qwen35TextConfig:
    """The language model's config from a checkpoint; CheckpointError for what is missing or
    what this model does not implement (another activation, attention bias, another rotary
    type)."""
    text = config.text
    rope = supported_rope(text)
    try:
        head_dim = int(text.get("head_dim") or 256)
        factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        num_heads = int(text["num_attention_heads"])
        return Qwen35TextConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            layer_kinds=_layer_kinds(text),
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rotary_dim=int(head_dim * factor),
            mrope_section=tuple(int(s) for s in rope.get("mrope_section", (11, 11, 10))),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(text.get("intermediate_size") or 0),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1e7))),
            tie_word_embeddings=config.tie_word_embeddings,
            num_experts=int(text.get("num_experts") or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
        )
    except KeyError as error:
        raise CheckpointError(f"text config field {error} is missing") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"text config: {error}") from error


def _layer_kinds(text: Mapping[str, Any]) -> tuple[str, ...]:
    """`layer_types`, else every `full_attention_interval`-th layer full (transformers' rule)."""
    kinds = text.get("layer_types")
    if kinds is None:
        interval = int(text.get("full_attention_interval", 4))
        if interval < 1:
            raise CheckpointError(f"text full_attention_interval={interval} must be >= 1")
        num_layers = int(text["num_hidden_layers"])
        kinds = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
    unknown = sorted({str(kind) for kind in kinds} - {LINEAR, FULL})
    if unknown:
        raise CheckpointError(f"text layer_types {unknown}: allowed {LINEAR!r}, {FULL!r}")
    return tuple(kinds)


def qwen3_5_cache_groups(config: ModelConfig) -> tuple[CacheGroup, ...]:
    """Full-attention layers page K/V; each Gated DeltaNet layer keeps a conv state
    `[conv_dim, conv_kernel - 1]` and a delta-rule state `[v_heads, k_dim, v_dim]`, both in
    float32 whatever the model computes in (its updates are float32 sums)."""
    text = text_config(config)
    conv_state = (text.conv_dim, text.conv_kernel - 1)
    delta_state = (
        text.linear_num_value_heads,
        text.linear_key_head_dim,
        text.linear_value_head_dim,
    )
    groups: list[CacheGroup] = [
        AttentionGroup(text.layer_ids(FULL), text.num_kv_heads, text.head_dim)
    ]
    if linear_layers := text.layer_ids(LINEAR):
        groups.append(RecurrentGroup(linear_layers, (conv_state, delta_state), torch.float32))
    return tuple(groups)
