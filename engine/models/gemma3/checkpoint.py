"""Gemma 3 test checkpoints: the tiny preset, its config, processor files and recipe.

The `tiny` preset keeps what a Gemma 3 engine must get right and little else: local (sliding
window 8) and global layers, different RoPE bases with linear scaling x8 on the global layers,
`query_pre_attn_scalar` unequal to head_dim, GQA, a SigLIP tower on 64-px images pooled to
4 x 4 = 16 tokens per image, and the trained tiny tokenizer (its size is the vocabulary).
transformers initialises Gemma's `1 + weight` RMSNorm scales and the projector to zero; the
builder draws them at random instead, so that images change the output and a norm applied as
`weight` instead of `1 + weight` shows.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from stillcut.engine.factory.recipe import CheckpointRecipe, Fields, Preset, random_marks
from stillcut.engine.models.gemma3.tokenizer import (
    BOI_TOKEN_ID,
    BOS_TOKEN_ID,
    END_OF_TURN_ID,
    EOI_TOKEN_ID,
    EOS_TOKEN_ID,
    IMAGE_TOKEN_ID,
    PAD_TOKEN_ID,
    TOKENIZER,
    VOCAB_SIZE,
)

if TYPE_CHECKING:
    from torch import nn
    from transformers import Gemma3Config

    from stillcut.engine.factory.checkpoints import CheckpointSpec

GENERATION_IDS = MappingProxyType(
    {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, END_OF_TURN_ID],  # as Gemma 3 instruction-tuned models
        "pad_token_id": PAD_TOKEN_ID,
    }
)
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
RESAMPLE_BILINEAR = 2
NORM_WEIGHT_STD = 0.1  # random `1 + weight` norm scales: weight ~ N(0, 0.1)

GEMMA3_PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "tiny": Preset(
            dtype="float32",
            text={
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "query_pre_attn_scalar": 24,
                "sliding_window": 8,
                "max_position_embeddings": 4096,
            },
            vision={
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "image_size": 64,
                "patch_size": 8,
            },
        ),
    }
)
MM_TOKENS_PER_IMAGE = 16  # 8 x 8 patches pooled 2 x 2
# The real models' pattern, shortened: local layers, one global, then local again.
_LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
_ROPE_PARAMETERS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
}


class Gemma3Checkpoints(CheckpointRecipe):
    """Gemma 3's recipe; its option is `mm_tokens_per_image` (a square whose side divides the
    tower's patches per side)."""

    model_class = "Gemma3ForConditionalGeneration"
    presets = GEMMA3_PRESETS
    option_names = ("mm_tokens_per_image",)
    generation_ids = GENERATION_IDS
    tokenizer = TOKENIZER

    def resolve(self, preset: str, text: Fields, vision: Fields, options: Fields) -> dict[str, Any]:
        base = GEMMA3_PRESETS[preset]
        resolved_text = {
            "vocab_size": VOCAB_SIZE,
            "pad_token_id": PAD_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "bos_token_id": BOS_TOKEN_ID,
            "rope_parameters": copy.deepcopy(_ROPE_PARAMETERS),
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            **base.text,
            **text,
        }
        num_layers = resolved_text["num_hidden_layers"]
        # The pattern repeats for deeper overrides; shallower ones keep its start.
        resolved_text.setdefault(
            "layer_types", [_LAYER_TYPES[i % len(_LAYER_TYPES)] for i in range(max(num_layers, 0))]
        )
        tokens = options.get("mm_tokens_per_image")
        return {
            "text": resolved_text,
            "vision": {**base.vision, "vision_use_head": False, **vision},
            "options": {"mm_tokens_per_image": MM_TOKENS_PER_IMAGE if tokens is None else tokens},
        }

    def check(self, spec: CheckpointSpec) -> None:
        text, vision = spec.text, spec.vision
        tokens = spec.options["mm_tokens_per_image"]
        if text["vocab_size"] != VOCAB_SIZE:
            raise ValueError(
                f"text vocab_size={text['vocab_size']} must equal the tokenizer's size {VOCAB_SIZE}"
            )
        if len(text["layer_types"]) != text["num_hidden_layers"]:
            raise ValueError(
                f"text layer_types has {len(text['layer_types'])} entries; "
                f"num_hidden_layers={text['num_hidden_layers']}"
            )
        patches_per_side = vision["image_size"] // vision["patch_size"]
        side = math.isqrt(tokens) if tokens else 0
        if side < 1 or side * side != tokens or patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image={tokens} must be a square whose side divides "
                f"image_size / patch_size = {patches_per_side}"
            )

    def hf_config(self, spec: CheckpointSpec) -> Gemma3Config:
        from transformers import Gemma3Config

        # Deep copies: transformers fills nested rope dicts in place, which would change the spec.
        return Gemma3Config(
            text_config=copy.deepcopy(spec.text),
            vision_config=copy.deepcopy(spec.vision),
            mm_tokens_per_image=spec.options["mm_tokens_per_image"],
            boi_token_index=BOI_TOKEN_ID,
            eoi_token_index=EOI_TOKEN_ID,
            image_token_index=IMAGE_TOKEN_ID,
            tie_word_embeddings=spec.tie_word_embeddings,
            **random_marks(spec),
        )

    def processor_files(self, spec: CheckpointSpec) -> dict[str, dict[str, Any]]:
        """`preprocessor_config.json` and `processor_config.json`."""
        size, tokens = spec.vision["image_size"], spec.options["mm_tokens_per_image"]
        return {
            "preprocessor_config.json": {
                "do_convert_rgb": None,
                "do_normalize": True,
                "do_pan_and_scan": None,
                "do_rescale": True,
                "do_resize": True,
                "image_mean": list(IMAGE_MEAN),
                "image_processor_type": "Gemma3ImageProcessor",
                "image_seq_length": tokens,
                "image_std": list(IMAGE_STD),
                "processor_class": "Gemma3Processor",
                "resample": RESAMPLE_BILINEAR,
                "rescale_factor": 1 / 255,
                "size": {"height": size, "width": size},
            },
            "processor_config.json": {
                "image_seq_length": tokens,
                "processor_class": "Gemma3Processor",
            },
        }

    def randomize(self, model: nn.Module) -> None:
        """Draw the weights transformers leaves at zero: the `1 + weight` norm scales and the
        projector."""
        import torch

        with torch.no_grad():
            for module in model.modules():
                if type(module).__name__ == "Gemma3RMSNorm":
                    module.weight.normal_(0.0, NORM_WEIGHT_STD)
            projection = model.model.multi_modal_projector.mm_input_projection_weight
            projection.normal_(0.0, model.config.text_config.initializer_range)


GEMMA3_CHECKPOINTS = Gemma3Checkpoints()
