"""Language models the runner can drive, and the family registry that names them.

Each model runs a flat batch of N tokens per step over its caches and keeps its own specifics
(weight layout, positions) in its file; the runner only calls `forward`, `compute_logits` and
`prompt_positions`. `bidirectional_item_tokens` is the most tokens one bidirectional item (an
image whose tokens see each other both ways) can hold, 0 where the model cannot say. Which
class serves a checkpoint, and everything else family-specific, is its registry entry
(`registry`, `families`).
"""

from stillcut.engine.models.gemma3.model import Gemma3LanguageModel
from stillcut.engine.models.nemotron_omni.model import NemotronHLanguageModel
from stillcut.engine.models.qwen2_vl.model import Qwen2LanguageModel

__all__ = ["Gemma3LanguageModel", "NemotronHLanguageModel", "Qwen2LanguageModel"]
