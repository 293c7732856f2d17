"""The registry entries of Qwen2.5-VL and Qwen2-VL: one family folder, two `model_type`s.

Both share the language model (Qwen2 with M-RoPE), the media path and the prompt format;
Qwen2-VL differs in its config reader and its vision tower (LayerNorm, QuickGELU, no window
attention).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from stillcut.engine.models.qwen2_vl.config import (
    qwen2_cache_groups,
    read_qwen2_5_vl,
    read_qwen2_vl,
)
from stillcut.engine.models.registry import ModelFamily
from stillcut.engine.prompt_formats import PromptFormat

# Stored tensor-name prefix -> canonical prefix. Qwen's original releases (and transformers
# 5.x) save `visual.*` / `model.*` / `lm_head.*`; transformers 4.52 to 4.x saves
# `model.visual.*` / `model.language_model.*`.
QWEN_WEIGHT_PREFIXES = MappingProxyType(
    {
        "model.visual.": "visual.",
        "model.language_model.": "language_model.",
        "visual.": "visual.",
        "model.": "language_model.",
        "lm_head.": "lm_head.",
    }
)

QWEN2_5_VL = ModelFamily(
    model_type="qwen2_5_vl",
    read_config=read_qwen2_5_vl,
    cache_groups=qwen2_cache_groups,
    language_model="stillcut.engine.models.qwen2_vl.model:Qwen2LanguageModel",
    vision_tower="stillcut.engine.models.qwen2_vl.tower_2_5:Qwen2_5_VLVisionTower",
    media="stillcut.engine.models.qwen2_vl.media:QwenMedia",
    prompt_format=PromptFormat(),
    positions="mrope",
    live_sessions=True,
    narration_timestamp="<{t:.1f}s>",
    weight_prefixes=QWEN_WEIGHT_PREFIXES,
    pixel_budget=("min_pixels", "max_pixels"),
    pixel_stage_refusal=None,
    checkpoints="stillcut.engine.models.qwen2_vl.checkpoint:QWEN2_5_VL_CHECKPOINTS",
)
QWEN2_VL = dataclasses.replace(
    QWEN2_5_VL,
    model_type="qwen2_vl",
    read_config=read_qwen2_vl,
    checkpoints="stillcut.engine.models.qwen2_vl.checkpoint:QWEN2_VL_CHECKPOINTS",
    vision_tower="stillcut.engine.models.qwen2_vl.tower:Qwen2VLVisionTower",
)
