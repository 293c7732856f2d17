"""Language models the runner can drive, by checkpoint family (config.json `model_type`).

Each model runs a flat batch of N tokens per step over a paged KV cache and keeps its own
specifics (weight layout, positions) in its file; the runner only calls `forward`,
`compute_logits` and `kv_cache_shape`.
"""

from __future__ import annotations

from types import MappingProxyType

from stillcut.engine.models.qwen2 import Qwen2LanguageModel

MODEL_CLASSES = MappingProxyType({"qwen2_5_vl": Qwen2LanguageModel, "qwen2_vl": Qwen2LanguageModel})

__all__ = ["MODEL_CLASSES", "Qwen2LanguageModel"]
