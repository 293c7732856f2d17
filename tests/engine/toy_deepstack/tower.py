"""The toy family's tower: Qwen2.5-VL's, plus one extra feature set per injected layer."""

import torch
from torch import nn

from stillcut.engine.models.qwen2_vl.tower_2_5 import Qwen2_5_VLVisionTower
from stillcut.engine.multimodal import TowerOutput
from toy_deepstack import FEATURES


class DeepStackTower(Qwen2_5_VLVisionTower):
    """Stored as `visual.deepstack.{k}.weight` `[out_hidden, out_hidden]` beside the tower's."""

    def __init__(self, config) -> None:
        super().__init__(config)
        width = config.out_hidden_size
        self.deepstack = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in FEATURES)

    def encode(
        self, patches_list: list[torch.Tensor], grids: list, kept: list | None = None
    ) -> list[TowerOutput]:
        """Each input's embeddings [tokens, out_hidden] (with `kept`, per input a bool mask
        or None, the kept tokens') and its `deepstack.k` of the same rows."""
        encoded = super().encode(patches_list, grids, kept)
        return [
            TowerOutput(
                embeds, {n: proj(embeds) for n, proj in zip(FEATURES, self.deepstack, strict=True)}
            )
            for embeds in encoded
        ]
