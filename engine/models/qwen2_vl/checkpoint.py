"""What the built checkpoints contain: Qwen's fixed ids, the size presets, the pixel budgets.

Presets name the few sizes that matter (text and vision widths, depths, heads); everything
else follows real Qwen2.5-VL / Qwen2-VL checkpoints: the 151,936-entry vocabulary, the
vision token ids, 14-pixel patches in 2-frame tubelets merged 2x2, CLIP normalisation, and
preprocessor configs written with the same keys as the published ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

VOCAB_SIZE = 151936
BOS_TOKEN_ID = 151643  # <|endoftext|>
EOS_TOKEN_ID = 151645  # <|im_end|>
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653
IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656

PIXELS_PER_TOKEN = 28 * 28  # one merged 2x2 group of 14-pixel patches
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP, as Qwen-VL uses
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
RANDOM_DEMO = "random-demo"  # the random-weight preset the speed benchmarks measure

_VISION_COMMON = MappingProxyType(
    {"patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2}
)
_QWEN2_5_VISION_EXTRA = MappingProxyType({"window_size": 112, "tokens_per_second": 2})


@dataclass(frozen=True)
class Preset:
    """A named model size. `vision` uses Qwen2.5-VL keys; `family_vision` translates them.
    `tie_word_embeddings` is the default a spec may override. `streamed` presets are too large
    to build in memory: their weights are written tensor by tensor (`factory.streamed`)."""

    dtype: Literal["float32", "bfloat16"]
    text: Mapping[str, int]
    vision: Mapping[str, Any]
    tie_word_embeddings: bool = True
    streamed: bool = False

    def __post_init__(self) -> None:
        # Read-only views: presets are shared by every caller.
        object.__setattr__(self, "text", MappingProxyType(dict(self.text)))
        object.__setattr__(self, "vision", MappingProxyType(dict(self.vision)))


_DEMO_TEXT = MappingProxyType(
    {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1536,
    }
)
_DEMO_VISION = MappingProxyType(
    {
        "depth": 8,
        "hidden_size": 256,
        "num_heads": 4,
        "intermediate_size": 768,
        "fullatt_block_indexes": (3, 7),
    }
)

# The vision tower of the released Qwen2.5-VL 3B and 7B checkpoints.
_RELEASED_VISION = MappingProxyType(
    {
        "depth": 32,
        "hidden_size": 1280,
        "num_heads": 16,
        "intermediate_size": 3420,
        "fullatt_block_indexes": (7, 15, 23, 31),
    }
)

PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        # Builds in seconds; the real vocabulary makes the embedding most of its 5M parameters.
        "tiny": Preset(
            dtype="float32",
            text={
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 64,
            },
            vision={
                "depth": 2,
                "hidden_size": 32,
                "num_heads": 2,
                "intermediate_size": 64,
                "fullatt_block_indexes": (1,),
            },
        ),
        # What the speed benchmarks measure: ~110M parameters (78M of them the tied embedding).
        RANDOM_DEMO: Preset(dtype="bfloat16", text=_DEMO_TEXT, vision=_DEMO_VISION),
        # random-demo's shape with its own LM head: 180M language-model parameters (2 x 78M of
        # them vocabulary), the size decode speed is measured at (bench/decode_roofline.py).
        "lm180m": Preset(
            dtype="bfloat16", text=_DEMO_TEXT, vision=_DEMO_VISION, tie_word_embeddings=False
        ),
        # The shapes of Qwen2.5-VL-3B-Instruct (3.75B parameters, 7.5 GB in bf16), random.
        "3b": Preset(
            dtype="bfloat16",
            text={
                "hidden_size": 2048,
                "num_hidden_layers": 36,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "intermediate_size": 11008,
            },
            vision=_RELEASED_VISION,
            streamed=True,
        ),
        # The shapes of Qwen2.5-VL-7B-Instruct (8.3B parameters, 16.6 GB in bf16), random.
        "7b": Preset(
            dtype="bfloat16",
            text={
                "hidden_size": 3584,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "intermediate_size": 18944,
            },
            vision=_RELEASED_VISION,
            streamed=True,
            tie_word_embeddings=False,
        ),
    }
)


@dataclass(frozen=True)
class ProcessorSpec:
    """Pixel budgets written to the image and video preprocessor configs.

    The defaults keep a clip cheap on two CPU cores: at most 256 merged tokens per video
    tubelet and 512 per image.
    """

    image_min_pixels: int = 4 * PIXELS_PER_TOKEN
    image_max_pixels: int = 512 * PIXELS_PER_TOKEN
    video_min_pixels: int = 16 * PIXELS_PER_TOKEN
    video_max_pixels: int = 256 * PIXELS_PER_TOKEN

    def __post_init__(self) -> None:
        for kind in ("image", "video"):
            low = getattr(self, f"{kind}_min_pixels")
            high = getattr(self, f"{kind}_max_pixels")
            if not 0 < low <= high:
                raise ValueError(
                    f"{kind}_min_pixels={low}, {kind}_max_pixels={high}: "
                    f"need 0 < {kind}_min_pixels <= {kind}_max_pixels"
                )


def mrope_section(head_dim: int) -> list[int]:
    """M-RoPE (t, h, w) split of head_dim / 2 rotary pairs in Qwen2.5-VL's 16:24:24 ratio."""
    spatial = 3 * (head_dim // 2) // 8
    return [head_dim // 2 - 2 * spatial, spatial, spatial]


def family_vision(family: str, vision: Mapping[str, Any], text_hidden: int) -> dict[str, Any]:
    """Full vision config fields for `family` from a preset's Qwen2.5-VL-style fields.

    The output width always follows the text hidden size (Qwen2-VL names it `hidden_size`).
    """
    if family == "qwen2_5_vl":
        return {**_VISION_COMMON, **_QWEN2_5_VISION_EXTRA, **vision, "out_hidden_size": text_hidden}
    return {
        **_VISION_COMMON,
        "depth": vision["depth"],
        "embed_dim": vision["hidden_size"],
        "num_heads": vision["num_heads"],
        "mlp_ratio": vision["intermediate_size"] // vision["hidden_size"],
        "hidden_size": text_hidden,
    }


def preprocessor_configs(
    family: str, vision: Mapping[str, Any], budget: ProcessorSpec
) -> dict[str, dict[str, Any]]:
    """File name -> contents of `preprocessor_config.json` and `video_preprocessor_config.json`."""
    processor_class = "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen2VLProcessor"

    def shared(min_pixels: int, max_pixels: int) -> dict[str, Any]:
        # Real checkpoints carry both the legacy pixel keys and the newer `size` dict.
        return {
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": list(IMAGE_MEAN),
            "image_std": list(IMAGE_STD),
            "max_pixels": max_pixels,
            "merge_size": vision["spatial_merge_size"],
            "min_pixels": min_pixels,
            "patch_size": vision["patch_size"],
            "processor_class": processor_class,
            "resample": 3,  # bicubic
            "rescale_factor": 1 / 255,
            "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
            "temporal_patch_size": vision["temporal_patch_size"],
        }

    return {
        "preprocessor_config.json": {
            **shared(budget.image_min_pixels, budget.image_max_pixels),
            "image_processor_type": "Qwen2VLImageProcessor",
        },
        "video_preprocessor_config.json": {
            **shared(budget.video_min_pixels, budget.video_max_pixels),
            "video_processor_type": "Qwen2VLVideoProcessor",
        },
    }
