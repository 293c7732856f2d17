"""The Gemma 3 language model's shape, read from a checkpoint's `text_config`.

Gemma 3 interleaves local layers (sliding-window attention) with global ones, and each kind has
its own rotary base; the global layers of the 4B and larger models also stretch their
positions linearly (factor 8). transformers 5.x writes this as `layer_types` plus
`rope_parameters` keyed by layer type; the original releases write `sliding_window_pattern`,
`rope_theta`, `rope_local_base_freq` and `rope_scaling`. Both are read into the same frozen
config, with transformers' defaults for what is omitted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stillcut.engine.cache_groups import AttentionGroup
from stillcut.engine.model_config import CheckpointError, ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "linear")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# transformers' Gemma3TextConfig defaults for fields config.json may omit.
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
_LEGACY_THETA_KEYS = {FULL: "rope_theta", SLIDING: "rope_local_base_freq"}
_DEFAULT_SLIDING_WINDOW_PATTERN = 6
_POSITIVE_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "sliding_window", "query_pre_attn_scalar",
)  # fmt: skip


@dataclass(frozen=True)
class RopeParameters:
    """One layer type's rotary embedding: base `theta`, positions divided by `factor`."""

    theta: float
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not (self.theta > 0 and self.factor > 0):
            raise ValueError(f"rope theta={self.theta} and factor={self.factor} must be > 0")


@dataclass(frozen=True)
class Gemma3TextConfig:
    """Gemma 3's decoder: GQA attention with QK-norm, GeGLU MLP, four (1 + w) RMSNorms a layer.

    `layer_types[i]` is "sliding_attention" (keys within `sliding_window` sequence slots) or
    "full_attention"; `rope[layer_type]` is that kind's rotary embedding. Attention scores are
    scaled by `query_pre_attn_scalar ** -0.5`; the soft caps are None when off.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope: Mapping[str, RopeParameters]
    query_pre_attn_scalar: float
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary pairs)")
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"layer_types={self.layer_types} must hold num_layers={self.num_layers} entries "
                f"from {LAYER_TYPES}"
            )
        if set(self.rope) != set(LAYER_TYPES):
            raise ValueError(f"rope has entries for {sorted(self.rope)}; needed: {LAYER_TYPES}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be > 0 or None")


def gemma3_text_config(config: ModelConfig) -> Gemma3TextConfig:
    """The Gemma3TextConfig of a Gemma 3 checkpoint's config.

    Raises CheckpointError for a missing field or what this model does not implement:
    another activation, attention biases, bidirectional text (EmbeddingGemma) or a rotary type
    other than default and linear.
    """
    text = config.text
    activation = text.get("hidden_activation", GELU_TANH[0])
    if activation not in GELU_TANH:
        raise CheckpointError(f"text hidden_activation={activation!r}; supported: {GELU_TANH}")
    for flag in ("attention_bias", "use_bidirectional_attention"):
        if text.get(flag):
            raise CheckpointError(f"text {flag}=true is not supported (only false)")
    try:
        num_layers = int(text["num_hidden_layers"])
        num_heads = int(text["num_attention_heads"])
        hidden_size = int(text["hidden_size"])
        return Gemma3TextConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=int(text.get("head_dim") or hidden_size // num_heads),
            intermediate_size=int(text["intermediate_size"]),
            layer_types=_layer_types(text, num_layers),
            sliding_window=int(text["sliding_window"]),
            rope={kind: _rope(text, kind) for kind in LAYER_TYPES},
            query_pre_attn_scalar=float(text.get("query_pre_attn_scalar", 256)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=_optional_float(text.get("final_logit_softcapping")),
            attn_logit_softcapping=_optional_float(text.get("attn_logit_softcapping")),
            tie_word_embeddings=config.tie_word_embeddings,
        )
    except KeyError as error:
        raise CheckpointError(f"text config field {error} is missing") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"text config: {error}") from error


def _layer_types(text: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """`layer_types`, or the original releases' pattern: every n-th layer is global."""
    if text.get("layer_types"):
        return tuple(text["layer_types"])
    pattern = int(text.get("sliding_window_pattern", _DEFAULT_SLIDING_WINDOW_PATTERN))
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def _rope(text: Mapping[str, Any], kind: str) -> RopeParameters:
    parameters = dict((text.get("rope_parameters") or {}).get(kind) or {})
    if kind == FULL:
        # Original releases: `rope_scaling` (e.g. linear x8) applies to the global layers only.
        parameters = {**(text.get("rope_scaling") or {}), **parameters}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"text {kind} rope type {rope_type!r}; supported: {ROPE_TYPES}")
    theta = parameters.get("rope_theta", text.get(_LEGACY_THETA_KEYS[kind], _DEFAULT_THETA[kind]))
    factor = float(parameters["factor"]) if rope_type == "linear" else 1.0
    return RopeParameters(theta=float(theta), factor=factor)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def gemma3_cache_groups(config: ModelConfig) -> tuple[AttentionGroup, ...]:
    """Local layers (their window) and global layers, each a group of the same K/V shape."""
    text = gemma3_text_config(config)
    groups = []
    for kind, window in ((SLIDING, text.sliding_window), (FULL, None)):
        layer_ids = tuple(i for i, t in enumerate(text.layer_types) if t == kind)
        if layer_ids:
            groups.append(AttentionGroup(layer_ids, text.num_kv_heads, text.head_dim, window))
    return tuple(groups)
