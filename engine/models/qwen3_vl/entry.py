"""The registry entries of Qwen3-VL: `qwen3_vl` (the dense Qwen3 language model) and
`qwen3_vl_moe` (Qwen3-MoE), both with DeepStack, the Qwen3-VL tower, whole-clip
preprocessing and the timestamped per-tubelet prompt, which live sessions and narration write
as the processor does."""

from __future__ import annotations

import dataclasses

from stillcut.engine.models.qwen2_vl.entry import QWEN_WEIGHT_PREFIXES
from stillcut.engine.models.qwen3_vl.config import qwen3_cache_groups, read_qwen3_vl
from stillcut.engine.models.qwen3_vl.pixel_budget import PIXEL_BUDGET
from stillcut.engine.models.qwen3_vl.prompt import TIMESTAMP, TimestampedTubeletFormat
from stillcut.engine.models.registry import ModelFamily

QWEN3_VL = ModelFamily(
    model_type="qwen3_vl",
    read_config=read_qwen3_vl,
    cache_groups=qwen3_cache_groups,
    language_model="stillcut.engine.models.qwen3_vl.model:Qwen3LanguageModel",
    vision_tower="stillcut.engine.models.qwen3_vl.tower:Qwen3VLVisionTower",
    media="stillcut.engine.models.qwen3_vl.media:Qwen3Media",
    prompt_format=TimestampedTubeletFormat(),
    positions="mrope",
    live_sessions=True,
    narration_timestamp=TIMESTAMP,
    weight_prefixes=QWEN_WEIGHT_PREFIXES,
    pixel_budget=PIXEL_BUDGET,
    pixel_stage_refusal=None,
    checkpoints="stillcut.engine.models.qwen3_vl.checkpoint:QWEN3_VL_CHECKPOINTS",
)
QWEN3_VL_MOE = dataclasses.replace(
    QWEN3_VL,
    model_type="qwen3_vl_moe",
    language_model="stillcut.engine.models.qwen3_vl.moe_model:Qwen3MoeLanguageModel",
    checkpoints="stillcut.engine.models.qwen3_vl.checkpoint:QWEN3_VL_MOE_CHECKPOINTS",
)
