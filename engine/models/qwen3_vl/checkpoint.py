"""Qwen3-VL test checkpoints: presets, processor configs and the recipe.

Built with transformers' own `Qwen3VLForConditionalGeneration` from a preset's few sizes;
everything else follows the published Qwen3-VL checkpoints: the Qwen2.5 vocabulary, tokenizer
and media token ids (Qwen3-VL keeps them), 16-pixel patches in 2-frame tubelets merged 2x2,
mean and std 0.5, interleaved M-RoPE, DeepStack after the first layers.

Chat template: the published Qwen3-VL template is not available offline, so the checkpoint
carries the Qwen2.5-VL template as a stand-in. For media it renders what Qwen3-VL's does
(`<|vision_start|><|image_pad|><|vision_end|>` per image and the same with `<|video_pad|>`
per video, which the prompt format writes out per tubelet); it lacks the real one's tool and
reasoning branches (Thinking variants go through `--reasoning-parser think`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from stillcut.engine.factory.recipe import Fields, Preset
from stillcut.engine.models.qwen2_vl.checkpoint import (
    VOCAB_SIZE,
    ProcessorSpec,
    QwenCheckpoints,
)

if TYPE_CHECKING:
    from torch import nn

    from stillcut.engine.factory.checkpoints import CheckpointSpec

PIXELS_PER_TOKEN = 32 * 32  # one merged 2x2 group of 16-pixel patches
NORM_WEIGHT_STD = 0.2  # spread of the norm scales transformers initialises to one

PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        # Builds in about a second: three layers, so what the second DeepStack set adds still
        # passes a layer before the logits.
        "tiny": Preset(
            dtype="float32",
            text={
                "hidden_size": 32,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "intermediate_size": 64,
            },
            vision={
                "depth": 3,
                "hidden_size": 32,
                "num_heads": 2,
                "intermediate_size": 64,
                "num_position_embeddings": 16,
                "deepstack_visual_indexes": (0, 1),
            },
        ),
        # The shapes of Qwen3-VL-8B-Instruct (8.8B parameters, 17.5 GB in bf16), random: its
        # tower (27 blocks 1152 wide, DeepStack from blocks 8, 16 and 24) and its own LM head.
        "8b": Preset(
            dtype="bfloat16",
            text={
                "hidden_size": 4096,
                "num_hidden_layers": 36,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "intermediate_size": 12288,
            },
            vision={
                "depth": 27,
                "hidden_size": 1152,
                "num_heads": 16,
                "intermediate_size": 4304,
                "num_position_embeddings": 2304,
                "deepstack_visual_indexes": (8, 16, 24),
            },
            streamed=True,
            tie_word_embeddings=False,
        ),
    }
)
_TINY = PRESETS["tiny"]
MOE_PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        # The tiny dense shape with four experts, two per token, in every layer but the second
        # (`mlp_only_layers`): both kinds of MLP in one model.
        "tiny": dataclasses.replace(
            _TINY,
            text={
                **_TINY.text,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [1],
            },
        ),
    }
)

# Pixel budgets in Qwen3-VL's 32-pixel tokens, cheap on two CPU cores: at most 512 merged
# tokens per image and 2048 per clip.
DEFAULT_PROCESSOR = ProcessorSpec(
    image_min_pixels=4 * PIXELS_PER_TOKEN,
    image_max_pixels=512 * PIXELS_PER_TOKEN,
    video_min_pixels=16 * PIXELS_PER_TOKEN,
    video_max_pixels=2048 * PIXELS_PER_TOKEN,
)


def mrope_section(head_dim: int) -> list[int]:
    """(t, h, w) frequency counts of head_dim / 2 in Qwen3-VL's 24:20:20 ratio."""
    spatial = 5 * (head_dim // 2) // 16
    return [head_dim // 2 - 2 * spatial, spatial, spatial]


class Qwen3VLCheckpoints(QwenCheckpoints):
    """The recipe of `qwen3_vl` or `qwen3_vl_moe` (each with its `presets`); its option is
    `processor` (`ProcessorSpec` fields, the video bounds counting the whole clip's pixels)."""

    def __init__(
        self, model_type: str, model_class: str, config_class: str, presets: Mapping[str, Preset]
    ) -> None:
        super().__init__(model_type, model_class, config_class)
        self.presets = presets

    def resolve(self, preset: str, text: Fields, vision: Fields, options: Fields) -> dict[str, Any]:
        """M-RoPE sections follow 24:20:20 unless overridden; the vision output width follows
        the text hidden size."""
        base = self.presets[preset]
        resolved_text = {"vocab_size": VOCAB_SIZE, **base.text, **text}
        resolved_text.setdefault(
            "rope_parameters",
            {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": mrope_section(resolved_text["head_dim"]),
                "mrope_interleaved": True,
            },
        )
        resolved_vision = {
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            **base.vision,
            "out_hidden_size": resolved_text["hidden_size"],
            **vision,
        }
        processor = ProcessorSpec(
            **{**dataclasses.asdict(DEFAULT_PROCESSOR), **(options.get("processor") or {})}
        )
        return {
            "text": resolved_text,
            "vision": resolved_vision,
            "options": {"processor": dataclasses.asdict(processor)},
        }

    def check(self, spec: CheckpointSpec) -> None:
        sections = spec.text["rope_parameters"].get("mrope_section", ())
        name, rotary_dim = self.rotary_dim(spec.text)
        if sum(sections) != rotary_dim // 2:
            raise ValueError(
                f"text rope_parameters.mrope_section={sections} must sum to "
                f"{name} / 2 = {rotary_dim // 2}"
            )
        if spec.vision["out_hidden_size"] != spec.text["hidden_size"]:
            raise ValueError(
                f"vision out_hidden_size={spec.vision['out_hidden_size']} must equal text "
                f"hidden_size={spec.text['hidden_size']}"
            )

    @staticmethod
    def rotary_dim(text: Fields) -> tuple[str, int]:
        """How many of each head's dims rotate, and their name in errors: all of them."""
        return "head_dim", text["head_dim"]

    def processor_files(self, spec: CheckpointSpec) -> dict[str, dict[str, Any]]:
        budget = ProcessorSpec(**spec.options["processor"])

        def shared(min_pixels: int, max_pixels: int) -> dict[str, Any]:
            return {
                "do_convert_rgb": True,
                "do_normalize": True,
                "do_rescale": True,
                "do_resize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "merge_size": spec.vision["spatial_merge_size"],
                "patch_size": spec.vision["patch_size"],
                "processor_class": "Qwen3VLProcessor",
                "resample": 3,  # bicubic
                "rescale_factor": 1 / 255,
                "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
                "temporal_patch_size": spec.vision["temporal_patch_size"],
            }

        return {
            "preprocessor_config.json": {
                **shared(budget.image_min_pixels, budget.image_max_pixels),
                "image_processor_type": "Qwen2VLImageProcessorFast",
            },
            "video_preprocessor_config.json": {
                **shared(budget.video_min_pixels, budget.video_max_pixels),
                "video_processor_type": "Qwen3VLVideoProcessor",
                "fps": 2,
                "min_frames": 4,
                "max_frames": 768,
            },
        }

    def randomize(self, model: nn.Module) -> None:
        """Draw the norm scales (q / k head norms, layer norms) transformers sets to one, and
        the LayerNorm biases it sets to zero, from torch's global RNG."""
        import torch

        with torch.no_grad():
            for name, parameter in model.named_parameters():
                leaf = name.rsplit(".", 2)
                if leaf[-1] in ("weight", "bias") and "norm" in leaf[-2]:
                    parameter.add_(torch.randn_like(parameter), alpha=NORM_WEIGHT_STD)


QWEN3_VL_CHECKPOINTS = Qwen3VLCheckpoints(
    "qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLConfig", PRESETS
)
QWEN3_VL_MOE_CHECKPOINTS = Qwen3VLCheckpoints(
    "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig", MOE_PRESETS
)
