"""The NemotronH language model's shape, read from a Nemotron 3 Nano Omni checkpoint.

A NemotronH decoder stacks four kinds of block, each a pre-norm mixer plus a residual: Mamba2
(the recurrent layers), attention without rotary embedding, a mixture of experts, and a plain
MLP. transformers 5.x saves the stack as `layers_block_type` (`linear_attention`,
`full_attention`, `moe`, `mlp`; older names `mamba` and `attention`), earlier releases as
`hybrid_override_pattern` (`M`, `*`, `E`, `-`); both read into the same frozen config, with
transformers' defaults and its legacy field names (`mamba_n_groups`, `mamba_d_conv`, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stillcut.engine.cache_groups import AttentionGroup, CacheGroup, RecurrentGroup
from stillcut.engine.model_config import CheckpointError, ModelConfig

MAMBA, ATTENTION, MOE, MLP = "mamba", "attention", "moe", "mlp"
LAYER_KINDS = (MAMBA, ATTENTION, MOE, MLP)
# Every spelling of a layer kind: transformers 5.x, its legacy names, the pattern's letters.
_KIND_NAMES = {
    "linear_attention": MAMBA, "mamba": MAMBA, "M": MAMBA,
    "full_attention": ATTENTION, "attention": ATTENTION, "*": ATTENTION,
    "moe": MOE, "E": MOE,
    "mlp": MLP, "-": MLP,
}  # fmt: skip
# Legacy config.json names transformers' NemotronHConfig still reads.
_LEGACY_FIELDS = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_min": "time_step_min",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "num_local_experts": "n_routed_experts",
}
_POSITIVE_FIELDS = (
    "vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "moe_shared_expert_intermediate_size", "n_group", "topk_group", "chunk_size",
)  # fmt: skip


@dataclass(frozen=True)
class NemotronTextConfig:
    """A NemotronH decoder. `layer_kinds[i]` is one of `LAYER_KINDS`.

    Mamba2 layers: `mamba_num_heads` heads of `mamba_head_dim`, `n_groups` groups of B/C of
    `ssm_state_size`, a depthwise causal conv of `conv_kernel` taps; dt is clamped below at
    `time_step_min` in the chunked (prompt) scan only, as in transformers. MoE layers: sigmoid
    routing over `num_experts` in `n_group` groups (`topk_group` of them kept), top
    `num_experts_per_tok`, a shared expert, relu² experts, optional `moe_latent_size`
    projections around the routed experts. `num_nextn_predict_layers` multi-token-prediction
    layers are stored beside the decoder and never run here (transformers skips them too).
    """

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    time_step_min: float = 0.001
    chunk_size: int = 128
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mlp_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.layer_kinds or set(self.layer_kinds) - set(LAYER_KINDS):
            raise ValueError(f"layer_kinds={self.layer_kinds}: each must be one of {LAYER_KINDS}")
        if ATTENTION not in self.layer_kinds:
            raise ValueError("a NemotronH stack needs at least one attention layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide {self.num_heads}")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"n_groups={self.n_groups} must divide {self.mamba_num_heads}")
        if self.num_experts % self.n_group or not self.topk_group <= self.n_group:
            raise ValueError(
                f"n_group={self.n_group} must divide num_experts={self.num_experts} and be "
                f">= topk_group={self.topk_group}"
            )
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("each expert group needs >= 2 experts (groups score their top 2)")
        if not self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be <= {self.num_experts}"
            )
        if self.moe_latent_size is not None and self.moe_latent_size < 1:
            raise ValueError(f"moe_latent_size={self.moe_latent_size} must be >= 1 or None")
        if not self.conv_kernel >= 2:
            raise ValueError(f"conv_kernel={self.conv_kernel} must be >= 2")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def mamba_inner_size(self) -> int:
        """Width of the Mamba2 inner stream (x, and the gate z)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: x, B and C."""
        return self.mamba_inner_size + 2 * self.n_groups * self.ssm_state_size

    def layer_ids(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)


def text_section(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields: `text_config`, or `llm_config` in the original releases."""
    text = raw.get("text_config") or raw.get("llm_config")
    if not isinstance(text, Mapping):
        raise CheckpointError("config.json has no text_config (nor llm_config) section")
    return text


def nemotron_text_config(config: ModelConfig) -> NemotronTextConfig:
    """The NemotronTextConfig of a Nemotron 3 Nano Omni checkpoint's config.

    Raises CheckpointError for a missing field or what this model does not implement: an
    activation other than relu² (MLP, experts) or SiLU (Mamba2).
    """
    text = _with_current_names(text_section(config.raw))
    for field, allowed in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if text.get(field, allowed) != allowed:
            raise CheckpointError(f"text {field}={text[field]!r}; supported: {allowed!r}")
    try:
        num_heads = int(text.get("num_attention_heads", 32))
        hidden_size = int(text["hidden_size"])
        latent = text.get("moe_latent_size")
        return NemotronTextConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden_size,
            layer_kinds=_layer_kinds(text),
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=int(text.get("head_dim") or hidden_size // num_heads),
            intermediate_size=int(text.get("intermediate_size", 21504)),
            mamba_num_heads=int(text.get("mamba_num_heads", 128)),
            mamba_head_dim=int(text.get("mamba_head_dim", 64)),
            ssm_state_size=int(text.get("ssm_state_size", 128)),
            n_groups=int(text.get("n_groups", 8)),
            conv_kernel=int(text.get("conv_kernel", 4)),
            num_experts=int(text.get("n_routed_experts", 8)),
            num_experts_per_tok=int(text.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(text.get("moe_intermediate_size", 7688)),
            moe_shared_expert_intermediate_size=int(
                text.get("moe_shared_expert_intermediate_size", 7688)
            ),
            moe_latent_size=None if latent is None else int(latent),
            n_group=int(text.get("n_group", 1)),
            topk_group=int(text.get("topk_group", 1)),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
            time_step_min=float(text.get("time_step_min", 0.001)),
            chunk_size=int(text.get("chunk_size", 128)),
            use_conv_bias=bool(text.get("use_conv_bias", True)),
            mamba_proj_bias=bool(text.get("use_bias", False)),
            mlp_bias=bool(text.get("mlp_bias", False)),
            layer_norm_epsilon=float(text.get("layer_norm_epsilon", 1e-5)),
            num_nextn_predict_layers=int(text.get("num_nextn_predict_layers") or 0),
            tie_word_embeddings=config.tie_word_embeddings,
        )
    except KeyError as error:
        raise CheckpointError(f"text config field {error} is missing") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"text config: {error}") from error


def _with_current_names(text: Mapping[str, Any]) -> dict[str, Any]:
    """`text` with legacy field names renamed (a field under its current name wins)."""
    renamed = dict(text)
    for legacy, current in _LEGACY_FIELDS.items():
        if legacy in renamed:
            value = renamed.pop(legacy)
            renamed.setdefault(current, value)
    return renamed


def _layer_kinds(text: Mapping[str, Any]) -> tuple[str, ...]:
    """The stack from `layers_block_type` (or `layer_types`), else `hybrid_override_pattern`."""
    names = text.get("layers_block_type") or text.get("layer_types")
    if names is None:
        pattern = text.get("hybrid_override_pattern")
        if not isinstance(pattern, str):
            raise CheckpointError(
                "text config has neither layers_block_type nor hybrid_override_pattern"
            )
        names = list(pattern)
    unknown = sorted({str(name) for name in names} - set(_KIND_NAMES))
    if unknown:
        raise CheckpointError(
            f"text layer types {unknown} are not supported; allowed: {sorted(_KIND_NAMES)}"
        )
    return tuple(_KIND_NAMES[name] for name in names)


def nemotron_cache_groups(config: ModelConfig) -> tuple[CacheGroup, ...]:
    """Attention layers page K/V; Mamba2 layers keep a conv state `[conv_dim, conv_kernel - 1]`
    (the last inputs of the causal conv) and an SSM state `[heads, head_dim, state_size]`,
    dt floored for prompt tokens only (`prompt_dependent`)."""
    text = nemotron_text_config(config)
    groups: list[CacheGroup] = [
        AttentionGroup(text.layer_ids(ATTENTION), text.num_kv_heads, text.head_dim)
    ]
    if mamba_layers := text.layer_ids(MAMBA):
        conv_state = (text.conv_dim, text.conv_kernel - 1)
        ssm_state = (text.mamba_num_heads, text.mamba_head_dim, text.ssm_state_size)
        groups.append(RecurrentGroup(mamba_layers, (conv_state, ssm_state), prompt_dependent=True))
    return tuple(groups)
