"""What stillcut needs from a Gemma 3 checkpoint's config.json for its vision side.

Gemma 3 encodes every image (and every video frame) at one fixed square size with a SigLIP
ViT, average-pools the patch grid down to `mm_tokens_per_image` tokens and projects them to the
language model's width. `SiglipVisionConfig` holds the tower's and the projector's shape;
`read_gemma3` reads it and the image token ids. Fields that real config.json files omit take
transformers' defaults (SigLIP's for the tower, Gemma 3's for the ids). A config with
`vision_use_head: true` (SigLIP's default when a config is built without the field) is read
too: its pooling head is never used by Gemma 3, whose projector reads the patch states, and its
weights are skipped at load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stillcut.engine.model_config import FamilyConfig, MediaTokenIds

# transformers' SiglipVisionConfig defaults, for fields that config.json may omit.
_SIGLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": True,
}
# transformers' Gemma3Config defaults.
_DEFAULT_MM_TOKENS_PER_IMAGE = 256
_TOKEN_ID_DEFAULTS = {
    "image_token_index": 262144,
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
}
_POSITIVE_FIELDS = (
    "hidden_size", "intermediate_size", "num_layers", "num_heads", "image_size", "patch_size",
    "out_hidden_size", "mm_tokens_per_image", "in_channels",
)  # fmt: skip


@dataclass(frozen=True)
class SiglipVisionConfig:
    """Gemma 3's vision side: a pre-norm SigLIP ViT over `image_size` squares, then the projector.

    The projector average-pools the `patches_per_side`^2 patch grid with a `pool_kernel` square
    window to `mm_tokens_per_image` tokens, RMS-normalises them and projects them to
    `out_hidden_size`, the language model's width.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    out_hidden_size: int
    mm_tokens_per_image: int
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    in_channels: int = 3
    has_pooling_head: bool = False  # stored but unused (see the module docstring)

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size={self.image_size} must be a multiple of patch_size={self.patch_size}"
            )
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image or self.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image={self.mm_tokens_per_image} must be a square whose side "
                f"divides image_size / patch_size = {self.patches_per_side}"
            )
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool_kernel(self) -> int:
        """Side, in patches, of the square each output token averages."""
        return self.patches_per_side // self.tokens_per_side

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: channels * pixels * pixels."""
        return self.in_channels * self.patch_size**2


def read_gemma3(raw: Mapping[str, Any]) -> FamilyConfig:
    """The SiglipVisionConfig and media token ids of a Gemma 3 config.json (parsed).

    Raises KeyError for a missing `text_config.hidden_size`, ValueError for a shape this
    encoder cannot use.
    """
    return FamilyConfig(_vision_config(raw), _token_ids(raw))


def _vision_config(raw: Mapping[str, Any]) -> SiglipVisionConfig:
    fields = {**_SIGLIP_DEFAULTS, **(raw.get("vision_config") or {})}
    return SiglipVisionConfig(
        hidden_size=int(fields["hidden_size"]),
        intermediate_size=int(fields["intermediate_size"]),
        num_layers=int(fields["num_hidden_layers"]),
        num_heads=int(fields["num_attention_heads"]),
        image_size=int(fields["image_size"]),
        patch_size=int(fields["patch_size"]),
        out_hidden_size=int(raw["text_config"]["hidden_size"]),
        mm_tokens_per_image=int(raw.get("mm_tokens_per_image", _DEFAULT_MM_TOKENS_PER_IMAGE)),
        hidden_act=str(fields["hidden_act"]),
        layer_norm_eps=float(fields["layer_norm_eps"]),
        in_channels=int(fields["num_channels"]),
        has_pooling_head=bool(fields["vision_use_head"]),
    )


def _token_ids(raw: Mapping[str, Any]) -> MediaTokenIds:
    """The soft token, `<start_of_image>` (boi) as vision start and `<end_of_image>` (eoi) as
    vision end; no video token. transformers writes `*_token_index`; `*_token_id` spellings
    are accepted too."""
    ids = {}
    for name, default in _TOKEN_ID_DEFAULTS.items():
        alias = name.replace("_index", "_id")
        ids[name] = int(raw.get(name, raw.get(alias, default)))
    return MediaTokenIds(
        image_token_id=ids["image_token_index"],
        video_token_id=None,
        vision_start_token_id=ids["boi_token_index"],
        vision_end_token_id=ids["eoi_token_index"],
    )
