"""The built-in model families, one registry entry each (see `registry`).

To add a family, write its own files (config reader, language model, vision tower, media
preprocessing, prompt format) and register one `ModelFamily` here, or from your own code with
`FAMILIES.register(...)` before loading a checkpoint of it.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from stillcut.engine.models.gemma3_config import read_gemma3
from stillcut.engine.models.gemma3_text_config import gemma3_cache_groups
from stillcut.engine.models.nemotron_config import nemotron_evs_rate, read_nemotron_omni
from stillcut.engine.models.nemotron_prompt import TubeletChunkFormat
from stillcut.engine.models.nemotron_text_config import nemotron_cache_groups
from stillcut.engine.models.qwen2_vl_config import (
    qwen2_cache_groups,
    read_qwen2_5_vl,
    read_qwen2_vl,
)
from stillcut.engine.models.registry import FamilyRegistry, ModelFamily
from stillcut.engine.prompt_formats import ImageSequenceFormat, PromptFormat

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
# Gemma 3's original releases save `vision_tower.vision_model.*` / `multi_modal_projector.*` /
# `language_model.model.*` (transformers 5.x without `vision_model.`), transformers 4.5x the
# same under `model.` plus `model.language_model.*` and `lm_head.*`. Everything that turns pixels
# into language-model embeddings is canonically `visual.`.
GEMMA3_WEIGHT_PREFIXES = MappingProxyType(
    {
        "model.vision_tower.vision_model.": "visual.vision_tower.",
        "model.vision_tower.": "visual.vision_tower.",
        "vision_tower.vision_model.": "visual.vision_tower.",
        "vision_tower.": "visual.vision_tower.",
        "model.multi_modal_projector.": "visual.multi_modal_projector.",
        "multi_modal_projector.": "visual.multi_modal_projector.",
        "language_model.model.": "language_model.",
        "language_model.lm_head.": "lm_head.",
        "model.language_model.": "language_model.",
        "lm_head.": "lm_head.",
    }
)

QWEN2_5_VL = ModelFamily(
    model_type="qwen2_5_vl",
    read_config=read_qwen2_5_vl,
    cache_groups=qwen2_cache_groups,
    language_model="stillcut.engine.models.qwen2:Qwen2LanguageModel",
    vision_tower="stillcut.vision.qwen2_5_vl:Qwen2_5_VLVisionTower",
    media="stillcut.vision.qwen_media:QwenMedia",
    prompt_format=PromptFormat(),
    positions="mrope",
    live_sessions=True,
    narration_timestamp="<{t:.1f}s>",
    weight_prefixes=QWEN_WEIGHT_PREFIXES,
    pixel_budget=("min_pixels", "max_pixels"),
)
QWEN2_VL = dataclasses.replace(
    QWEN2_5_VL,
    model_type="qwen2_vl",
    read_config=read_qwen2_vl,
    vision_tower="stillcut.vision.qwen2_vl:Qwen2VLVisionTower",
)
GEMMA3 = ModelFamily(
    model_type="gemma3",
    read_config=read_gemma3,
    cache_groups=gemma3_cache_groups,
    language_model="stillcut.engine.models.gemma3:Gemma3LanguageModel",
    vision_tower="stillcut.vision.siglip:Gemma3VisionEncoder",
    media="stillcut.vision.gemma3_media:Gemma3Media",
    # transformers' Gemma3Processor: "\n\n<start_of_image>" + soft tokens + "<end_of_image>\n\n"
    prompt_format=ImageSequenceFormat(before="\n\n", after="\n\n"),
    positions="1d",
    bidirectional_items=True,
    has_video_token=False,
    weight_prefixes=GEMMA3_WEIGHT_PREFIXES,
)

# Nemotron 3 Nano Omni's releases save `language_model.backbone.*` (`language_model.lm_head.*`
# for the head), `vision_model.radio_model.*` for RADIO and `mlp1.*` for the projector, and
# `vision_projector.*` for the vision features' final norm when the model has MTP layers;
# transformers 5.x saves the same names. Its audio branch (`sound_*`) is never read.
NEMOTRON_WEIGHT_PREFIXES = MappingProxyType(
    {
        "language_model.backbone.": "language_model.",
        "language_model.lm_head.": "lm_head.",
        "vision_model.": "visual.",
        "mlp1.": "visual.mlp1.",
        "vision_projector.": "visual.vision_projector.",
    }
)
NEMOTRON_H_OMNI = ModelFamily(
    model_type="nemotron_h_omni",
    read_config=read_nemotron_omni,
    cache_groups=nemotron_cache_groups,
    language_model="stillcut.engine.models.nemotron_h:NemotronHLanguageModel",
    vision_tower="stillcut.vision.radio:RadioVisionTower",
    media="stillcut.vision.nemotron_media:NemotronMedia",
    prompt_format=TubeletChunkFormat(),
    positions="none",
    native_evs_rate=nemotron_evs_rate,
    weight_prefixes=NEMOTRON_WEIGHT_PREFIXES,
)

FAMILIES = FamilyRegistry()
for _entry in (QWEN2_5_VL, QWEN2_VL, GEMMA3, NEMOTRON_H_OMNI):
    FAMILIES.register(_entry)
