"""The registry entries of Qwen3.5: `qwen3_5` (dense MLPs) and `qwen3_5_moe` (a mixture with a
shared expert), both the Gated DeltaNet hybrid language model with Qwen3-VL's tower (without
DeepStack), whole-clip preprocessing and timestamped per-tubelet prompt, which live sessions and
narration write as Qwen3-VL's do (a question forks a held prefix from its recurrent-state
snapshot; narration appends go through the held request's own states). The tower and media
being Qwen3-VL's, so are the per-request pixel budget and EVS before the tower (the tower
encodes a subset of a tubelet's merge groups)."""

from __future__ import annotations

import dataclasses

from stillcut.engine.models.qwen2_vl.entry import QWEN_WEIGHT_PREFIXES
from stillcut.engine.models.qwen3_5.config import qwen3_5_cache_groups, read_qwen3_5
from stillcut.engine.models.qwen3_vl.pixel_budget import PIXEL_BUDGET
from stillcut.engine.models.qwen3_vl.prompt import TIMESTAMP, TimestampedTubeletFormat
from stillcut.engine.models.registry import ModelFamily

# Releases keep their multi-token-prediction layers at the top level (`mtp.*`); read as the
# language model's, where its loader skips them.
QWEN3_5_WEIGHT_PREFIXES = {**QWEN_WEIGHT_PREFIXES, "mtp.": "language_model.mtp."}
QWEN3_5 = ModelFamily(
    model_type="qwen3_5",
    read_config=read_qwen3_5,
    cache_groups=qwen3_5_cache_groups,
    language_model="stillcut.engine.models.qwen3_5.model:Qwen35LanguageModel",
    vision_tower="stillcut.engine.models.qwen3_vl.tower:Qwen3VLVisionTower",
    media="stillcut.engine.models.qwen3_vl.media:Qwen3Media",
    prompt_format=TimestampedTubeletFormat(),
    positions="mrope",
    live_sessions=True,
    narration_timestamp=TIMESTAMP,
    weight_prefixes=QWEN3_5_WEIGHT_PREFIXES,
    pixel_budget=PIXEL_BUDGET,
    pixel_stage_refusal=None,
    checkpoints="stillcut.engine.models.qwen3_5.checkpoint:QWEN3_5_CHECKPOINTS",
)
QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5,
    model_type="qwen3_5_moe",
    checkpoints="stillcut.engine.models.qwen3_5.checkpoint:QWEN3_5_MOE_CHECKPOINTS",
)
