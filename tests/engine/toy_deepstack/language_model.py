"""The toy family's language model: Qwen2's, adding `deepstack.k` after decoder layer k."""

import torch
import torch.nn.functional as F

from stillcut.engine.models.qwen2 import Qwen2LanguageModel
from toy_deepstack import FEATURES


class DeepStackLanguageModel(Qwen2LanguageModel):
    mm_feature_names = FEATURES

    def forward(
        self,
        input_ids,
        positions,
        kv_caches,
        metadata,
        mm_embeds=None,
        mm_mask=None,
        mm_features=None,
    ) -> torch.Tensor:
        """Qwen2's forward; `mm_features[FEATURES[k]]` [M, hidden] (the rows of `mm_embeds`)
        is added at the rows `mm_mask` marks after layer k."""
        native = self.native_decode(input_ids, positions, kv_caches, metadata, mm_embeds)
        if native is not None:
            return native  # decodes carry no item tokens
        hidden = self.embed(input_ids)  # [N, hidden]
        if mm_embeds is not None:
            hidden[mm_mask] = mm_embeds.to(hidden.dtype)
        cos, sin = self.rotary(positions, hidden.dtype)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, cos, sin, kv_cache, metadata)
            if mm_embeds is not None and index < len(FEATURES):
                hidden[mm_mask] += mm_features[FEATURES[index]].to(hidden.dtype)
        return F.rms_norm(hidden, hidden.shape[-1:], self.norm, self.config.rms_norm_eps)
