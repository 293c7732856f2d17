"""Qwen2-VL and Qwen2.5-VL configs: the vision tower's shape, the media token ids, the text model.

Real checkpoints come in two layouts: transformers 5.x nests the language model's fields in
`text_config`, older saves keep them at the top level; both nest `vision_config`. Qwen2-VL
also names the vision fields differently (`embed_dim` is the tower width, `hidden_size` its
output width, `mlp_ratio` instead of `intermediate_size`). The readers take either into the
same frozen dataclasses; missing optional fields take transformers' defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stillcut.engine.cache_groups import AttentionGroup
from stillcut.engine.model_config import CheckpointError, FamilyConfig, MediaTokenIds, ModelConfig

# transformers' defaults for fields that real config.json files may omit.
_QWEN2_5_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "window_size": 112,
    "fullatt_block_indexes": (7, 15, 23, 31),
    "tokens_per_second": 4,
}
_QWEN2_VISION_DEFAULTS: dict[str, Any] = {"hidden_act": "quick_gelu", "mlp_ratio": 4}
_POSITIVE_FIELDS = (
    "depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
    "patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels",
)  # fmt: skip
_TOKEN_ID_DEFAULTS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}


@dataclass(frozen=True)
class VisionConfig:
    """A Qwen vision tower's shape. Blocks not in `fullatt_block_indexes` use window attention;
    `tokens_per_second` scales video time (Qwen2.5-VL), None for Qwen2-VL's tubelet index."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    hidden_act: str
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 0  # pixels; 0 only when every block is full attention
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float | None = None
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % (4 * self.num_heads):
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of 4 * num_heads="
                f"{4 * self.num_heads} (2-D rotary splits each head in four)"
            )
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(
                f"fullatt_block_indexes={self.fullatt_block_indexes} must lie in [0, {self.depth})"
            )
        window_step = self.patch_size * self.spatial_merge_size
        if self.has_windows and (self.window_size < 1 or self.window_size % window_step):
            raise ValueError(
                f"window_size={self.window_size} must be a positive multiple of patch_size * "
                f"spatial_merge_size={window_step} when some blocks use window attention"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: channels * frames * pixels * pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def has_windows(self) -> bool:
        return len(set(self.fullatt_block_indexes)) < self.depth

    @property
    def window_merged_tokens(self) -> int:
        """Side of an attention window in merged (2x2) tokens: 112 px / 14 / 2 = 4."""
        return self.window_size // (self.patch_size * self.spatial_merge_size)


def read_qwen2_5_vl(raw: Mapping[str, Any]) -> FamilyConfig:
    """Qwen2.5-VL's vision config (window attention, time in tokens per second) and ids."""
    fields = {**_QWEN2_5_VISION_DEFAULTS, **raw["vision_config"]}
    common = _common_vision_fields(fields)
    vision = VisionConfig(
        hidden_size=int(fields["hidden_size"]),
        intermediate_size=int(fields["intermediate_size"]),
        out_hidden_size=int(fields["out_hidden_size"]),
        window_size=int(fields["window_size"]),
        fullatt_block_indexes=tuple(int(i) for i in fields["fullatt_block_indexes"]),
        tokens_per_second=float(fields["tokens_per_second"]),
        **common,
    )
    return FamilyConfig(vision, _token_ids(raw))


def read_qwen2_vl(raw: Mapping[str, Any]) -> FamilyConfig:
    """Qwen2-VL's vision config (every block full attention, `embed_dim` wide) and ids."""
    fields = {**_QWEN2_VISION_DEFAULTS, **raw["vision_config"]}
    common = _common_vision_fields(fields)
    width = int(fields["embed_dim"])
    vision = VisionConfig(
        hidden_size=width,
        intermediate_size=int(width * fields["mlp_ratio"]),
        out_hidden_size=int(fields["hidden_size"]),
        fullatt_block_indexes=tuple(range(common["depth"])),
        **common,
    )
    return FamilyConfig(vision, _token_ids(raw))


def _token_ids(raw: Mapping[str, Any]) -> MediaTokenIds:
    return MediaTokenIds(
        **{name: int(raw.get(name, default)) for name, default in _TOKEN_ID_DEFAULTS.items()}
    )


def _common_vision_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "depth": int(fields["depth"]),
        "num_heads": int(fields["num_heads"]),
        "hidden_act": str(fields["hidden_act"]),
        "patch_size": int(fields.get("patch_size", 14)),
        "temporal_patch_size": int(fields.get("temporal_patch_size", 2)),
        "spatial_merge_size": int(fields.get("spatial_merge_size", 2)),
        # Original Qwen releases call it `in_chans`.
        "in_channels": int(fields.get("in_channels", fields.get("in_chans", 3))),
        "rope_theta": float((fields.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
    }


_TEXT_POSITIVE_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
)  # fmt: skip
# Qwen configs spell the rotary type "mrope" (older saves) or "default" (transformers 5.x).
_TEXT_ROPE_TYPES = ("default", "mrope", "longrope")


@dataclass(frozen=True)
class TextConfig:
    """The Qwen2 language model's shape: GQA attention, SwiGLU MLP, M-RoPE over (t, h, w).

    `mrope_section` splits the head_dim / 2 rotary frequencies into temporal, height and width
    parts, in that order.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    mrope_section: tuple[int, int, int]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False
    # LongRoPE's per-frequency divisors (one per rotary pair; None: plain RoPE): frequency j
    # is `1 / (rope_factors[j] * rope_theta ** (2j / head_dim))`.
    rope_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in _TEXT_POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads="
                f"{self.num_kv_heads}: num_heads must divide hidden_size and num_kv_heads must "
                "divide num_heads"
            )
        if len(self.mrope_section) != 3 or sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"mrope_section={self.mrope_section} must be three sizes summing to "
                f"head_dim / 2 = {self.head_dim / 2}"
            )
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(
                f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0"
            )
        factors = self.rope_factors
        if factors is not None and (
            len(factors) * 2 != self.head_dim or not all(f > 0 for f in factors)
        ):
            raise ValueError(
                f"rope_factors: need head_dim / 2 = {self.head_dim // 2} positive numbers"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def text_config(config: ModelConfig) -> TextConfig:
    """The language model's TextConfig from a checkpoint's text fields, in either key spelling.

    Raises CheckpointError for what the Qwen2 language model does not implement: another
    activation, sliding-window layers or a rotary type other than plain M-RoPE.
    """
    text = config.text
    # transformers 5.x writes `rope_parameters`; older saves `rope_scaling` plus `rope_theta`.
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    layer_types = text.get("layer_types") or ()
    if text.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"text hidden_act={text['hidden_act']!r}; supported: 'silu'")
    if text.get("use_sliding_window") or "sliding_attention" in layer_types:
        raise CheckpointError("text sliding-window attention is not supported; full attention only")
    if rope_type not in _TEXT_ROPE_TYPES:
        raise CheckpointError(f"text rope type {rope_type!r}; supported: {_TEXT_ROPE_TYPES}")
    try:
        num_heads = int(text["num_attention_heads"])
        return TextConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            intermediate_size=int(text["intermediate_size"]),
            # transformers' default when the field is absent: 16:24:24 for head_dim 128.
            mrope_section=tuple(int(s) for s in rope.get("mrope_section", (16, 24, 24))),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1e6))),
            tie_word_embeddings=config.tie_word_embeddings,
            rope_factors=_longrope_factors(rope, text) if rope_type == "longrope" else None,
        )
    except KeyError as error:
        raise CheckpointError(f"text config field {error} is missing") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"text config: {error}") from error


def _longrope_factors(rope: Mapping[str, Any], text: Mapping[str, Any]) -> tuple[float, ...]:
    """LongRoPE's divisors, for the one case that is a fixed table: the same factors at every
    length and no attention scaling (transformers switches to `long_factor` past
    `original_max_position_embeddings` and scales cos/sin when `factor` > 1)."""
    short, long = rope.get("short_factor"), rope.get("long_factor")
    if short is None or list(short) != list(long or ()):
        raise CheckpointError("text longrope: short_factor and long_factor must be equal")
    factor = rope.get("factor")
    if factor is None and rope.get("original_max_position_embeddings"):
        factor = text.get("max_position_embeddings", 0) / rope["original_max_position_embeddings"]
    attention = rope.get("attention_factor", 1.0 if factor is None or factor <= 1 else None)
    if attention != 1.0:
        raise CheckpointError("text longrope: only attention_factor 1 (no cos/sin scaling)")
    return tuple(float(f) for f in short)


def qwen2_cache_groups(config: ModelConfig) -> tuple[AttentionGroup, ...]:
    """Every layer pages its K/V with the same heads: one group."""
    text = text_config(config)
    return (AttentionGroup(tuple(range(text.num_layers)), text.num_kv_heads, text.head_dim),)
