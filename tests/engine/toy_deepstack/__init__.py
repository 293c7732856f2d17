"""A throwaway family with DeepStack-like extra features, registered from a test.

Its tower is Qwen2.5-VL's plus one projection per injected layer: beside each visual token's
embedding it gives `deepstack.k` = that embedding through projection k. Its language model is
Qwen2's, adding `deepstack.k` to the hidden states at the visual positions after decoder layer
k (k = 0, 1). Everything else (config, preprocessing, positions, prompts, tokenizer) is
Qwen2.5-VL's. `ENTRY` is its one registry entry; `checkpoint.build_checkpoint` writes a tiny
checkpoint; `reference` is a plain full-sequence forward of the same weights.
"""

import dataclasses

from stillcut.engine.models.qwen2_vl.entry import QWEN2_5_VL

MODEL_TYPE = "toy_deepstack"
FEATURES = ("deepstack.0", "deepstack.1")  # one per injected decoder layer, in layer order

ENTRY = dataclasses.replace(
    QWEN2_5_VL,
    model_type=MODEL_TYPE,
    language_model="toy_deepstack.language_model:DeepStackLanguageModel",
    vision_tower="toy_deepstack.tower:DeepStackTower",
    checkpoints=None,  # its tiny checkpoints come from `checkpoint.build_checkpoint`
)
