"""The toy family's language model: Qwen2's, adding `deepstack.k` after decoder layer k."""

import torch
import torch.nn.functional as F

from stillcut.engine.models.qwen2_vl.model import Qwen2LanguageModel
from toy_deepstack import FEATURES


class DeepStackLanguageModel(Qwen2LanguageModel):
    mm_feature_names = FEATURES

    def run_layers(
        self, hidden, positions, kv_caches, metadata, mm_mask=None, mm_features=None
    ) -> torch.Tensor:
        """Qwen2's decoder; `mm_features[FEATURES[k]]` [M, hidden] (the rows of the step's
        item tokens) is added at the rows `mm_mask` marks after layer k."""
        cos, sin = self.rotary(positions, hidden.dtype)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, cos, sin, kv_cache, metadata)
            if mm_features is not None and index < len(FEATURES):
                hidden[mm_mask] += mm_features[FEATURES[index]].to(hidden.dtype)
        return F.rms_norm(hidden, hidden.shape[-1:], self.norm, self.config.rms_norm_eps)
