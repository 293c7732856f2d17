"""Build a checkpoint's vision encoder and load its weights.

The encoder is built on the meta device, so no memory is allocated or initialised for weights
that the checkpoint replaces anyway; `load_weights` then assigns the checkpoint's tensors.
Qwen towers take packed patches and grids; Gemma 3's encoder takes square images.
"""

from __future__ import annotations

from os import PathLike

import torch

from stillcut.engine.gemma3_config import SiglipVisionConfig
from stillcut.engine.loader import load_model_config, load_weights, resolve_checkpoint
from stillcut.engine.model_config import VisionConfig
from stillcut.vision.qwen2_5_vl import Qwen2_5_VLVisionTower
from stillcut.vision.qwen2_vl import Qwen2VLVisionTower
from stillcut.vision.siglip import Gemma3VisionEncoder

VISION_PREFIX = "visual."
VisionTower = Qwen2VLVisionTower | Gemma3VisionEncoder
_TOWER_CLASSES: dict[str, type[VisionTower]] = {
    "qwen2_5_vl": Qwen2_5_VLVisionTower,
    "qwen2_vl": Qwen2VLVisionTower,
    "gemma3": Gemma3VisionEncoder,
}


def build_vision_tower(
    config: VisionConfig | SiglipVisionConfig, device: torch.device | str = "cpu"
) -> VisionTower:
    """A freshly initialised encoder of `config.family` on `device` ("meta" allocates nothing)."""
    with torch.device(device):
        return _TOWER_CLASSES[config.family](config)


def load_vision_tower(
    model: str | PathLike[str],
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str = "cpu",
) -> VisionTower:
    """The vision encoder of a checkpoint folder or hub id, weights loaded, in eval mode."""
    path = resolve_checkpoint(model)
    tower = build_vision_tower(load_model_config(path).vision, device="meta")
    load_weights(tower, path, prefix=VISION_PREFIX, dtype=dtype, device=device)
    return tower.eval()
