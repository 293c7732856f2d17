"""Nemotron 3 Nano Omni's config: the RADIO tower, the projector, the media ids, the EVS rate.

transformers 5.x names the fields `text_config`, `image_token_id`, `video_token_id`,
`vision_hidden_size`; the original releases `llm_config`, `img_context_token_id`,
`video_context_token_id`, `vit_hidden_size` (transformers maps them across; so do we). A
checkpoint may carry an audio branch (`audio_config`, `sound_encoder.*` tensors): it loads, its
tensors are never read, and requests hold no audio parts. A language model with
multi-token-prediction layers also normalizes the vision features before the projector
(`vision_final_layernorm`), as Megatron built it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stillcut.engine.model_config import CheckpointError, FamilyConfig, MediaTokenIds
from stillcut.engine.models.nemotron_omni.text_config import text_section

log = logging.getLogger(__name__)

_LEGACY_FIELDS = {
    "img_context_token_id": "image_token_id",
    "video_context_token_id": "video_token_id",
    "vit_hidden_size": "vision_hidden_size",
    "sound_config": "audio_config",
}
TUBELET_FRAMES = 2
_POSITIVE_FIELDS = (
    "hidden_size", "num_layers", "num_heads", "patch_size", "max_img_size",
    "temporal_patch_size", "merge_size", "projector_hidden_size", "text_hidden_size",
)  # fmt: skip


@dataclass(frozen=True)
class RadioVisionConfig:
    """A RADIO ViT and the projector after it.

    Images are cut into `patch_size` patches, videos into 2-frame tubelets of the same patches
    (`temporal_patch_size` frames stacked on the channels); `num_cls_tokens + num_registers`
    learned tokens lead the sequence and are dropped after the encoder. `merge_size` x
    `merge_size` patches are pixel-shuffled into one token (1 / `downsample_ratio`), which the
    projector (RMSNorm, linear, relu², linear) maps to `text_hidden_size`.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_ratio: float
    patch_size: int
    max_img_size: int
    num_cls_tokens: int
    num_registers: int
    temporal_patch_size: int
    merge_size: int
    projector_hidden_size: int
    text_hidden_size: int
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True
    final_layernorm: bool = False
    num_channels: int = 3

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision num_heads={self.num_heads} must divide hidden_size={self.hidden_size}"
            )
        if self.temporal_patch_size < 2:
            raise ValueError(f"temporal_patch_size={self.temporal_patch_size} must be >= 2")
        if (
            self.num_cls_tokens + self.num_registers < 1
            or min(self.num_cls_tokens, self.num_registers) < 0
        ):
            raise ValueError("num_cls_tokens and num_registers must be >= 0, not both 0")

    @property
    def num_prefix_tokens(self) -> int:
        """The cls and register tokens before the patches."""
        return self.num_cls_tokens + self.num_registers

    @property
    def mlp_size(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def projector_input_size(self) -> int:
        """Channels of one pixel-shuffled token."""
        return self.hidden_size * self.merge_size**2


def read_nemotron_omni(raw: Mapping[str, Any]) -> FamilyConfig:
    """The RADIO/projector config and the media ids of a `nemotron_h_omni` config.json.

    A video's tubelets are written with the image placeholder (as transformers' processor
    writes them); `video_token_id` is the `<video>` marker the chat template renders for a
    video part. The begin/end delimiters `<img>` / `</img>` are written by the family's prompt
    format as text, so no ids are needed for them.
    """
    fields = _with_current_names(raw)
    vision = fields.get("vision_config") or {}
    if vision.get("use_swiglu_ffn"):
        raise CheckpointError("vision use_swiglu_ffn=true is not supported (only the GELU MLP)")
    if vision.get("hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"vision hidden_act={vision['hidden_act']!r}; supported: 'gelu'")
    if fields.get("audio_config"):
        log.info("the checkpoint's audio branch is not used: requests take text, images, video")
    hidden_size = int(vision.get("hidden_size", 1280))
    vision_hidden_size = int(fields.get("vision_hidden_size", hidden_size))
    if vision_hidden_size != hidden_size:
        raise CheckpointError(
            f"vision_hidden_size={vision_hidden_size} must equal vision_config.hidden_size="
            f"{hidden_size}"
        )
    ratio = float(fields.get("downsample_ratio", 0.5))
    merge_size = round(1 / ratio)
    if abs(merge_size * ratio - 1) > 1e-6:
        raise CheckpointError(f"downsample_ratio={ratio} must be 1 / an integer")
    text = text_section(raw)
    config = RadioVisionConfig(
        hidden_size=hidden_size,
        num_layers=int(vision.get("num_hidden_layers", 32)),
        num_heads=int(vision.get("num_attention_heads", 16)),
        mlp_ratio=float(vision.get("mlp_ratio", 4.0)),
        patch_size=int(vision.get("patch_size", 16)),
        max_img_size=int(vision.get("max_img_size", 2048)),
        num_cls_tokens=int(vision.get("num_cls_tokens", 3)),
        num_registers=int(vision.get("num_registers", 7)),
        temporal_patch_size=int(
            vision.get("video_temporal_patch_size") or fields.get("video_temporal_patch_size", 2)
        ),
        merge_size=merge_size,
        projector_hidden_size=int(fields.get("projector_hidden_size", 4096)),
        text_hidden_size=int(text["hidden_size"]),
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
        qkv_bias=bool(vision.get("qkv_bias", True)),
        final_layernorm=int(text.get("num_nextn_predict_layers") or 0) > 0,
    )
    if config.temporal_patch_size != TUBELET_FRAMES:
        raise CheckpointError(
            f"video_temporal_patch_size={config.temporal_patch_size}; supported: "
            f"{TUBELET_FRAMES} (the prompt labels two frames per tubelet)"
        )
    image_token_id = int(fields["image_token_id"])
    token_ids = MediaTokenIds(
        image_token_id=image_token_id,
        video_token_id=int(fields["video_token_id"]),
        vision_start_token_id=None,
        vision_end_token_id=None,
    )
    return FamilyConfig(vision=config, token_ids=token_ids)


def nemotron_evs_rate(raw: Mapping[str, Any]) -> float:
    """The checkpoint's own EVS pruning rate, `video_pruning_rate` (0.0: EVS off)."""
    return float(raw.get("video_pruning_rate") or 0.0)


def _with_current_names(raw: Mapping[str, Any]) -> dict[str, Any]:
    fields = dict(raw)
    for legacy, current in _LEGACY_FIELDS.items():
        if fields.get(current) is None and fields.get(legacy) is not None:
            fields[current] = fields[legacy]
    for name in ("image_token_id", "video_token_id"):
        if fields.get(name) is None:
            raise KeyError(name)
    return fields
