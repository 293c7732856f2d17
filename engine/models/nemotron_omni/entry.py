"""The registry entry of Nemotron 3 Nano Omni: a RADIO tower on 2-frame tubelets, EVS native to
the checkpoint, a hybrid Mamba2 / MoE / attention language model without positions."""

from __future__ import annotations

from types import MappingProxyType

from stillcut.engine.models.nemotron_omni.config import nemotron_evs_rate, read_nemotron_omni
from stillcut.engine.models.nemotron_omni.prompt import TubeletChunkFormat
from stillcut.engine.models.nemotron_omni.text_config import nemotron_cache_groups
from stillcut.engine.models.registry import ModelFamily

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
    language_model="stillcut.engine.models.nemotron_omni.model:NemotronHLanguageModel",
    vision_tower="stillcut.engine.models.nemotron_omni.tower:RadioVisionTower",
    media="stillcut.engine.models.nemotron_omni.media:NemotronMedia",
    prompt_format=TubeletChunkFormat(),
    positions="none",
    native_evs_rate=nemotron_evs_rate,
    weight_prefixes=NEMOTRON_WEIGHT_PREFIXES,
    pixel_stage_refusal=(
        "Nemotron 3 Nano Omni's RADIO tower attends over every patch of a tubelet in every "
        "block, through cls and register tokens too (a pruned tubelet would change every kept "
        "token), and the checkpoint's own video_pruning_rate is defined on the tower's output"
    ),
    checkpoints="stillcut.engine.models.nemotron_omni.checkpoint:NEMOTRON_CHECKPOINTS",
)
