"""The registry entry of Gemma 3: SigLIP images pooled into soft tokens, each frame of a video
an image item whose tokens attend to each other both ways, 1-D positions."""

from __future__ import annotations

from types import MappingProxyType

from stillcut.engine.models.gemma3.config import read_gemma3
from stillcut.engine.models.gemma3.text_config import gemma3_cache_groups
from stillcut.engine.models.registry import ModelFamily
from stillcut.engine.prompt_formats import ImageSequenceFormat

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

GEMMA3 = ModelFamily(
    model_type="gemma3",
    read_config=read_gemma3,
    cache_groups=gemma3_cache_groups,
    language_model="stillcut.engine.models.gemma3.model:Gemma3LanguageModel",
    vision_tower="stillcut.engine.models.gemma3.tower:Gemma3VisionEncoder",
    media="stillcut.engine.models.gemma3.media:Gemma3Media",
    # transformers' Gemma3Processor: "\n\n<start_of_image>" + soft tokens + "<end_of_image>\n\n"
    prompt_format=ImageSequenceFormat(before="\n\n", after="\n\n"),
    positions="1d",
    bidirectional_items=True,
    has_video_token=False,
    weight_prefixes=GEMMA3_WEIGHT_PREFIXES,
    pixel_stage_refusal=(
        "Gemma 3's SigLIP tower encodes each frame whole: every layer attends over the whole "
        "square (no windows, so a pruned frame would change every kept token), a token pools a "
        "4x4 square of patches, and its CUDA graphs are captured per frame shape"
    ),
    checkpoints="stillcut.engine.models.gemma3.checkpoint:GEMMA3_CHECKPOINTS",
)
