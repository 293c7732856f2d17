"""Language models the runner can drive, by checkpoint family (config.json `model_type`).

Each model runs a flat batch of N tokens per step over a paged KV cache and keeps its own
specifics (weight layout, positions) in its file; the runner only calls `forward`,
`compute_logits`, `prompt_positions` and `kv_cache_shape`, and reads `num_layers` and
`num_position_rows`. `bidirectional_item_tokens` is the most tokens one bidirectional item
(an image whose tokens see each other both ways) can hold, 0 for a model without them.
"""

from __future__ import annotations

from types import MappingProxyType

from stillcut.engine.models.gemma3 import Gemma3LanguageModel
from stillcut.engine.models.qwen2 import Qwen2LanguageModel

MODEL_CLASSES = MappingProxyType(
    {
        "qwen2_5_vl": Qwen2LanguageModel,
        "qwen2_vl": Qwen2LanguageModel,
        "gemma3": Gemma3LanguageModel,
    }
)

__all__ = ["MODEL_CLASSES", "Gemma3LanguageModel", "Qwen2LanguageModel"]
