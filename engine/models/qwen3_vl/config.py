"""Qwen3-VL configs: the vision tower's shape, the media token ids, the Qwen3 text model.

transformers 5.x nests the language model's fields in `text_config` and the tower's in
`vision_config`; missing optional fields take transformers' defaults (`configuration_qwen3_vl`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stillcut.engine.cache_groups import AttentionGroup
from stillcut.engine.model_config import CheckpointError, FamilyConfig, ModelConfig
from stillcut.engine.models.qwen2_vl.config import VisionConfig, _common_vision_fields, _token_ids

_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": (8, 16, 24),
}


@dataclass(frozen=True)
class Qwen3VisionConfig(VisionConfig):
    """A Qwen3-VL vision tower's shape: Qwen2-VL's with full attention within each frame in
    every block (`fullatt_block_indexes` all of them, no windows), a learned
    `num_position_embeddings` (a square) position table interpolated to each grid, and one
    DeepStack merger per block in `deepstack_visual_indexes`."""

    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.has_windows:
            raise ValueError(
                f"fullatt_block_indexes={self.fullatt_block_indexes} must hold every block"
            )
        side = self.position_side
        if self.num_position_embeddings < 1 or side * side != self.num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings={self.num_position_embeddings} must be a square >= 1"
            )
        indexes = self.deepstack_visual_indexes
        if any(not 0 <= i < self.depth for i in indexes) or len(set(indexes)) != len(indexes):
            raise ValueError(
                f"deepstack_visual_indexes={indexes} must be distinct blocks in [0, {self.depth})"
            )

    @property
    def position_side(self) -> int:
        """Side of the learned position table's square grid."""
        return int(self.num_position_embeddings**0.5)


def read_qwen3_vl(raw: Mapping[str, Any]) -> FamilyConfig:
    """Qwen3-VL's vision config (either language model) and media token ids."""
    fields = {**_VISION_DEFAULTS, **raw["vision_config"]}
    common = _common_vision_fields(fields)
    vision = Qwen3VisionConfig(
        hidden_size=int(fields["hidden_size"]),
        intermediate_size=int(fields["intermediate_size"]),
        out_hidden_size=int(fields["out_hidden_size"]),
        fullatt_block_indexes=tuple(range(common["depth"])),
        num_position_embeddings=int(fields["num_position_embeddings"]),
        deepstack_visual_indexes=tuple(int(i) for i in fields["deepstack_visual_indexes"]),
        **common,
    )
    return FamilyConfig(vision, _token_ids(raw))


_TEXT_POSITIVE = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "intermediate_size",
)  # fmt: skip


@dataclass(frozen=True)
class Qwen3TextConfig:
    """The Qwen3 language model's shape: GQA attention with RMSNorm on each q and k head, no
    q/k/v bias, interleaved M-RoPE, SwiGLU MLP; `num_deepstack` is how many of the first layers
    add the tower's DeepStack features at the visual positions.

    `mrope_section` (t, h, w) counts rotary frequencies per axis; interleaved, frequency j
    turns with h when j % 3 == 1 and j < 3 * h_section, with w likewise for j % 3 == 2, and
    with t otherwise.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mrope_section: tuple[int, int, int]
    num_deepstack: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5e5
    tie_word_embeddings: bool = False
    # LongRoPE divisors, read by the M-RoPE build this model shares with Qwen2; the Qwen3 text
    # config reader accepts plain M-RoPE only, so this stays None
    rope_factors: None = None
    # Qwen3-MoE: the layers whose MLP is the softmax-routed mixture (none: a dense model)
    sparse_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        for name in _TEXT_POSITIVE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if len(self.mrope_section) != 3 or sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"mrope_section={self.mrope_section} must be three sizes summing to "
                f"head_dim / 2 = {self.head_dim / 2}"
            )
        if not 0 <= self.num_deepstack <= self.num_layers:
            raise ValueError(
                f"num_deepstack={self.num_deepstack} must lie in [0, num_layers={self.num_layers}]"
            )
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(
                f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0"
            )
        if any(not 0 <= i < self.num_layers for i in self.sparse_layers):
            raise ValueError(
                f"sparse_layers={self.sparse_layers} must lie in [0, {self.num_layers})"
            )
        if self.sparse_layers and not (
            1 <= self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size >= 1
        ):
            raise ValueError(
                f"num_experts={self.num_experts}, num_experts_per_tok="
                f"{self.num_experts_per_tok}, moe_intermediate_size="
                f"{self.moe_intermediate_size}: need 1 <= num_experts_per_tok <= num_experts "
                "and moe_intermediate_size >= 1"
            )


def num_text_experts(text: Mapping[str, Any]) -> int:
    """Experts per MoE layer; transformers saves `num_experts` as `num_local_experts`."""
    return int(text.get("num_local_experts") or text.get("num_experts") or 0)


def sparse_layers(text: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers whose MLP is the mixture of experts, as transformers' Qwen3-VL-MoE decoder
    layer decides: not in `mlp_only_layers`, experts present, and (i + 1) a multiple of
    `decoder_sparse_step`."""
    num_experts = num_text_experts(text)
    dense = set(text.get("mlp_only_layers") or ())
    step = int(text.get("decoder_sparse_step", 1))
    if step < 1:
        raise CheckpointError(f"text decoder_sparse_step={step} must be >= 1")
    return tuple(
        i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
    )


def text_config(config: ModelConfig) -> Qwen3TextConfig:
    """The language model's config from a checkpoint; CheckpointError for what is missing or
    what the model does not implement (another activation, q/k/v bias, another rotary type)."""
    text = config.text
    rope = supported_rope(text)
    try:
        num_heads = int(text["num_attention_heads"])
        num_layers = int(text["num_hidden_layers"])
        return Qwen3TextConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=int(text.get("head_dim") or 128),
            intermediate_size=int(text["intermediate_size"]),
            mrope_section=tuple(int(s) for s in rope.get("mrope_section", (24, 20, 20))),
            num_deepstack=len(config.vision.deepstack_visual_indexes),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 5e5))),
            tie_word_embeddings=config.tie_word_embeddings,
            sparse_layers=sparse_layers(text, num_layers),
            num_experts=num_text_experts(text),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        )
    except KeyError as error:
        raise CheckpointError(f"text config field {error} is missing") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"text config: {error}") from error


def supported_rope(text: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text section's rotary parameters, once the section is one Qwen3's attention and MLP
    serve: SiLU, no attention bias, the default rotary type (else CheckpointError)."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if text.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"text hidden_act={text['hidden_act']!r}; supported: 'silu'")
    if text.get("attention_bias"):
        raise CheckpointError("text attention_bias=true is not supported")
    if rope_type != "default":
        raise CheckpointError(f"text rope type {rope_type!r}; supported: 'default'")
    return rope


def qwen3_cache_groups(config: ModelConfig) -> tuple[AttentionGroup, ...]:
    """Every layer pages its K/V with the same heads: one group."""
    text = text_config(config)
    return (AttentionGroup(tuple(range(text.num_layers)), text.num_kv_heads, text.head_dim),)
