"""Qwen2.5-VL and Qwen2-VL test checkpoints: fixed ids, size presets, pixel budgets, recipe.

Presets name the few sizes that matter (text and vision widths, depths, heads); everything
else follows real Qwen2.5-VL / Qwen2-VL checkpoints: the 151,936-entry vocabulary and the real
Qwen2.5 tokenizer (`factory.qwen_tokenizer`), the vision token ids, 14-pixel patches in
2-frame tubelets merged 2x2, CLIP normalisation, and preprocessor configs written with the same
keys as the published ones. The `3b` and `7b` presets are written tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from stillcut.engine.factory.qwen_tokenizer import (
    TOKENIZER_FILES,
    qwen_tokenizer_dir,
    tokenizer_cache_name,
)
from stillcut.engine.factory.recipe import (
    RANDOM_DEMO,
    CheckpointRecipe,
    Fields,
    Preset,
    random_marks,
)
from stillcut.engine.models.pixels import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from stillcut.engine.factory.checkpoints import CheckpointSpec

VOCAB_SIZE = 151936
BOS_TOKEN_ID = 151643  # <|endoftext|>
EOS_TOKEN_ID = 151645  # <|im_end|>
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653
IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656

PIXELS_PER_TOKEN = 28 * 28  # one merged 2x2 group of 14-pixel patches

_VISION_COMMON = MappingProxyType(
    {"patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2}
)
_QWEN2_5_VISION_EXTRA = MappingProxyType({"window_size": 112, "tokens_per_second": 2})


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
            "image_mean": list(OPENAI_CLIP_MEAN),
            "image_std": list(OPENAI_CLIP_STD),
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


class QwenCheckpoints(CheckpointRecipe):
    """The recipe of one Qwen `model_type` ("qwen2_5_vl" or "qwen2_vl"); its option is
    `processor` (`ProcessorSpec` fields)."""

    presets = PRESETS
    option_names = ("processor",)
    generation_ids = MappingProxyType(
        {
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID],
            "pad_token_id": BOS_TOKEN_ID,
        }
    )

    def __init__(self, model_type: str, model_class: str, config_class: str) -> None:
        self.model_type, self.model_class, self.config_class = model_type, model_class, config_class

    def resolve(self, preset: str, text: Fields, vision: Fields, options: Fields) -> dict[str, Any]:
        """M-RoPE sections follow Qwen's 1:1.5:1.5 split of head_dim / 2 unless overridden, and
        the vision output width follows the text hidden size."""
        base = PRESETS[preset]
        resolved_text = {
            "vocab_size": VOCAB_SIZE,
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            **base.text,
            **text,
        }
        num_heads = resolved_text["num_attention_heads"]
        head_dim = resolved_text["hidden_size"] // num_heads if num_heads > 0 else 0  # 0: rejected
        resolved_text.setdefault("max_window_layers", resolved_text["num_hidden_layers"])
        resolved_text.setdefault(
            "rope_parameters",
            {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section(head_dim)},
        )
        resolved_vision = family_vision(self.model_type, base.vision, resolved_text["hidden_size"])
        processor = ProcessorSpec(**(options.get("processor") or {}))
        return {
            "text": resolved_text,
            "vision": {**resolved_vision, **vision},
            "options": {"processor": dataclasses.asdict(processor)},
        }

    def check(self, spec: CheckpointSpec) -> None:
        hidden = spec.text["hidden_size"]
        head_dim = hidden // spec.text["num_attention_heads"]
        sections = spec.text["rope_parameters"].get("mrope_section", ())
        if sum(sections) != head_dim // 2:
            raise ValueError(
                f"text rope_parameters.mrope_section={sections} must sum to "
                f"head_dim / 2 = {head_dim // 2}"
            )
        out_key = "out_hidden_size" if self.model_type == "qwen2_5_vl" else "hidden_size"
        if spec.vision[out_key] != hidden:
            raise ValueError(
                f"vision {out_key}={spec.vision[out_key]} must equal text hidden_size={hidden}"
            )

    def hf_config(self, spec: CheckpointSpec) -> PreTrainedConfig:
        import transformers

        return getattr(transformers, self.config_class)(
            text_config=dict(spec.text),
            vision_config=dict(spec.vision),
            tie_word_embeddings=spec.tie_word_embeddings,
            image_token_id=IMAGE_TOKEN_ID,
            video_token_id=VIDEO_TOKEN_ID,
            vision_start_token_id=VISION_START_TOKEN_ID,
            vision_end_token_id=VISION_END_TOKEN_ID,
            **random_marks(spec),
        )

    def processor_files(self, spec: CheckpointSpec) -> dict[str, dict[str, Any]]:
        budget = ProcessorSpec(**spec.options["processor"])
        return preprocessor_configs(self.model_type, spec.vision, budget)

    def tokenizer_name(self) -> str:
        return tokenizer_cache_name()

    def write_tokenizer(self, folder: Path) -> None:
        tokenizer_folder = qwen_tokenizer_dir()
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_folder / name, folder / name)


QWEN2_5_VL_CHECKPOINTS = QwenCheckpoints(
    "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig"
)
QWEN2_VL_CHECKPOINTS = QwenCheckpoints(
    "qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VLConfig"
)
