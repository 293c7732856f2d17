"""Nemotron 3 Nano Omni test checkpoints: presets, config, processor files and recipe.

`tiny` keeps what a Nemotron engine must get right and little else: all four layer kinds
(Mamba2, MoE, attention, MLP) in a short stack, 8 experts in 2 groups (one kept) with top-2
routing, a scaling factor and a shared expert, Mamba2 chunks of 16 tokens (so prompts span
several), time steps spread across `time_step_min` (its prompt-only clamp is in play), a RADIO
tower on 16-pixel patches with cls and register tokens, EVS on by default
(`video_pruning_rate` 0.5), and the trained tiny tokenizer. `bench` is a ~120M-parameter
hybrid for speed work. transformers initialises the router's correction bias to zero and every
norm scale and RADIO layer scale to one; the builder draws them at random instead, so that a
bias, norm or scale left out shows; it also spreads the Mamba2 time steps and shrinks the skip
term, so the scan weighs in.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from stillcut.engine.factory.recipe import CheckpointRecipe, Fields, Preset, random_marks
from stillcut.engine.models.nemotron_omni.tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IMAGE_TOKEN_ID,
    TOKENIZER,
    UNK_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VOCAB_SIZE,
)
from stillcut.engine.models.pixels import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

if TYPE_CHECKING:
    from torch import nn
    from transformers import NemotronH_Omni_Reasoning_V3_Config

    from stillcut.engine.factory.checkpoints import CheckpointSpec

GENERATION_IDS = MappingProxyType(
    {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": UNK_TOKEN_ID}
)
NORM_WEIGHT_STD = 0.1  # random norm and layer scales: 1 + N(0, 0.1)
CORRECTION_BIAS_STD = 0.05  # the router's expert-choice bias: N(0, 0.05)
DT_LOG_RANGE = (math.log(1e-3), math.log(1.0))
SKIP_RANGE = (-0.2, 0.2)  # the Mamba2 skip D: small, so the scan, not the skip, dominates

# Fields outside text_config / vision_config: the model's, then its processors' settings.
_TOP_DEFAULTS = MappingProxyType(
    {
        "projector_hidden_size": 48,
        "downsample_ratio": 0.5,
        "video_pruning_rate": 0.5,
        "video_temporal_patch_size": 2,
    }
)
_PROCESSOR_DEFAULTS = MappingProxyType(
    {
        "video_target_num_patches": 64,
        "min_num_patches": 16,
        "max_num_patches": 256,
        "max_model_len": 4096,
    }
)
_TINY_LAYERS = ("mamba", "moe", "attention", "mamba", "mlp", "attention")
_BENCH_LAYERS = ("mamba", "moe", "mamba", "attention", "moe") * 3 + ("mamba", "mlp", "moe")

NEMOTRON_PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "tiny": Preset(
            dtype="float32",
            tie_word_embeddings=False,  # as its releases
            text={
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "intermediate_size": 128,
                "mamba_num_heads": 8,
                "mamba_head_dim": 8,
                "ssm_state_size": 16,
                "n_groups": 2,
                "conv_kernel": 4,
                "chunk_size": 16,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "n_group": 2,
                "topk_group": 1,
                "moe_intermediate_size": 32,
                "moe_shared_expert_intermediate_size": 48,
                "routed_scaling_factor": 2.5,
                "time_step_min": 0.03,
            },
            vision={
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "patch_size": 16,
                "max_img_size": 512,
                "num_cls_tokens": 2,
                "num_registers": 2,
            },
        ),
        "bench": Preset(
            dtype="bfloat16",
            tie_word_embeddings=False,
            text={
                "hidden_size": 768,
                "num_attention_heads": 12,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "intermediate_size": 2048,
                "mamba_num_heads": 24,
                "mamba_head_dim": 64,
                "ssm_state_size": 64,
                "n_groups": 4,
                "conv_kernel": 4,
                "chunk_size": 128,
                "n_routed_experts": 16,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "moe_intermediate_size": 512,
                "moe_shared_expert_intermediate_size": 1024,
                "routed_scaling_factor": 2.5,
            },
            vision={
                "hidden_size": 256,
                "num_hidden_layers": 6,
                "num_attention_heads": 4,
                "patch_size": 16,
                "max_img_size": 1024,
                "num_cls_tokens": 3,
                "num_registers": 7,
            },
        ),
    }
)
_PRESET_LAYERS = MappingProxyType({"tiny": _TINY_LAYERS, "bench": _BENCH_LAYERS})
_PRESET_PROJECTOR = MappingProxyType({"tiny": 48, "bench": 1024})


class NemotronCheckpoints(CheckpointRecipe):
    """Nemotron 3 Nano Omni's recipe; its option is `extra`: the top-level config fields and
    the processors' patch budgets (`video_target_num_patches`, `min_num_patches`,
    `max_num_patches`, `max_model_len`)."""

    model_class = "NemotronH_Omni_Reasoning_V3"
    presets = NEMOTRON_PRESETS
    option_names = ("extra",)
    generation_ids = GENERATION_IDS
    tokenizer = TOKENIZER

    def resolve(self, preset: str, text: Fields, vision: Fields, options: Fields) -> dict[str, Any]:
        base = NEMOTRON_PRESETS[preset]
        resolved_text = {
            "vocab_size": VOCAB_SIZE,
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": UNK_TOKEN_ID,
            "layers_block_type": list(_PRESET_LAYERS[preset]),
            **base.text,
            **text,
        }
        # transformers derives the depth from the layer list; the spec states it for its checks
        resolved_text["num_hidden_layers"] = len(resolved_text["layers_block_type"])
        extra = {
            **_TOP_DEFAULTS,
            "projector_hidden_size": _PRESET_PROJECTOR[preset],
            **_PROCESSOR_DEFAULTS,
            **(options.get("extra") or {}),
        }
        return {
            "text": resolved_text,
            "vision": {"video_temporal_patch_size": 2, **base.vision, **vision},
            "options": {"extra": extra},
        }

    def check(self, spec: CheckpointSpec) -> None:
        if spec.text["vocab_size"] != VOCAB_SIZE:
            raise ValueError(
                f"text vocab_size={spec.text['vocab_size']} must equal the tokenizer's size "
                f"{VOCAB_SIZE}"
            )
        allowed = {*_TOP_DEFAULTS, *_PROCESSOR_DEFAULTS, "audio_config"}
        unknown = set(spec.options["extra"]) - allowed
        if unknown:
            raise ValueError(f"extra fields {sorted(unknown)}: allowed {sorted(allowed)}")

    def hf_config(self, spec: CheckpointSpec) -> NemotronH_Omni_Reasoning_V3_Config:
        from transformers import NemotronH_Omni_Reasoning_V3_Config

        extra = spec.options["extra"]
        top = {k: v for k, v in extra.items() if k not in _PROCESSOR_DEFAULTS}
        return NemotronH_Omni_Reasoning_V3_Config(
            text_config={
                **copy.deepcopy(spec.text),
                "tie_word_embeddings": spec.tie_word_embeddings,
            },
            vision_config=copy.deepcopy(spec.vision),
            vision_hidden_size=spec.vision["hidden_size"],
            image_token_id=IMAGE_TOKEN_ID,
            video_token_id=VIDEO_TOKEN_ID,
            **random_marks(spec),
            **copy.deepcopy(top),
        )

    def processor_files(self, spec: CheckpointSpec) -> dict[str, dict[str, Any]]:
        """The image and video processor configs."""
        extra, patch_size = spec.options["extra"], spec.vision["patch_size"]
        shared = {
            "patch_size": patch_size,
            "downsample_ratio": extra["downsample_ratio"],
            "processor_class": "NemotronH_Omni_Reasoning_V3Processor",
        }
        return {
            "preprocessor_config.json": {
                **shared,
                "image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor",
                "image_mean": list(OPENAI_CLIP_MEAN),
                "image_std": list(OPENAI_CLIP_STD),
                "min_num_patches": extra["min_num_patches"],
                "max_num_patches": extra["max_num_patches"],
                "max_model_len": extra["max_model_len"],
            },
            "video_preprocessor_config.json": {
                **shared,
                "video_processor_type": "NemotronH_Omni_Reasoning_V3VideoProcessor",
                "norm_mean": list(OPENAI_CLIP_MEAN),
                "norm_std": list(OPENAI_CLIP_STD),
                "video_target_num_patches": extra["video_target_num_patches"],
                "video_maintain_aspect_ratio": True,
                "temporal_patch_size": extra["video_temporal_patch_size"],
                "do_convert_rgb": False,
            },
        }

    def randomize(self, model: nn.Module) -> None:
        """Draw the weights transformers leaves at one or zero (norm and layer scales, the
        router's correction bias, the Mamba2 skip) and the Mamba2 time-step biases from torch's
        global RNG (seed it first)."""
        import torch

        with torch.no_grad():
            for name, parameter in model.named_parameters():
                leaf = name.rsplit(".", 2)
                if leaf[-1] == "lambda1" or (leaf[-1] == "weight" and "norm" in leaf[-2]):
                    parameter.add_(torch.randn_like(parameter), alpha=NORM_WEIGHT_STD)
                if name.endswith("dt_bias"):
                    # softplus(dt_bias) log-uniform over [1e-3, 1], some of it under the tiny
                    # preset's time_step_min, so the prompt-only clamp changes what the scan gives
                    dt = torch.exp(torch.empty_like(parameter).uniform_(*DT_LOG_RANGE))
                    parameter.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹
                if name.endswith("mixer.D"):
                    parameter.uniform_(*SKIP_RANGE)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, CORRECTION_BIAS_STD)


NEMOTRON_CHECKPOINTS = NemotronCheckpoints()
