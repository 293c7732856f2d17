"""Qwen3.5 test checkpoints: presets and the recipe.

Built with transformers' own `Qwen3_5ForConditionalGeneration` (and its MoE twin) from a
preset's few sizes; everything else follows the published Qwen3.5 checkpoints: three Gated
DeltaNet layers to one full-attention layer, a quarter of each attention head rotated by
interleaved M-RoPE, the Qwen3-VL tower without DeepStack and its processor configs.

Tokenizer: Qwen3.5's own (`Qwen3_5Tokenizer`, a 248k vocabulary) is not available offline, so
the checkpoint carries the real Qwen2.5 tokenizer and vocabulary size, and its config's media
token ids are remapped to that tokenizer's (`<|image_pad|>` 151655 for Qwen3.5's 248056, and
so on). Chat template: the Qwen2.5-VL one, as the Qwen3-VL recipe explains.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from stillcut.engine.factory.recipe import Fields, Preset
from stillcut.engine.models.qwen3_vl.checkpoint import Qwen3VLCheckpoints, mrope_section

PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3.5's: a quarter of each head's dims rotate

PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        # Builds in about a second: layers DeltaNet, DeltaNet, DeltaNet, attention (Qwen3.5's
        # 3:1), heads of 32 so that the rotated quarter holds a frequency of each of t, h, w.
        "tiny": Preset(
            dtype="float32",
            text={
                "hidden_size": 32,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "intermediate_size": 64,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 8,
                "linear_value_head_dim": 8,
                "linear_conv_kernel_dim": 4,
            },
            vision={
                "depth": 2,
                "hidden_size": 32,
                "num_heads": 2,
                "intermediate_size": 64,
                "num_position_embeddings": 16,
            },
            # its own head: a tied tiny model mostly repeats its input token
            tie_word_embeddings=False,
        ),
        # The benches' shape (`bench/hybrid_prefix.py`, `bench/decode_roofline.py`): 105M
        # language-model parameters (78M of them the tied embedding), six DeltaNet layers and
        # two attention layers, 64-wide heads.
        "bench": Preset(
            dtype="bfloat16",
            text={
                "hidden_size": 512,
                "num_hidden_layers": 8,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "intermediate_size": 1536,
                "linear_num_key_heads": 4,
                "linear_num_value_heads": 8,
                "linear_key_head_dim": 64,
                "linear_value_head_dim": 64,
                "linear_conv_kernel_dim": 4,
            },
            vision={
                "depth": 4,
                "hidden_size": 256,
                "num_heads": 4,
                "intermediate_size": 768,
                "num_position_embeddings": 256,
            },
        ),
    }
)
_TINY = PRESETS["tiny"]
MOE_PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        # The tiny dense shape with four experts, two per token, and a shared expert in
        # every layer (Qwen3.5-MoE has no dense layers).
        "tiny": dataclasses.replace(
            _TINY,
            text={
                **_TINY.text,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
            },
        ),
    }
)


class Qwen35Checkpoints(Qwen3VLCheckpoints):
    """The recipe of `qwen3_5` or `qwen3_5_moe`: Qwen3-VL's (processor configs, the Qwen2.5
    tokenizer and ids, random norm scales) with Qwen3.5's partial rotary."""

    def resolve(self, preset: str, text: Fields, vision: Fields, options: Fields) -> dict[str, Any]:
        """M-RoPE sections follow Qwen3-VL's ratio over the rotated quarter of each head."""
        head_dim = text.get("head_dim", self.presets[preset].text["head_dim"])
        rope = {
            "rope_type": "default",
            "rope_theta": 1e7,
            "mrope_section": mrope_section(int(head_dim * PARTIAL_ROTARY_FACTOR)),
            "mrope_interleaved": True,
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
        }
        return super().resolve(preset, {"rope_parameters": rope, **text}, vision, options)

    @staticmethod
    def rotary_dim(text: Fields) -> tuple[str, int]:
        """How many of each head's dims rotate: `partial_rotary_factor` of them."""
        factor = text["rope_parameters"].get("partial_rotary_factor", 1.0)
        return "rotary_dim", int(text["head_dim"] * factor)


QWEN3_5_CHECKPOINTS = Qwen35Checkpoints(
    "qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5Config", PRESETS
)
QWEN3_5_MOE_CHECKPOINTS = Qwen35Checkpoints(
    "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig", MOE_PRESETS
)
